"""The device check: what one GPU says about hf_retrace, in one short run (a few minutes; docs/gpu.md).

1. **Greedy equality in fp32**: plain ``generate`` against the drafter (its shipped round policy, and full blocks) on
   the same prompts, token for token; a divergence is located and its top-2 logit gap printed
   (:func:`hf_retrace.divergence.find_divergence`).
2. **Host syncs per loop step** inside the generator's two round methods (``get_candidates``,
   ``update_candidate_strategy``): tensor-to-host conversions and, on CUDA, the synchronising calls torch's sync debug
   mode reports there; per policy at T=0, and the per-token stop check's.
3. **This machine's costs in bf16**: the target's verify forward over k drafts in one-token steps (the verify-cost
   curve to k = 16) and the drafter's round (:func:`hf_retrace.tuning.costs.measure_costs`).
4. **The overhead, counted**: per loop step of one ``generate``, the drafter's forward (and draft-head scoring), the
   target's verify forward (each synchronised on CUDA) and the remainder (our Python and transformers' loop) as the
   total minus the two, in ms; for plain ``generate``, the default, full blocks and, where the installed transformers
   has it, its own DFlash path (``speculation_type="dflash"``) on the same weights and shapes.
5. **The projection**: the drafter's recorded rounds (``round_records.json.gz``) replayed by the tuner
   (:func:`hf_retrace.tuning.search.choose_policies`, :func:`hf_retrace.tuning.replay.replay`) under the costs of
   section 3: the speed-up the default would reach here, per temperature, on the stand-in alone; and once more with
   the host work of section 4 added to every round.
6. **A target of the size users run**: a random Qwen3-8B-shaped target in bf16 with a random drafter of z-lab's
   Qwen3-8B-DFlash-b16 shape (5 layers, block 16): its verify-cost curve, drafter round and overhead, and the speed-up
   projected at DFlash's published acceptance for that pair (``DFLASH_QWEN3_8B``, cited there). ``--smoke``: a tiny
   Qwen3 and a 5-layer, block-16 drafter of its width.
7. **bf16 timings**, warmed up and synchronised: plain, the default (the resolved policy), the shipped policy and full
   blocks (``--compile`` adds the default with a compiled drafter): tau, tokens/s, speed-up over plain (whole
   ``generate`` calls, prefill included), and whether each output equals plain's.

Prints Markdown and writes JSON (``--out``). Each section that fails is recorded and the run goes on; a section that
would start after ``--budget-s`` seconds is skipped (recorded), and one that runs past them is stopped where the
platform has ``SIGALRM``. The exit status is 1 when a section failed or an fp32 output differed from plain's.

The target: ``--target FOLDER`` (a Hugging Face folder, e.g. the converted SmolLM2 in ``~/.cache/hf_retrace``), else
a **stand-in**: a randomly initialised Llama of SmolLM2-135M-Instruct's shape (the shipped drafter fits it), built
on the device with no download. A random target's text is not what the drafter learnt, so its drafts are rarely
accepted: on the stand-in, tau and the measured speed-up say nothing about the drafter; the costs, the overhead, the
syncs, the equality and the projection (which replays recorded rounds of the real pair) do.

    python examples/device_check.py --out device_check.json                     # one GPU, the stand-in
    python examples/device_check.py --target ~/.cache/hf_retrace/smollm2-135m-instruct --out gpu.json
    python examples/device_check.py --smoke --out /tmp/smoke.json                # CPU, tiny models, seconds (CI)
    bash examples/device_calls.sh prepare                                         # the real pair on a lent GPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import hf_retrace
from hf_retrace import ReTraceConfig, ReTraceDrafter
from hf_retrace.bench.native import build_native_assistant, native_dflash_unavailable_reason
from hf_retrace.configuration import build_target_layer_ids
from hf_retrace.defaults import default_drafter_path
from hf_retrace.divergence import find_divergence
from hf_retrace.generation.candidate_generator import ReTraceCandidateGenerator
from hf_retrace.generation.placement import synchronize
from hf_retrace.generation.policy import shipped_policy, verify_cost
from hf_retrace.generation.stopping import PerTokenStopping
from hf_retrace.loading import load_drafter
from hf_retrace.tuning.costs import MachineCosts, measure_costs
from hf_retrace.tuning.records import RoundRecords
from hf_retrace.tuning.replay import replay
from hf_retrace.tuning.search import choose_policies

# SmolLM2-135M-Instruct's shape (its config.json): what the shipped drafter was trained for
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY_SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)
# Qwen/Qwen3-8B's shape (its config.json on the Hub); on --smoke a tiny model of the same family
QWEN3_8B_SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_TINY_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
# z-lab/Qwen3-8B-DFlash-b16 (its config.json, also SpecForge's configs/qwen3-8b-dflash.json): 5 layers of the target's
# width, block 16, the mask embedding is the target's row 151669, taps from layer 1 to L-3
ZLAB_QWEN3_8B_DRAFTER = dict(num_hidden_layers=5, block_size=16, mask_token_id=151669)

# DFlash's published figures for Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 at T=0: the z-lab/dflash README at its first
# commit (bb48ef9, 2026-01-05; "the reported results were tested on NVIDIA B200 GPUs", transformers backend, block 16,
# max_new_tokens 2048, thinking off), cells "speed-up over autoregressive / tau". tau is the mean tokens committed per
# round, bonus token included. DFlash publishes tau per dataset, not a per-position acceptance curve for this pair;
# its rounds always draft the full block (15 drafts), and with full blocks tau alone sets tokens per round.
DFLASH_QWEN3_8B = {
    "source": "github.com/z-lab/dflash README, commit bb48ef9 (2026-01-05), Math/Code/Chat benchmark tables, "
              "Qwen3-8B-DFlash-b16, Temp 0 (also arXiv 2602.06036)",
    "gpu": "NVIDIA B200",
    "block_size": 16,
    "datasets": {"gsm8k": (5.20, 6.55), "math500": (6.17, 7.87), "humaneval": (5.20, 6.55), "mbpp": (4.75, 6.00),
                 "mt-bench": (2.79, 4.25)},  # (published speed-up, published tau)
}
HOST_CONVERSIONS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
SECTIONS = ("equality", "syncs", "costs", "overhead", "projection", "qwen3_8b", "timings")
REPORT_KEYS = {"equality": "equality_fp32", "syncs": "host_syncs", "costs": "costs_bf16", "overhead": "overhead_bf16",
               "projection": "projection", "qwen3_8b": "qwen3_8b", "timings": "timings_bf16"}
DEFAULT_BUDGET_S = 420  # the whole check well inside one 10-minute device call, with room to load and write


@dataclasses.dataclass
class Setting:
    prompts: int
    max_new_tokens: int
    prompt_length: int
    timing_repeats: int
    cost_context: int  # cached context length of the cost measurement
    cost_repeats: int
    large_new_tokens: int  # new tokens per generate of the Qwen3-8B-shaped section
    large_cost_context: int


FULL = Setting(prompts=4, max_new_tokens=128, prompt_length=48, timing_repeats=2, cost_context=128, cost_repeats=3,
               large_new_tokens=64, large_cost_context=512)
SMOKE = Setting(prompts=2, max_new_tokens=16, prompt_length=12, timing_repeats=1, cost_context=16, cost_repeats=1,
                large_new_tokens=12, large_cost_context=16)


# --- models and prompts -----------------------------------------------------------------------------------------------


def stand_in_target(shape: dict, device: str, seed: int, logit_scale: float = 1.0, family: str = "llama",
                    dtype: torch.dtype = torch.float32) -> Any:
    """A randomly initialised Llama (or Qwen3) of ``shape``, built on ``device`` in ``dtype`` (no download, no EOS)."""
    torch.manual_seed(seed)
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig,
                                                                                          LlamaForCausalLM)
    config = config_class(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device), default_dtype(dtype):  # built in dtype: an 8B model never exists in fp32
        model = model_class(config).to(dtype).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def zlab_shaped_drafter(target: Any, seed: int) -> ReTraceDrafter:
    """A random drafter of z-lab's Qwen3-8B-DFlash-b16 shape for ``target`` (5 layers of its width, block 16, five taps
    from layer 1 to L-3, the full vocabulary, no ReTrace), on the target's device and in its dtype."""
    c = target.config
    layers = ZLAB_QWEN3_8B_DRAFTER["num_hidden_layers"]
    mask = ZLAB_QWEN3_8B_DRAFTER["mask_token_id"] if c.vocab_size > ZLAB_QWEN3_8B_DRAFTER["mask_token_id"] else \
        c.vocab_size - 1  # the tiny smoke vocabulary has no row 151669
    config = ReTraceConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                           rope_theta=1_000_000.0, max_position_embeddings=c.max_position_embeddings,
                           block_size=ZLAB_QWEN3_8B_DRAFTER["block_size"], mask_token_id=mask,
                           target_layer_ids=build_target_layer_ids(c.num_hidden_layers, layers),
                           num_target_layers=c.num_hidden_layers, retrace="absent")
    torch.manual_seed(seed)
    device, dtype = target.get_input_embeddings().weight.device, target.dtype
    with torch.device(device), default_dtype(dtype):
        return ReTraceDrafter(config).to(dtype).eval()


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


