"""The device check: what one GPU says about hf_retrace, in one short run (a few minutes; docs/gpu.md).

1. **Greedy equality in fp32**: plain ``generate`` against the drafter (its shipped round policy, and full blocks) on
   the same prompts, token for token; a divergence is located and its top-2 logit gap printed
   (:func:`hf_retrace.divergence.find_divergence`).
2. **Host syncs per loop step**: inside the generator's two round methods (``get_candidates``,
   ``update_candidate_strategy``), the tensor-to-host conversions (``item``, ``tolist``, ``bool``, ``int``, ``float``,
   ``index``) and, on CUDA, the synchronising calls torch's sync debug mode reports there; at T=0, per policy (on a
   GPU the round reads the host once: the accelerator order of ``ReTraceCandidateGenerator``); and the per-token
   stop check's (one per round).
3. **This machine's costs in bf16**: the target's verify forward over k drafts in one-token steps (the verify-cost
   curve) and the drafter's round (:func:`hf_retrace.tuning.costs.measure_costs`), and the round policy a call gets
   here (tuned for this machine unless ``HF_RETRACE_POLICY`` says otherwise).
4. **bf16 timings**, warmed up and synchronised: plain, the default (the resolved policy), the shipped policy and full
   blocks (``--compile`` adds the default with a compiled drafter): tau, tokens/s, speed-up over plain (whole
   ``generate`` calls, prefill included), and whether each output equals plain's.

Prints Markdown tables and writes JSON (``--out``). Each section that fails is recorded and the run goes on; the exit
status is 1 when one failed or an fp32 output differed from plain's.

The target: ``--target FOLDER`` (a Hugging Face folder, e.g. the converted SmolLM2 in ``~/.cache/hf_retrace``), else
a **stand-in**: a randomly initialised Llama of SmolLM2-135M-Instruct's shape (the shipped drafter fits it), built
on the device with no download. A random target's text is not what the drafter learnt, so its drafts are rarely
accepted: on the stand-in, tau and the speed-up say nothing about the drafter; the costs, the syncs and the
equality do.

    python examples/device_check.py --out device_check.json                     # one GPU, the stand-in
    python examples/device_check.py --target ~/.cache/hf_retrace/smollm2-135m-instruct --out gpu.json
    python examples/device_check.py --smoke --out /tmp/smoke.json                # CPU, tiny models, seconds (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import hf_retrace
from hf_retrace import ReTraceConfig, ReTraceDrafter
from hf_retrace.divergence import find_divergence
from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator
from hf_retrace.generation.placement import synchronize
from hf_retrace.generation.policy import shipped_policy
from hf_retrace.generation.stopping import PerTokenStopping
from hf_retrace.loading import load_drafter
from hf_retrace.tuning.costs import measure_costs

# SmolLM2-135M-Instruct's shape (its config.json): what the shipped drafter was trained for
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
HOST_CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@dataclasses.dataclass
class Setting:
    prompts: int
    max_new_tokens: int
    prompt_length: int
    timing_repeats: int
    cost_context: int  # cached context length of the cost measurement
    cost_repeats: int


FULL = Setting(prompts=4, max_new_tokens=128, prompt_length=48, timing_repeats=2, cost_context=128, cost_repeats=3)
SMOKE = Setting(prompts=2, max_new_tokens=16, prompt_length=12, timing_repeats=1, cost_context=16, cost_repeats=1)


# --- models and prompts -----------------------------------------------------------------------------------------------


def stand_in_target(shape: dict, device: str, seed: int, logit_scale: float = 1.0) -> LlamaForCausalLM:
    """A randomly initialised Llama of ``shape``, built on ``device`` (float32; no download)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM(config).float().eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def tiny_drafter(target: Any, device: str, seed: int) -> ReTraceDrafter:
    """A random drafter for the tiny target, shaped like the shipped one (1 layer, a draft vocabulary, lookup and a
    confidence cut in its shipped policy)."""
    c = target.config
    config = ReTraceConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, block_size=6,
                           mask_token_id=None, learned_mask_embedding=True, target_layer_ids=[0, 2],
                           num_target_layers=c.num_hidden_layers, draft_confidence_threshold=0.3, lookup=True)
    torch.manual_seed(seed)
    drafter = ReTraceDrafter(config)
    drafter.set_draft_vocab(torch.randperm(c.vocab_size)[: c.vocab_size * 2 // 3])
    return drafter.to(device).float().eval()


def load_models(args: argparse.Namespace, setting: Setting) -> tuple[Any, Any, Any, str]:
    """(target in fp32, drafter in fp32, tokenizer or None, a line saying what the target is)."""
    if args.smoke:
        target = stand_in_target(TINY_SHAPE, args.device, args.seed, logit_scale=4.0)
        return target, tiny_drafter(target, args.device, args.seed), None, "tiny random Llama (smoke)"
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(args.device).eval()
        what, tokenizer = f"{args.target} (fp32 for equality, bf16 for costs and timings)", None
        with contextlib.suppress(Exception):
            tokenizer = AutoTokenizer.from_pretrained(args.target)
    else:
        target = stand_in_target(SMOLLM2_SHAPE, args.device, args.seed)
        what, tokenizer = "stand-in: randomly initialised Llama of SmolLM2-135M's shape (tau means nothing)", None
    return target, load_drafter(args.drafter, "fp32", device=args.device), tokenizer, what


def make_prompts(target: Any, tokenizer: Any, setting: Setting, seed: int) -> list[torch.Tensor]:
    """The first GSM8K questions of the benchmark with a tokenizer; otherwise random ids whose second half repeats
    their first (so context lookup has something to find)."""
    device = target.get_input_embeddings().weight.device
    if tokenizer is not None:
        from hf_retrace.chat import prompt_token_ids

        path = Path(hf_retrace.__file__).parent / "bench" / "data" / "gsm8k.jsonl"
        questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[: setting.prompts]]
        return [torch.tensor([ids], device=device) for ids in prompt_token_ids(tokenizer, questions)]
    generator = torch.Generator().manual_seed(seed)
    half = setting.prompt_length // 2
    prompts = []
    for _ in range(setting.prompts):
        first = torch.randint(0, target.config.vocab_size, (half,), generator=generator)
        prompts.append(torch.cat([first, first])[None].to(device))
    return prompts


def policies(drafter: Any) -> dict[str, Any]:
    """The drafter views each row runs: the call's resolved policy, the shipped one, and full blocks."""
    shipped = shipped_policy(drafter.config)
    return {"default": drafter, "shipped": drafter.with_policy(shipped),
            "full blocks": drafter.with_policy(shipped.replace(confidence_cut=None, lookup=False))}


# --- measuring --------------------------------------------------------------------------------------------------------


def greedy(target: Any, prompt: torch.Tensor, max_new_tokens: int, drafter: Any = None) -> list[int]:
    kwargs = {} if drafter is None else {"assistant_model": drafter}
    with torch.inference_mode():
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                              do_sample=False, **kwargs)
    return out[0, prompt.shape[1]:].tolist()