def greedy(target: Any, prompt: torch.Tensor, max_new_tokens: int, drafter: Any = None, **extra: Any) -> list[int]:
    """The new tokens of a greedy ``generate`` (with ``drafter`` as its assistant; ``extra``: more generate kwargs)."""
    kwargs = {} if drafter is None else {"assistant_model": drafter, **extra}
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
    runs = dict(views)
    if not cuda and "default" in views:  # the round policy's one_transfer forces the order
        runs["default, accelerator order (forced)"] = views["default"].with_policy(one_transfer=True)
    result = {}
    for name, view in runs.items():
        with counting_host_syncs(cuda, methods=((PerTokenStopping, "__call__"),)) as stop_check:
            with counting_host_syncs(cuda) as counts:
                greedy(target, prompt, max_new_tokens, view)
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


# --- the overhead, counted -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def timed_forwards(target: Any, drafter_module: Any = None) -> Iterator[dict[str, list[tuple[float, float]]]]:
    """Host-clock spans ``(start, end)`` of the forwards inside a ``generate`` call, each synchronised on the device
    before and after: ``target`` (the target's forward: the first is the prefill, the others verify) and ``drafter``
    (``drafter_module``'s forward, :meth:`ReTraceDrafter.compute_logits`, and the target's ``lm_head`` called outside
    the target's forward, which is how transformers' DFlash generator scores its drafts). Spans never nest: inside one,
    the others are not timed, so the spans are disjoint and their sum never exceeds the call."""
    device = target.get_input_embeddings().weight.device
    spans: dict[str, list[tuple[float, float]]] = {"target": [], "drafter": []}
    state: dict[str, Any] = {"owner": None, "started": 0.0}

    def open_span(owner: str) -> None:
        if state["owner"] is None:
            synchronize(device)
            state["owner"], state["started"] = owner, time.perf_counter()

    def close_span(owner: str, kind: str) -> None:
        if state["owner"] == owner:
            synchronize(device)
            spans[kind].append((state["started"], time.perf_counter()))
            state["owner"] = None

    def hooks(module: Any, owner: str, kind: str) -> list[Any]:
        return [module.register_forward_pre_hook(lambda *_: open_span(owner)),
                module.register_forward_hook(lambda *_: close_span(owner, kind))]

    handles = hooks(target, "target", "target") + hooks(target.get_output_embeddings(), "head", "drafter")
    if drafter_module is not None:
        handles += hooks(drafter_module, "drafter", "drafter")
    scoring = ReTraceDrafter.__dict__["compute_logits"]

    def timed_scoring(*args: Any, **kwargs: Any) -> torch.Tensor:
        open_span("scoring")
        try:
            return scoring.__func__(*args, **kwargs)
        finally:
            close_span("scoring", "drafter")

    ReTraceDrafter.compute_logits = staticmethod(timed_scoring)
    try:
        yield spans
    finally:
        ReTraceDrafter.compute_logits = scoring
        for handle in handles:
            handle.remove()


def round_breakdown(target: Any, prompt: torch.Tensor, max_new_tokens: int, assistant: Any = None,
                    drafter_module: Any = None, **extra: Any) -> dict[str, Any]:
    """One greedy ``generate`` after a warm-up, per loop step after the prefill (a step is one verify forward; in plain
    decoding one decoding step), in ms: ``drafter`` (its forwards and head scoring), ``verify`` (the target's forward)
    and ``remainder`` (our Python and transformers' loop: the step's time minus the two), which add up to ``total``.
    The forwards are synchronised, so the remainder is everything else, none of it hidden behind a forward: the host's
    Python and the device time of the small ops between the forwards (argmax, cat, the stop check);
    ``unhooked_ms_per_step`` times the same call without the syncs (host work may then hide behind the device's)."""
    device = target.get_input_embeddings().weight.device
    greedy(target, prompt, min(16, max_new_tokens), assistant, **extra)  # warm-up: kernels, the policy's tuning
    with timed_forwards(target, drafter_module) as spans:
        synchronize(device)
        started = time.perf_counter()
        output = greedy(target, prompt, max_new_tokens, assistant, **extra)
        synchronize(device)
        ended = time.perf_counter()
    if not spans["target"]:
        raise RuntimeError("no target forward was timed inside generate: the forward hooks did not fire")
    prefill_start, prefill_end = spans["target"][0]
    steps = max(len(spans["target"]) - 1, 1)
    verify = sum(end - start for start, end in spans["target"][1:])
    drafter = sum(end - start for start, end in spans["drafter"] if start >= prefill_end)
    total = ended - prefill_end
    synchronize(device)
    unhooked_started = time.perf_counter()
    greedy(target, prompt, max_new_tokens, assistant, **extra)
    synchronize(device)
    unhooked = time.perf_counter() - unhooked_started - (prefill_end - started)  # the prefill as timed above
    per_step = {"drafter": drafter, "verify": verify, "remainder": total - drafter - verify, "total": total}
    return {"ran": True, "steps": steps, "new_tokens": len(output),
            "tokens_per_step": (len(output) - 1) / steps,  # the prefill commits the first token
            "ms_per_step": {part: 1e3 * seconds / steps for part, seconds in per_step.items()},
            "prefill_ms": 1e3 * (prefill_end - prefill_start), "unhooked_ms_per_step": 1e3 * max(unhooked, 0.0) / steps}