def equality(target: Any, views: dict[str, Any], prompts: list[torch.Tensor], max_new_tokens: int,
             dtype: str) -> dict[str, Any]:
    """Each view's greedy outputs against plain's: how many are identical, and where the others part (with the gap)."""
    plain = [greedy(target, p, max_new_tokens) for p in prompts]
    result = {}
    for name, view in views.items():
        divergences = []
        for prompt, reference in zip(prompts, plain):
            output = greedy(target, prompt, max_new_tokens, view)
            found = find_divergence(target, prompt, reference, output, dtype)
            if found is not None:
                divergences.append(dataclasses.asdict(found))
        result[name] = {"identical": len(prompts) - len(divergences), "of": len(prompts), "divergences": divergences}
    return result


ROUND_METHODS = ((ReTraceCandidateGenerator, "get_candidates"), (ReTraceCandidateGenerator, "update_candidate_strategy"))


@contextlib.contextmanager
def counting_host_syncs(cuda: bool, methods: tuple = ROUND_METHODS) -> Iterator[dict[str, Any]]:
    """Counts, inside ``methods`` only (``(class, name)`` pairs; by default the round's ``get_candidates`` and
    ``update_candidate_strategy``), the tensor-to-host conversions (on a GPU each one waits for the device) and, on
    CUDA, the synchronising calls ``torch.cuda.set_sync_debug_mode`` reports there. ``steps``: calls of the first
    method (the assisted loop's steps); ``per_step``: the conversions from each such call to the next."""
    counts: dict[str, Any] = {"steps": 0, "conversions": 0, "cuda_syncs": 0, "per_step": []}
    state = {"in_round": False, "converting": False}
    saved_tensor = {name: torch.Tensor.__dict__.get(name) for name in HOST_CONVERSIONS}
    saved_methods = [(owner, name, owner.__dict__[name]) for owner, name in methods]

    def conversion(name: str) -> Callable:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            if not state["in_round"] or state["converting"]:  # outside the round, or inside another conversion
                return original(self, *args, **kwargs)
            counts["conversions"] += 1
            if counts["per_step"]:
                counts["per_step"][-1] += 1
            state["converting"] = True
            try:
                return original(self, *args, **kwargs)
            finally:
                state["converting"] = False
        return counted

    def round_method(original: Callable, starts_step: bool) -> Callable:
        def counted(self, *args, **kwargs):
            if starts_step:
                counts["steps"] += 1
                counts["per_step"].append(0)
            state["in_round"] = True
            previous_mode = torch.cuda.get_sync_debug_mode() if cuda else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:  # only inside the round method: transformers' loop has syncs of its own
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    return original(self, *args, **kwargs)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(previous_mode)
                    state["in_round"] = False
                    counts["cuda_syncs"] += sum("synchroniz" in str(w.message) for w in caught)
        return counted

    try:
        for name in HOST_CONVERSIONS:
            setattr(torch.Tensor, name, conversion(name))
        for i, (owner, name, original) in enumerate(saved_methods):
            setattr(owner, name, round_method(original, starts_step=i == 0))
        yield counts
    finally:
        for owner, name, original in saved_methods:
            setattr(owner, name, original)
        for name, original in saved_tensor.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def host_syncs(target: Any, views: dict[str, Any], prompt: torch.Tensor, max_new_tokens: int,
               cuda: bool) -> dict[str, Any]:
    """Per view: the round's conversions per loop step (mean and most), and those of the per-token stop check. Off an
    accelerator, the default view once more in the accelerator order, forced (what a GPU runs: one read per step)."""
    runs = [(name, view, None) for name, view in views.items()]
    if not cuda and "default" in views:
        runs.append(("default, accelerator order (forced)", views["default"], True))
    result = {}
    for name, view, order in runs:
        saved = ReTraceCandidateGenerator.one_transfer
        ReTraceCandidateGenerator.one_transfer = order if order is not None else saved
        try:
            with counting_host_syncs(cuda, methods=((PerTokenStopping, "__call__"),)) as stop_check:
                with counting_host_syncs(cuda) as counts:
                    greedy(target, prompt, max_new_tokens, view)
        finally:
            ReTraceCandidateGenerator.one_transfer = saved
        steps = max(counts["steps"], 1)
        result[name] = {**counts, "rounds": view.last_stats.rounds, "policy": view.last_stats.policy,
                        "conversions_per_step": counts["conversions"] / steps,
                        "most_in_a_step": max(counts["per_step"], default=0),
                        "stop_check_per_step": max(stop_check["per_step"], default=0),
                        "cuda_syncs_per_step": counts["cuda_syncs"] / steps if cuda else None}
    return result