def overhead(target: Any, drafter: Any, prompt: torch.Tensor, max_new_tokens: int,
             views: dict[str, Any]) -> dict[str, Any]:
    """:func:`round_breakdown` for plain ``generate``, each drafter view, and transformers' own DFlash path on the
    drafter's weights (the same shapes; it always drafts the whole block), or why that one did not run."""
    rows = {"plain": round_breakdown(target, prompt, max_new_tokens)}
    for name, view in views.items():
        rows[name] = round_breakdown(target, prompt, max_new_tokens, view, drafter)
    reason = native_dflash_unavailable_reason(drafter.config)
    if reason is None:
        native = build_native_assistant(drafter)
        rows["dflash-native"] = round_breakdown(target, prompt, max_new_tokens, native, native,
                                                speculation_type="dflash")
    else:
        rows["dflash-native"] = {"ran": False, "reason": f"did not run: transformers' DFlash path is {reason}"}
    return rows


# --- the projection --------------------------------------------------------------------------------------------------


def with_host_work(costs: MachineCosts, round_host_s: float, plain_host_s: float) -> MachineCosts:
    """``costs`` with the host's work added: every drafting round pays ``round_host_s`` on top of its forwards, and the
    unit becomes a plain decoding step as ``generate`` runs it (its forward and ``plain_host_s``)."""
    unit = costs.step_seconds + plain_host_s
    scale = costs.step_seconds / unit
    verify = (1.0,) + tuple(c * scale + round_host_s / unit for c in costs.verify_costs[1:])
    return MachineCosts(verify, costs.draft_cost_chunk * scale, costs.draft_cost_full * scale, unit,
                        costs.drafter_first)