def timings(target: Any, views: dict[str, Any], prompts: list[torch.Tensor], max_new_tokens: int,
            repeats: int) -> list[dict[str, Any]]:
    """Every row on every prompt, warmed up first, each ``generate`` synchronised; the fastest of ``repeats``."""
    device = target.get_input_embeddings().weight.device
    rows = {"plain": None, **views}
    for view in rows.values():  # warm-up: kernel selection, allocator, the policy's tuning at first use
        greedy(target, prompts[0], min(16, max_new_tokens), view)
    results, plain_outputs = [], None
    for name, view in rows.items():
        seconds, tokens, outputs, taus, rounds = 0.0, 0, [], [], 0
        for prompt in prompts:
            best = float("inf")
            for _ in range(repeats):
                synchronize(device)
                started = time.perf_counter()
                output = greedy(target, prompt, max_new_tokens, view)  # .tolist() waits for the device
                synchronize(device)
                best = min(best, time.perf_counter() - started)
            seconds, tokens = seconds + best, tokens + len(output)
            outputs.append(output)
            if view is not None:
                taus.append(view.last_stats.mean_acceptance_length)
                rounds += view.last_stats.rounds
        if view is None:
            plain_outputs = outputs
        results.append({
            "method": name, "policy": view.last_stats.policy if view is not None else "plain generate",
            "tau": sum(taus) / len(taus) if taus else 1.0, "rounds": rounds, "new_tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / seconds,
            "identical_to_plain": sum(a == b for a, b in zip(outputs, plain_outputs)),
        })
    for row in results:
        row["speedup"] = row["tokens_per_second"] / results[0]["tokens_per_second"]
    return results


# --- the run ----------------------------------------------------------------------------------------------------------