def replayed_speedups(records: RoundRecords, costs: MachineCosts, base: Any) -> dict[str, Any]:
    """Per temperature, the policy the tuner chooses under ``costs`` and its replay over the recorded answers: tokens
    per step-cost (the projected speed-up over plain; exactly 1 where the tuner chooses plain decoding), tau."""
    choice = choose_policies(records, costs, base)
    result = {}
    for name, answers in (("greedy", records.greedy), ("sampled", records.sampled)):
        if not answers:
            continue
        policy = choice[name]
        walked = replay(answers, policy, records.block_size - 1)
        result[name] = {"speedup": walked["tokens_per_cost"], "tau": walked["tau"],
                        "lookup_share": walked["lookup_share"], "policy": policy.describe(),
                        "policy_dict": policy.to_dict()}
    return result


def projection(costs_dict: dict[str, Any], overhead_rows: dict[str, Any] | None, drafter_path: Any) -> dict[str, Any]:
    """The drafter's recorded rounds replayed under this machine's measured costs (as the JSON records them, so the
    figure can be replayed again from the report) and, where the overhead was counted, under the costs with the
    full-block rounds' host work per step (over plain's) added."""
    records = RoundRecords.load(drafter_path)
    base = shipped_policy(ReTraceConfig.from_pretrained(drafter_path))
    costs = MachineCosts.from_dict(costs_dict)
    result = {"records": {"answers_T0": len(records.greedy), "answers_T1": len(records.sampled),
                          "block_size": records.block_size, "temperature_T1": records.temperature},
              "costs": "costs_bf16", "forwards_only": replayed_speedups(records, costs, base)}
    full, plain = (overhead_rows or {}).get("full blocks"), (overhead_rows or {}).get("plain")
    if full and plain and full.get("ran") and plain.get("ran"):
        round_host, plain_host = full["ms_per_step"]["remainder"] / 1e3, plain["ms_per_step"]["remainder"] / 1e3
        result["host_work_ms"] = {"per_drafting_round": round_host * 1e3, "per_plain_step": plain_host * 1e3}
        added = MachineCosts.from_dict(with_host_work(costs, round_host, plain_host).to_dict())  # as the JSON has them
        result["with_host_work_costs"] = added.to_dict()
        result["with_host_work"] = replayed_speedups(records, added, base)
    return result


# --- a target of the size users run -----------------------------------------------------------------------------------