def environment(args: argparse.Namespace, what: str) -> dict[str, Any]:
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"device": str(device), "device_name": name, "target": what, "drafter": args.drafter or "shipped",
            "torch": torch.__version__, "transformers": transformers.__version__, "hf_retrace": hf_retrace.__version__,
            "python": sys.version.split()[0], "policy_env": os.environ.get("HF_RETRACE_POLICY", "auto")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    setting = SMOKE if args.smoke else FULL
    setting = dataclasses.replace(setting, **{k: v for k, v in (("prompts", args.prompts),
                                                                ("max_new_tokens", args.max_new_tokens)) if v})
    cuda = torch.device(args.device).type == "cuda"
    if cuda:  # fp32 equality means fp32 matmuls, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    target, drafter, tokenizer, what = load_models(args, setting)
    report: dict[str, Any] = {"environment": environment(args, what), "setting": dataclasses.asdict(setting),
                              "errors": {}}
    prompts = make_prompts(target, tokenizer, setting, args.seed)
    views = policies(drafter)

    def section(name: str, measure: Callable[[], Any]) -> None:
        print(f"[device check] {name} ...", file=sys.stderr, flush=True)
        try:
            report[name] = measure()
        except Exception as exc:  # noqa: BLE001 - a failed section is reported, the others still run
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    fixed = {k: v for k, v in views.items() if k != "default"}  # explicit policies: every round drafts (no guard)
    section("equality_fp32", lambda: equality(target, fixed, prompts, setting.max_new_tokens, "fp32"))
    target.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    section("host_syncs", lambda: host_syncs(target, views, prompts[0], setting.max_new_tokens, cuda))
    section("costs_bf16", lambda: measure_costs(target, drafter, max_drafts=16, context_length=setting.cost_context,
                                                repeats=setting.cost_repeats).to_dict())
    if args.compile:
        from hf_retrace.loading import compile_drafter

        views["default, compiled drafter"] = compile_drafter(drafter.with_policy(), backend=args.compile_backend)
    section("timings_bf16", lambda: timings(target, views, prompts, setting.max_new_tokens, setting.timing_repeats))
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [f"Device check on {env['device_name']} ({env['device']}), torch {env['torch']}, transformers "
             f"{env['transformers']}; target: {env['target']}; {report['seconds']} s.", ""]
    for name, row in report.get("equality_fp32", {}).items():
        parts = [f"at token {d['position']} (top-2 gap {d['top2_gap']:.3g})" for d in row["divergences"]]
        lines.append(f"- fp32 greedy equality, {name}: {row['identical']}/{row['of']} identical to plain"
                     + (f"; differ {', '.join(parts)}" if parts else ""))
    for name, row in report.get("host_syncs", {}).items():
        cuda = "" if row["cuda_syncs_per_step"] is None else f", {row['cuda_syncs_per_step']:.2f} CUDA syncs"
        lines.append(f"- host syncs per loop step, {name} (T=0): {row['conversions_per_step']:.2f} conversions{cuda} "
                     f"(at most {row['most_in_a_step']} in a step; the stop check at most {row['stop_check_per_step']}; "
                     f"{row['steps']} steps, {row['rounds']} drafting rounds)")
    costs = report.get("costs_bf16")
    if costs:
        shown = (1, 2, 3, 4, 7, 8, 15, 16)
        curve = ", ".join(f"{k}: {c:.2f}" for k, c in enumerate(costs["verify_costs"]) if k in shown)
        lines.append(f"- bf16 costs in one-token steps ({costs['step_seconds'] * 1e3:.2f} ms): verify k drafts "
                     f"{curve}; drafter round {costs['draft_cost_chunk']:.2f} (2 slots) / "
                     f"{costs['draft_cost_full']:.2f} (full block)")
    rows = report.get("timings_bf16", [])
    if rows:
        lines += ["", "| bf16 | tau | tokens/s | speed-up | identical to plain | policy |", "|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['method']} | {row['tau']:.2f} | {row['tokens_per_second']:.1f} | "
                         f"{row['speedup']:.2f}x | {row['identical_to_plain']}/{report['setting']['prompts']} | "
                         f"{row['policy']} |")
    for name, error in report["errors"].items():
        lines.append(f"- FAILED {name}: {error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda when this machine has it, else cpu")
    parser.add_argument("--target", default=None, help="a Hugging Face model folder (default: the stand-in)")
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped drafter)")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts (default {FULL.prompts})")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"default {FULL.max_new_tokens}")
    parser.add_argument("--compile", action="store_true", help="also time the default with a compiled drafter")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny random models, seconds (what CI runs)")
    parser.add_argument("--out", default="device_check.json", help="where the JSON report goes")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.smoke:  # a CI run never writes the user's cache (the default policy is tuned at first use)
        os.environ.setdefault("HF_RETRACE_CACHE", tempfile.mkdtemp(prefix="hf_retrace_device_check_"))
        torch.set_num_threads(1)  # tiny models: one thread is fastest, and stays fast on a shared CPU
    report = run(args)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    print(f"[device check] wrote {args.out}", file=sys.stderr)
    differ = any(row["identical"] < row["of"] for row in report.get("equality_fp32", {}).values())
    return 1 if report["errors"] or differ else 0


if __name__ == "__main__":
    sys.exit(main())