def published_projection(costs: MachineCosts, rows: dict[str, Any], block_size: int) -> dict[str, Any]:
    """The speed-up at DFlash's published tau per dataset (full blocks: ``block_size - 1`` drafts every round, as
    DFlash drafts): tau x plain's time per token / a full-block round's time, both measured here (unhooked
    ``generate``); and the ceiling with no host work (forwards only: tau / (verify + drafter round), in one-token
    steps)."""
    drafts = block_size - 1
    forwards = verify_cost(costs.verify_costs, drafts) + costs.draft_cost_full
    result: dict[str, Any] = {"source": DFLASH_QWEN3_8B["source"], "published_gpu": DFLASH_QWEN3_8B["gpu"],
                              "drafts_per_round": drafts, "round_forwards_in_steps": forwards}
    plain, full = rows.get("plain", {}), rows.get("full blocks", {})
    measured = plain.get("ran") and full.get("ran")
    if measured:
        result["round_over_plain_step"] = full["unhooked_ms_per_step"] / plain["unhooked_ms_per_step"]
    datasets = {}
    for name, (published, tau) in DFLASH_QWEN3_8B["datasets"].items():
        row = {"published_tau": tau, "published_speedup": published, "forwards_only": tau / forwards}
        if measured:
            row["projected_speedup"] = tau / result["round_over_plain_step"]
            row["ratio_to_published"] = row["projected_speedup"] / published
        datasets[name] = row
    result["datasets"] = datasets
    return result


def qwen3_8b(args: argparse.Namespace, setting: Setting) -> dict[str, Any]:
    """The verify-cost curve to k = 16, the drafter's round, the overhead (plain, full blocks, transformers' DFlash) and
    the speed-up projected at DFlash's published tau, for a random Qwen3-8B-shaped target in bf16 with a random
    drafter of z-lab's shape (on ``--smoke`` a tiny Qwen3 and a 5-layer, block-16 drafter)."""
    shape, what = ((QWEN3_TINY_SHAPE, "tiny random Qwen3 (smoke)") if args.smoke else
                   (QWEN3_8B_SHAPE, "randomly initialised Qwen3 of Qwen3-8B's shape"))
    target = stand_in_target(shape, args.device, args.seed, family="qwen3", dtype=torch.bfloat16)
    drafter = zlab_shaped_drafter(target, args.seed)
    try:
        measured = measure_costs(target, drafter, max_drafts=16, context_length=setting.large_cost_context,
                                 repeats=setting.cost_repeats)
        costs = MachineCosts.from_dict(measured.to_dict())  # as the JSON records them: the figures replay from it
        generator = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(0, shape["vocab_size"], (1, setting.prompt_length), generator=generator)
        full = drafter.with_policy(shipped_policy(drafter.config).replace(confidence_cut=None, lookup=False))
        rows = overhead(target, drafter, prompt.to(args.device), setting.large_new_tokens, {"full blocks": full})
        return {"target": what, "dtype": "bfloat16",
                "parameters": {"target": sum(p.numel() for p in target.parameters()),
                               "drafter": sum(p.numel() for p in drafter.parameters())},
                "drafter_shape": {"layers": drafter.config.num_hidden_layers, "block_size": drafter.config.block_size,
                                  "target_layer_ids": list(drafter.config.target_layer_ids)},
                "costs": costs.to_dict(), "overhead": rows,
                "published": published_projection(costs, rows, drafter.config.block_size)}
    finally:
        del target, drafter
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --- the run ----------------------------------------------------------------------------------------------------------


def environment(args: argparse.Namespace, what: str) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    return {"device": str(device), "device_name": name, "target": what, "drafter": args.drafter or "shipped",
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "transformers": transformers.__version__, "hf_retrace": hf_retrace.__version__,
            "python": sys.version.split()[0], "policy_env": os.environ.get("HF_RETRACE_POLICY", "auto"),
            "native_dflash": native_dflash_unavailable_reason() or "available"}


class OverBudget(Exception):
    """A section ran past the check's time budget."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`OverBudget` inside the block after ``seconds`` (``SIGALRM``: the main thread of a POSIX process;
    elsewhere the block runs to its end). A forward in progress finishes first."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise OverBudget(f"stopped after {seconds:.0f} s, at the end of the check's time budget (--budget-s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
                              "sections": list(args.sections), "budget_s": args.budget_s, "errors": {},
                              "skipped": {}}
    prompts = make_prompts(target, tokenizer, setting, args.seed)
    views = policies(drafter)

    def section(name: str, measure: Callable[[], Any]) -> None:
        key = REPORT_KEYS[name]
        if name not in args.sections:
            return
        left = args.budget_s - (time.perf_counter() - started)
        if left <= 0:
            report["skipped"][key] = f"not started: the check's time budget ({args.budget_s:g} s) was spent"
            print(f"[device check] {key}: skipped (budget spent)", file=sys.stderr, flush=True)
            return
        print(f"[device check] {key} ... ({left:.0f} s of the budget left)", file=sys.stderr, flush=True)
        try:
            with deadline(left):
                report[key] = measure()
        except Exception as exc:  # noqa: BLE001 - a failed section is reported, the others still run
            report["errors"][key] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    fixed = {k: v for k, v in views.items() if k != "default"}  # explicit policies: every round drafts (no guard)
    section("equality", lambda: equality(target, fixed, prompts, setting.max_new_tokens, "fp32"))
    target.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    section("syncs", lambda: host_syncs(target, views, prompts[0], setting.max_new_tokens, cuda))
    section("costs", lambda: measure_costs(target, drafter, max_drafts=16, context_length=setting.cost_context,
                                           repeats=setting.cost_repeats).to_dict())
    breakdown = {k: v for k, v in views.items() if k in ("default", "full blocks")}
    section("overhead", lambda: overhead(target, drafter, prompts[0], setting.max_new_tokens, breakdown))
    drafter_path = args.drafter or default_drafter_path()

    def project() -> dict[str, Any]:
        if "costs_bf16" not in report:
            raise RuntimeError("the projection replays under the measured costs, and the costs section did not run")
        return projection(report["costs_bf16"], report.get("overhead_bf16"), drafter_path)

    section("projection", project)

    def large_target() -> None:
        if "qwen3_8b" not in args.sections:
            return
        if not (cuda or args.smoke):  # 16 GB of bf16 weights: a GPU's work
            report["skipped"]["qwen3_8b"] = "not started: the Qwen3-8B-shaped target runs on CUDA only (--smoke: tiny)"
            return
        target.to("cpu")  # room for the 8B target: the small pair waits on the host
        drafter.to("cpu")
        section("qwen3_8b", lambda: qwen3_8b(args, setting))
        target.to(args.device)
        drafter.to(args.device)

    if not args.target:  # on the stand-in the timings say least (tau means nothing there): they come last
        large_target()
    if args.compile:
        from hf_retrace.loading import compile_drafter

        views["default, compiled drafter"] = compile_drafter(drafter.with_policy(), backend=args.compile_backend)
    section("timings", lambda: timings(target, views, prompts, setting.max_new_tokens, setting.timing_repeats))
    if args.target:  # the real pair's table first: it is what the README quotes
        large_target()
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def _overhead_table(rows: dict[str, Any]) -> list[str]:
    lines = ["| per loop step (ms) | drafter | verify | remainder | total | unhooked | tokens per step |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if not row.get("ran"):
            lines.append(f"| {name} | {row.get('reason', 'did not run')} | | | | | |")
            continue
        ms = row["ms_per_step"]
        lines.append(f"| {name} | {ms['drafter']:.2f} | {ms['verify']:.2f} | {ms['remainder']:.2f} | "
                     f"{ms['total']:.2f} | {row['unhooked_ms_per_step']:.2f} | {row['tokens_per_step']:.2f} |")
    return lines


def _costs_line(label: str, costs: dict[str, Any]) -> str:
    shown = (1, 2, 3, 4, 7, 8, 15, 16)
    curve = ", ".join(f"{k}: {c:.2f}" for k, c in enumerate(costs["verify_costs"]) if k in shown)
    return (f"- {label} costs in one-token steps ({costs['step_seconds'] * 1e3:.2f} ms): verify k drafts {curve}; "
            f"drafter round {costs['draft_cost_chunk']:.2f} (2 slots) / {costs['draft_cost_full']:.2f} (full block)")


def _projection_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for variant, label in (("forwards_only", "the measured costs"), ("with_host_work", "the costs + host work")):
        for name, row in result.get(variant, {}).items():
            temperature = "T=0" if name == "greedy" else f"T={result['records']['temperature_T1']:g}"
            tau = f"tau {row['tau']:.2f}; " if row["policy_dict"]["speculate"] else ""
            lines.append(f"- projected speed-up of the default ({temperature}, recorded rounds replayed under "
                         f"{label}): {row['speedup']:.2f}x ({tau}{row['policy']})")
    host = result.get("host_work_ms")
    if host:
        lines.append(f"- host work counted in: {host['per_drafting_round']:.2f} ms per drafting round, "
                     f"{host['per_plain_step']:.2f} ms per plain step")
    return lines


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
    if report.get("costs_bf16"):
        lines.append(_costs_line("bf16", report["costs_bf16"]))
    if report.get("overhead_bf16"):
        lines += ["", "Overhead, bf16 (one generate, steps after the prefill; the forwards synchronised):", ""]
        lines += _overhead_table(report["overhead_bf16"]) + [""]
    if report.get("projection"):
        lines += _projection_lines(report["projection"])
    large = report.get("qwen3_8b")
    if large:
        params = large["parameters"]
        lines += ["", f"{large['target']} ({params['target'] / 1e6:,.1f} M parameters, bf16) with a random drafter "
                  f"of z-lab's shape ({large['drafter_shape']['layers']} layers, block "
                  f"{large['drafter_shape']['block_size']}, {params['drafter'] / 1e6:,.1f} M):", ""]
        lines.append(_costs_line("bf16", large["costs"]))
        lines += [""] + _overhead_table(large["overhead"]) + [""]
        published = large["published"]
        lines += [f"At DFlash's published tau ({published['source']}; measured on {published['published_gpu']}), "
                  f"{published['drafts_per_round']} drafts a round:", "",
                  "| dataset | tau | published | projected here | forwards only | projected / published |",
                  "|---|---|---|---|---|---|"]
        for name, row in published["datasets"].items():
            projected = f"{row['projected_speedup']:.2f}x" if "projected_speedup" in row else "-"
            ratio = f"{row['ratio_to_published']:.2f}" if "ratio_to_published" in row else "-"
            lines.append(f"| {name} | {row['published_tau']:.2f} | {row['published_speedup']:.2f}x | {projected} | "
                         f"{row['forwards_only']:.2f}x | {ratio} |")
    rows = report.get("timings_bf16", [])
    if rows:
        lines += ["", "| bf16 | tau | tokens/s | speed-up | identical to plain | policy |", "|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['method']} | {row['tau']:.2f} | {row['tokens_per_second']:.1f} | "
                         f"{row['speedup']:.2f}x | {row['identical_to_plain']}/{report['setting']['prompts']} | "
                         f"{row['policy']} |")
    for name, why in report["skipped"].items():
        lines.append(f"- SKIPPED {name}: {why}")
    for name, error in report["errors"].items():
        lines.append(f"- FAILED {name}: {error}")
    return "\n".join(lines)


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or text!r}; choose from {', '.join(SECTIONS)} "
                                         "(comma-separated)")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda when this machine has it, else cpu")
    parser.add_argument("--target", default=None, help="a Hugging Face model folder (default: the stand-in)")
    parser.add_argument("--drafter", default=None, help="a drafter folder (default: the shipped drafter)")
    parser.add_argument("--prompts", type=int, default=None, help=f"prompts (default {FULL.prompts})")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"default {FULL.max_new_tokens}")
    parser.add_argument("--sections", type=_sections, default=SECTIONS,
                        help=f"which to run, comma-separated: {','.join(SECTIONS)} (default: all, in this order; "
                             "with --target the timings run before qwen3_8b)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for the whole check: a section is not started after them, and one running "
                             f"past them is stopped (default {DEFAULT_BUDGET_S})")
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
