"""``hf-retrace bench``: every decoding method on the same prompts, side by side, in one run.

One entry point (:func:`run_benchmark`), many datasets, one per-prompt loop (:func:`run_prompt`).

What is measured, per request (one user turn answered by one ``generate`` call):

- **Prefill excluded.** Before each request the target runs one timed forward over the request's input ids
  (``use_cache=True, logits_to_keep=1``: what ``generate``'s first forward does); that time is subtracted from the
  ``generate`` wall time. The prefill forward also yields the first new token, so the decode rate is
  ``(new tokens - 1) / (generate seconds - prefill seconds)``. Identical inputs (every method at T=0, every seed)
  reuse one prefill measurement, so prefill noise never separates the methods.
- **tau** is ``GenerationStats.mean_acceptance_length`` (accepted drafts + 1 per drafting round), never recomputed
  here: ``tau_per_request`` averages it over requests (z-lab's convention), ``tau_per_round`` pools every round of
  the dataset (vLLM's). Plain decoding has tau = 1 by that definition. transformers' own generators (prompt lookup,
  native DFlash) are recorded into a ``GenerationStats`` by wrapping their two methods; as in hf_retrace's own
  generator, the prefill forward and forwards that drafted nothing (prompt lookup found no n-gram) are not rounds.
- **Costs.** ``draft_cost_c`` = drafter seconds per round / plain decode seconds per token, ``verify_cost_epsilon`` =
  verify seconds per round / plain decode seconds per token - 1, ``ideal_speedup`` = tau_per_round / (1 + c + eps),
  and ``speedup_over_ideal`` = measured speed-up / ideal speed-up (what the loop's own overhead leaves).
- **Losslessness at T=0.** Every output is compared token by token with plain ``generate`` on the same input. The
  first divergence is reported with its position and the target's top-2 logit gap there (one target forward over
  plain's sequence up to that position). In fp32 every divergence is a bug; in bf16 a gap within two bf16 ulps of the
  logit magnitude is a near-tie (numerics), anything larger is a bug. Nothing is averaged away. At T > 0 outputs
  legitimately differ and are not compared.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..configuration import RETRACE_ABLATIONS, drafter_target_mismatches
from ..side_by_side import Run, chat_input_ids, timed_generate
from ..stats import GenerationStats
from .datasets import DATASETS, BenchPrompt, load_prompts

__all__ = [
    "ALL_METHODS",
    "DEFAULT_METHODS",
    "BenchInputError",
    "BenchSpec",
    "BenchPlan",
    "Method",
    "find_divergence",
    "plan_benchmark",
    "run_benchmark",
    "run_prompt",
]

PROMPT_LOOKUP_NUM_TOKENS = 10
NEAR_TIE_ULPS = 2
SCHEMA_VERSION = 1
MAIN_DRAFTER = "default"


class BenchInputError(ValueError):
    """A benchmark argument is wrong; raised before any model is loaded."""


@dataclass(frozen=True)
class Method:
    """One decoding method: how ``generate`` is called and which drafter settings it needs."""

    name: str
    kind: str  # "plain" | "prompt-lookup" | "native" | "drafter"
    use_retrace: bool = False
    ablation: str = "full"
    description: str = ""
    lookup: bool = False  # the hybrid: context lookup rounds inside our generator
    full_block: bool = False  # the adaptive block cut off (every round drafts block_size - 1 slots)

    @property
    def needs_drafter(self) -> bool:
        return self.kind in ("native", "drafter")


ALL_METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("plain", "plain", description="plain generate (the reference and the speed-up baseline)"),
        Method("prompt-lookup", "prompt-lookup", description=f"prompt_lookup_num_tokens={PROMPT_LOOKUP_NUM_TOKENS}"),
        Method("dflash-native", "native", description='transformers speculation_type="dflash", same DFlash weights '
               "(at T>0 it samples its drafts and verifies by rejection sampling)"),
        Method("dflash", "drafter", description="our drafter, ReTrace off (at T>0 the drafter's proposal_mode "
               "decides: argmax = sample-and-match, the default; sample = rejection sampling)"),
        Method("retrace", "drafter", use_retrace=True, description="our drafter, ReTrace on"),
        Method("dflash-full-block", "drafter", full_block=True,
               description="our drafter, ReTrace off, adaptive block cut off (every round drafts the whole block)"),
        Method("dflash+lookup", "drafter", lookup=True,
               description="the hybrid: context lookup where the newest tokens occurred before, else the drafter"),
        Method("retrace+lookup", "drafter", use_retrace=True, lookup=True, description="the hybrid with ReTrace on"),
        *[
            Method(f"retrace-{a}", "drafter", use_retrace=True, ablation=a, description=f"ReTrace ablation {a}")
            for a in RETRACE_ABLATIONS
            if a != "full"
        ],
    ]
}
DEFAULT_METHODS = ("plain", "prompt-lookup", "dflash-native", "dflash", "retrace")


@dataclass
class BenchSpec:
    """What to benchmark, as the user asked for it (nothing checked, nothing loaded).

    Example::

        spec = BenchSpec(datasets=["gsm8k"], methods=["plain", "dflash", "retrace"], max_new_tokens=64, limit=8)
        report = run_benchmark(spec)
        print(report["results"]["gsm8k"]["retrace"]["T=0"]["tau"])
    """

    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 128
    limit: int | None = None
    seeds: list[int] = field(default_factory=lambda: [0])
    target: str | None = None  # None: the embedded default target
    drafters: dict[str, str] = field(default_factory=dict)  # "default" or a method / ablation name -> path
    dtype: str = "bf16"
    quantization: str | None = None
    warmup: bool = True
    progress: bool = True


@dataclass
class BenchPlan:
    """A checked :class:`BenchSpec`: prompts read, target and drafters resolved to paths, methods chosen."""

    spec: BenchSpec
    target_path: str
    prompts: dict[str, list[BenchPrompt]]
    methods: list[Method]  # plain first
    drafter_paths: dict[str, str]  # method name -> drafter path
    skipped: dict[str, str]  # method name -> why it does not run
    notes: list[str]


# --------------------------------------------------------------------------- checking the input (no model loads)


def plan_benchmark(spec: BenchSpec) -> BenchPlan:
    """Check every argument and resolve paths; raise :class:`BenchInputError` before any model is loaded."""
    if not spec.datasets:
        raise BenchInputError(f"no dataset given; use one of {', '.join(DATASETS)} or the path of a .jsonl file")
    unknown = [m for m in spec.methods if m not in ALL_METHODS]
    if unknown or not spec.methods:
        raise BenchInputError(
            f"unknown method(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"choose from {', '.join(ALL_METHODS)} (comma-separated, or 'all')"
        )
    if spec.max_new_tokens < 2:
        raise BenchInputError(f"--max-new-tokens must be at least 2 (one prefill token + decoded tokens), "
                              f"got {spec.max_new_tokens}")
    if spec.limit is not None and spec.limit < 1:
        raise BenchInputError(f"--limit must be a positive number of prompts per dataset, got {spec.limit}")
    if not spec.temperatures or any(not math.isfinite(t) or t < 0 for t in spec.temperatures):
        raise BenchInputError(f"temperatures must be finite and >= 0, got {spec.temperatures}")
    if not spec.seeds:
        raise BenchInputError("at least one seed is needed")
    if spec.dtype not in ("bf16", "fp32"):
        raise BenchInputError(f"--dtype must be bf16 or fp32, got {spec.dtype!r}")
    if spec.quantization not in (None, "8bit", "4bit"):
        raise BenchInputError(f"--quantization must be 8bit or 4bit, got {spec.quantization!r}")
    if spec.quantization is not None and _find_spec("bitsandbytes") is None:
        raise BenchInputError(f"--quantization {spec.quantization} needs bitsandbytes: `pip install bitsandbytes`")

    prompts = {}
    for name in spec.datasets:
        try:
            loaded = load_prompts(name, spec.limit)  # every record checked, not only the first `limit`
        except ValueError as exc:
            raise BenchInputError(f"--dataset {name}: {exc}") from None
        prompts[loaded[0].dataset if loaded else str(name)] = loaded

    names = ["plain"] + [m for m in dict.fromkeys(spec.methods) if m != "plain"]
    requested = [ALL_METHODS[m] for m in names]
    drafter_keys = _checked_drafter_names(spec.drafters, names)
    target_path, target_config = _target_config(spec.target)
    notes, skipped, drafter_paths = [], {}, {}
    for method in requested:
        if not method.needs_drafter:
            continue
        key = next((k for k in (method.name, method.ablation if method.use_retrace else None) if k in drafter_keys),
                   MAIN_DRAFTER)
        path = drafter_keys.get(key) or _default_drafter(method)
        config = _drafter_config(path)
        _check_drafter_fits_target(config, path, target_config, target_path)
        reason = _why_method_cannot_run(method, config)
        if reason is not None:
            skipped[method.name] = reason
            continue
        untrained = (f"the ReTrace module of {path} is untrained (zero output projection): the retrace methods "
                     "using it draft exactly what dflash drafts")
        if method.use_retrace and not config.retrace_trained and untrained not in notes:
            notes.append(untrained)
        drafter_paths[method.name] = str(path)
    methods = [m for m in requested if m.name not in skipped]
    return BenchPlan(spec, target_path, prompts, methods, drafter_paths, skipped, notes)


def _find_spec(name: str):
    import importlib.util

    return importlib.util.find_spec(name)


def _checked_drafter_names(drafters: dict[str, str], method_names: list[str]) -> dict[str, str]:
    allowed = {MAIN_DRAFTER, *[n for n in ALL_METHODS if ALL_METHODS[n].needs_drafter], *RETRACE_ABLATIONS[1:]}
    for key in drafters:
        if key not in allowed:
            raise BenchInputError(
                f"--drafter {key}=...: unknown drafter name {key!r}; use PATH for the main drafter or NAME=PATH with "
                f"NAME one of {', '.join(sorted(allowed - {MAIN_DRAFTER}))}"
            )
        methods = [n for n in method_names if n in (key, f"retrace-{key}")] if key != MAIN_DRAFTER else ["*"]
        if not methods:
            raise BenchInputError(f"--drafter {key}=... is given but no method in --methods uses it; "
                                  f"add {key if key in ALL_METHODS else 'retrace-' + key} to --methods")
    return dict(drafters)


def _target_config(target: str | None) -> tuple[str, Any]:
    """The target's folder (the default one resolved) and its config, read from config.json without any weights."""
    from transformers import AutoConfig

    from .. import defaults

    if target in (None, "default"):
        print(f"[hf-retrace bench] {defaults.describe_default_target_source()}", file=sys.stderr)
        try:
            target = str(defaults.ensure_default_target())
        except (defaults.DefaultTargetUnavailableError, FileNotFoundError) as exc:
            raise BenchInputError(str(exc)) from None
    if not Path(target).is_dir() and (Path(target).exists() or target.startswith((".", "/", "~"))):
        raise BenchInputError(f"--target {target}: not a model folder (expected a folder with config.json)")
    try:
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--target {target}: cannot read its config.json ({exc})") from None
    return target, config.get_text_config()


def _default_drafter(method: Method) -> str:
    from .. import defaults

    try:
        return str(defaults.default_drafter_path())
    except FileNotFoundError as exc:
        raise BenchInputError(
            f"method {method.name} needs a drafter and none was given: {exc}. Pass --drafter PATH, "
            "or benchmark only --methods plain,prompt-lookup"
        ) from None


def _drafter_config(path: str):
    from ..configuration import ReTraceConfig

    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise BenchInputError(f"--drafter {path}: the folder has no config.json (expected a saved ReTraceDrafter)")
    if not Path(path).is_dir() and (Path(path).exists() or path.startswith((".", "/", "~"))):
        raise BenchInputError(f"--drafter {path}: no such folder")
    try:
        return ReTraceConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BenchInputError(f"--drafter {path}: cannot read a drafter config ({exc})") from None


def _check_drafter_fits_target(config: Any, path: str, target_config: Any, target_path: str) -> None:
    """The drafter's config against the target's config.json (:func:`drafter_target_mismatches`, the one rule)."""
    wrong = drafter_target_mismatches(config, target_config)
    if wrong:
        raise BenchInputError(
            f"the drafter {path} was built for another target than {target_path} ({'; '.join(wrong)}). Pass the "
            "drafter trained for this target, or the target it was trained for."
        )


def _why_method_cannot_run(method: Method, config: Any) -> str | None:
    if method.kind == "native":
        from .native import native_dflash_unavailable_reason

        return native_dflash_unavailable_reason(config)
    if method.use_retrace and not config.retrace:
        return "skipped: the drafter has no ReTrace module (config.retrace is false)"
    return None


# --------------------------------------------------------------------------- the loaded benchmark


def load_models(plan: BenchPlan) -> tuple[Any, Any, dict[str, Any]]:
    """(target, tokenizer, {drafter path: drafter}), loaded through :mod:`hf_retrace.loading`."""
    from ..loading import load_drafter, load_target

    spec = plan.spec
    target, tokenizer = load_target(plan.target_path, spec.dtype, spec.quantization)
    drafters = {path: load_drafter(path, spec.dtype) for path in dict.fromkeys(plan.drafter_paths.values())}
    return target, tokenizer, drafters


@dataclass
class Divergence:
    """Where a T=0 output first left plain ``generate``'s, and how close the target's top-2 logits were there."""

    position: int  # index among the new tokens
    plain_token: int | None
    method_token: int | None
    top2_gap: float  # target logit of its best token minus its second best, at that position
    chosen_gap: float | None  # logit[plain's token] - logit[the method's token]
    logit_magnitude: float
    bf16_ulp: float
    verdict: str  # "near-tie" (numerics) or "bug"


@dataclass
class Comparison:
    compared: bool
    divergence: Divergence | None = None
    reason: str = ""


@dataclass
class TurnResult:
    """One request: one method answering one user turn of one prompt."""

    prompt_id: str
    turn: int
    seed: int
    method: str
    input_length: int
    run: Run
    prefill_seconds: float
    stats: GenerationStats | None
    comparison: Comparison | None


class Bench:
    """The loaded models plus how each method calls ``generate`` and where its rounds are recorded."""

    def __init__(self, plan: BenchPlan, target: Any, tokenizer: Any, drafters: dict[str, Any]):
        self.plan, self.target, self.tokenizer = plan, target, tokenizer
        self.methods = plan.methods
        self.max_new_tokens = plan.spec.max_new_tokens
        self.dtype = plan.spec.dtype
        self.drafters = {name: drafters[path] for name, path in plan.drafter_paths.items()}
        self.native_assistants = {}
        for method in self.methods:
            if method.kind == "native":
                from .native import build_native_assistant

                self.native_assistants[method.name] = build_native_assistant(self.drafters[method.name])
        self._prefill_cache: dict[tuple[int, ...], float] = {}

    def generate_kwargs(self, method: Method) -> dict[str, Any]:
        if method.kind == "prompt-lookup":
            return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS}
        if method.kind == "native":
            return {"assistant_model": self.native_assistants[method.name], "speculation_type": "dflash"}
        if method.kind == "drafter":
            return {"assistant_model": self.drafters[method.name]}
        return {}

    @contextmanager
    def rounds_of(self, method: Method) -> Iterator[dict]:
        """Set the method's drafter switches for one call; yields ``{"stats": GenerationStats | None}`` after it."""
        recorded: dict[str, GenerationStats | None] = {"stats": None}
        if method.kind == "drafter":
            drafter = self.drafters[method.name]
            with _drafter_switches(drafter, method):
                yield recorded
            recorded["stats"] = drafter.last_stats
        elif method.kind in ("prompt-lookup", "native"):
            stats = GenerationStats()
            if method.kind == "native":
                self.native_assistants[method.name].last_stats = stats
            with _recording_rounds(self.target, stats):
                yield recorded
            recorded["stats"] = stats
        else:
            yield recorded

    @torch.inference_mode()
    def prefill_seconds(self, input_ids: torch.Tensor) -> float:
        """Seconds of one target forward over ``input_ids`` (what ``generate``'s prefill does), measured once."""
        key = tuple(input_ids[0].tolist())
        if key not in self._prefill_cache:
            ids = input_ids.to(self.target.device)
            started = time.perf_counter()
            self.target(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
            self._prefill_cache[key] = time.perf_counter() - started
        return self._prefill_cache[key]

    def sampling_kwargs(self, temperature: float) -> dict[str, Any]:
        if temperature > 0:  # the pure tempered distribution: no top-k / top-p truncation
            return dict(do_sample=True, temperature=temperature, top_k=None, top_p=None,
                        max_new_tokens=self.max_new_tokens)
        return dict(do_sample=False, temperature=None, top_k=None, top_p=None, max_new_tokens=self.max_new_tokens)


@contextmanager
def _drafter_switches(drafter: Any, method: Method):
    """The method's settings on the drafter's config(s) for one call; the drafter's own settings restored after."""
    configs = {id(c): c for c in (drafter.config, getattr(drafter.retrace, "config", None)) if c is not None}
    settings = {"use_retrace": method.use_retrace, "retrace_ablation": method.ablation, "lookup": method.lookup}
    if method.full_block:
        settings["draft_confidence_threshold"] = None
    saved = [(c, {k: getattr(c, k, None) for k in settings}) for c in configs.values()]
    for c in configs.values():
        for k, v in settings.items():
            setattr(c, k, v)
    try:
        yield
    finally:
        for c, old in saved:
            for k, v in old.items():
                setattr(c, k, v)


@contextmanager
def _recording_rounds(target: Any, stats: GenerationStats):
    """Record the rounds of transformers' own candidate generator (prompt lookup, native DFlash) into ``stats``.

    Wraps ``get_candidates`` / ``update_candidate_strategy`` of the generator built for this one call; the drafting
    and the acceptance rule stay transformers'. Timing split as in hf_retrace's generator: draft = get_candidates,
    verify = from its return to update_candidate_strategy.
    """
    previous = target.__dict__.get("_get_candidate_generator")
    build = target._get_candidate_generator

    def build_recorded(*args: Any, **kwargs: Any):
        generator = build(*args, **kwargs)
        _record_generator(generator, stats)
        return generator

    target._get_candidate_generator = build_recorded
    try:
        yield stats
    finally:
        if previous is None:
            del target._get_candidate_generator
        else:
            target._get_candidate_generator = previous


def _record_generator(generator: Any, stats: GenerationStats) -> None:
    get_candidates, update = generator.get_candidates, generator.update_candidate_strategy
    state = {"calls": 0, "drafted": 0, "verify_started": 0.0, "prompt_length": None}

    def recorded_get_candidates(input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        started = time.perf_counter()
        candidates, logits = get_candidates(input_ids, *args, **kwargs)
        state["calls"] += 1
        state["prompt_length"] = state["prompt_length"] or input_ids.shape[1]
        # the first call precedes (prompt lookup) or skips (DFlash) the prefill: it is never a drafting round
        state["drafted"] = candidates.shape[1] - input_ids.shape[1] if state["calls"] > 1 else 0
        if state["drafted"] > 0:
            stats.draft_seconds += time.perf_counter() - started
        state["verify_started"] = time.perf_counter()
        return candidates, logits

    def recorded_update(input_ids: torch.Tensor, scores: torch.Tensor, num_matches: Any):
        result = update(input_ids, scores, num_matches)
        stats.new_tokens = input_ids.shape[1] - state["prompt_length"]
        if state["drafted"] > 0:
            stats.verify_seconds += time.perf_counter() - state["verify_started"]
            stats.record_round(state["drafted"], int(num_matches), False)
        return result

    generator.get_candidates = recorded_get_candidates
    generator.update_candidate_strategy = recorded_update


# --------------------------------------------------------------------------- the per-prompt loop


def conversation_input_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Input ids of a conversation ending in a user turn, with the generation prompt (thinking off)."""
    if len(messages) == 1:
        return chat_input_ids(tokenizer, messages[0]["content"])
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer("\n\n".join(m["content"] for m in messages), return_tensors="pt").input_ids


def run_prompt(bench: Bench, prompt: BenchPrompt, temperature: float, seed: int,
               on_request: Callable[[], None] = lambda: None) -> list[TurnResult]:
    """Every method on one prompt, turn by turn; one :class:`TurnResult` per (turn, method).

    Each method keeps its own conversation: turn k's input holds the user turns so far with the method's own previous
    answers between them. On every turn plain runs first: its answer is the T=0 reference for the others.
    """
    sampling = bench.sampling_kwargs(temperature)
    conversations: dict[str, list[dict[str, str]]] = {method.name: [] for method in bench.methods}
    results = []
    for turn, user_message in enumerate(prompt.turns):
        plain: tuple[torch.Tensor, list[int]] | None = None
        for method in bench.methods:
            messages = conversations[method.name] + [{"role": "user", "content": user_message}]
            input_ids = conversation_input_ids(bench.tokenizer, messages)
            prefill_seconds = bench.prefill_seconds(input_ids)

            torch.manual_seed(seed)
            with bench.rounds_of(method) as rounds:
                run = timed_generate(bench.target, bench.tokenizer, input_ids,
                                     attention_mask=torch.ones_like(input_ids), **bench.generate_kwargs(method),
                                     **sampling)

            if method.kind == "plain":
                plain = (input_ids, run.token_ids)
            comparison = compare_with_plain(bench, method, temperature, input_ids, run.token_ids, plain)
            conversations[method.name] = messages + [{"role": "assistant", "content": run.text}]
            results.append(TurnResult(prompt.id, turn, seed, method.name, input_ids.shape[1], run, prefill_seconds,
                                      rounds["stats"], comparison))
            on_request()
    return results


def compare_with_plain(bench: Bench, method: Method, temperature: float, input_ids: torch.Tensor,
                       output: list[int], plain: tuple[torch.Tensor, list[int]] | None) -> Comparison | None:
    """At T=0, the first divergence from plain ``generate`` on the same input (None: nothing to compare)."""
    if temperature > 0 or method.kind == "plain" or plain is None:
        return None
    plain_input, plain_output = plain
    if not torch.equal(plain_input, input_ids):
        return Comparison(False, reason="an earlier turn diverged from plain, so this turn's input differs")
    divergence = find_divergence(bench.target, input_ids, plain_output, output, bench.dtype)
    return Comparison(True, divergence)


@torch.inference_mode()
def find_divergence(target: Any, input_ids: torch.Tensor, plain_output: list[int], output: list[int],
                    dtype: str) -> Divergence | None:
    """The first position where ``output`` leaves ``plain_output``, with the target's top-2 logit gap there.

    The gap comes from one target forward over the input plus plain's tokens before that position. ``dtype`` "fp32":
    every divergence is a bug; "bf16": a gap within ``NEAR_TIE_ULPS`` bf16 ulps of the logit magnitude is a near-tie.
    """
    position = next((i for i, (a, b) in enumerate(zip(plain_output, output)) if a != b), None)
    if position is None:
        if len(plain_output) == len(output):
            return None
        position = min(len(plain_output), len(output))
    prefix = torch.tensor([plain_output[:position]], dtype=input_ids.dtype)
    sequence = torch.cat([input_ids, prefix], dim=-1).to(target.device)
    logits = target(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits[0, -1].float()
    top = logits.topk(2).values
    plain_token = plain_output[position] if position < len(plain_output) else None
    method_token = output[position] if position < len(output) else None
    chosen_gap = None
    if plain_token is not None and method_token is not None:
        chosen_gap = float(logits[plain_token] - logits[method_token])
    magnitude = float(top.abs().max())
    ulp = bf16_ulp(magnitude)
    top2_gap = float(top[0] - top[1])
    near_tie = dtype == "bf16" and top2_gap <= NEAR_TIE_ULPS * ulp
    return Divergence(position, plain_token, method_token, top2_gap, chosen_gap, magnitude, ulp,
                      "near-tie" if near_tie else "bug")


def bf16_ulp(magnitude: float) -> float:
    """Spacing of bfloat16 numbers at ``magnitude`` (8 significant bits)."""
    if magnitude <= 0:
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7)


# --------------------------------------------------------------------------- aggregation


def summarize(turns: list[TurnResult], method: Method, plain_seconds_per_token: float | None,
              temperature: float) -> dict[str, Any]:
    """The metrics of one dataset x method x temperature (see the module docstring for each definition)."""
    decode_tokens = sum(max(len(t.run.token_ids) - 1, 0) for t in turns)
    decode_seconds = sum(max(t.run.seconds - t.prefill_seconds, 0.0) for t in turns)
    seconds_per_token = decode_seconds / decode_tokens if decode_tokens else None
    speedup = (plain_seconds_per_token / seconds_per_token
               if plain_seconds_per_token and seconds_per_token else None)
    row: dict[str, Any] = {
        "method": method.name,
        "temperature": temperature,
        "prompts": len({t.prompt_id for t in turns}),
        "requests": len(turns),
        "new_tokens": sum(len(t.run.token_ids) for t in turns),
        "decode_tokens": decode_tokens,
        "generate_seconds": sum(t.run.seconds for t in turns),
        "prefill_seconds": sum(t.prefill_seconds for t in turns),
        "decode_seconds": decode_seconds,
        "decode_seconds_per_token": seconds_per_token,
        "tokens_per_second": decode_tokens / decode_seconds if decode_seconds > 0 else None,
        "speedup": speedup,
    }
    all_stats = [t.stats for t in turns if t.stats is not None]
    pooled = GenerationStats.pooled(all_stats)
    if method.kind == "plain":  # GenerationStats: "plain decoding has tau = 1"
        row |= {"tau": 1.0, "tau_per_request": 1.0, "tau_per_round": 1.0, "rounds": None,
                "per_position_acceptance": [], "acceptance_length_histogram": {}}
    else:
        tau_per_request = GenerationStats.mean_tau_per_request(all_stats)
        row |= {
            "tau": tau_per_request,
            "tau_per_request": tau_per_request,
            "tau_per_round": pooled.mean_acceptance_length if pooled.rounds else None,
            "rounds": pooled.rounds,
            "per_position_acceptance": pooled.per_position_acceptance,
            "acceptance_length_histogram": {str(k): v for k, v in sorted(Counter(pooled.acceptance_lengths).items())},
        }
    row |= _costs(row, pooled, method, plain_seconds_per_token)
    keeps_suffixes = method.kind == "drafter" and pooled.rounds > 0  # only hf_retrace's generator records them
    row["kept_suffix_rate"] = pooled.kept_suffix_rate if keeps_suffixes else None
    row["kept_token_commit_rate"] = pooled.kept_token_commit_rate if keeps_suffixes else None
    # the round's shape: mean drafted length (the adaptive block), and which source drafted (the hybrid)
    row["mean_draft_length"] = (sum(pooled.draft_lengths) / len(pooled.draft_lengths)) if pooled.draft_lengths else None
    row["lookup_round_share"] = pooled.lookup_rounds / pooled.rounds if keeps_suffixes else None
    row |= _losslessness(turns, temperature)
    row["per_request"] = [
        {"prompt_id": t.prompt_id, "turn": t.turn, "seed": t.seed, "input_tokens": t.input_length,
         "new_tokens": len(t.run.token_ids), "generate_seconds": t.run.seconds, "prefill_seconds": t.prefill_seconds,
         "tau": t.stats.mean_acceptance_length if t.stats is not None and t.stats.rounds else None}
        for t in turns
    ]
    return row


def _costs(row: dict, pooled: GenerationStats, method: Method, plain_spt: float | None) -> dict[str, Any]:
    """c, epsilon and the ideal speed-up tau / (1 + c + epsilon), all per drafting round, against plain's token."""
    if method.kind == "plain" or not pooled.rounds or not plain_spt:
        return {"draft_cost_c": None, "verify_cost_epsilon": None, "ideal_speedup": None,
                "speedup_over_ideal": None, "draft_seconds": None, "verify_seconds": None}
    c = pooled.draft_seconds / pooled.rounds / plain_spt
    epsilon = pooled.verify_seconds / pooled.rounds / plain_spt - 1.0
    ideal = row["tau_per_round"] / (1.0 + c + epsilon)
    return {"draft_cost_c": c, "verify_cost_epsilon": epsilon, "ideal_speedup": ideal,
            "speedup_over_ideal": row["speedup"] / ideal if row["speedup"] and ideal > 0 else None,
            "draft_seconds": pooled.draft_seconds, "verify_seconds": pooled.verify_seconds}


def _losslessness(turns: list[TurnResult], temperature: float) -> dict[str, Any]:
    if temperature > 0 or all(t.comparison is None for t in turns):
        return {"mismatches": None if temperature > 0 else 0, "mismatch_bugs": None if temperature > 0 else 0,
                "mismatch_near_ties": None if temperature > 0 else 0, "compared_requests": 0,
                "uncompared_requests": 0, "divergences": []}
    compared = [t for t in turns if t.comparison is not None and t.comparison.compared]
    diverged = [t for t in compared if t.comparison.divergence is not None]
    return {
        "mismatches": len(diverged),
        "mismatch_bugs": sum(t.comparison.divergence.verdict == "bug" for t in diverged),
        "mismatch_near_ties": sum(t.comparison.divergence.verdict == "near-tie" for t in diverged),
        "compared_requests": len(compared),
        "uncompared_requests": sum(1 for t in turns if t.comparison is not None and not t.comparison.compared),
        "divergences": [{"prompt_id": t.prompt_id, "turn": t.turn, "seed": t.seed,
                         **dataclasses.asdict(t.comparison.divergence)} for t in diverged],
    }


# --------------------------------------------------------------------------- the entry point


def temperature_label(temperature: float) -> str:
    return f"T={temperature:g}"


def run_benchmark(spec: BenchSpec, plan: BenchPlan | None = None) -> dict[str, Any]:
    """Check the spec, load the models, warm up, run every prompt with every method; return the report dict."""
    plan = plan or plan_benchmark(spec)
    for method, reason in plan.skipped.items():
        print(f"[hf-retrace bench] {method}: {reason}", file=sys.stderr)
    for note in plan.notes:
        print(f"[hf-retrace bench] note: {note}", file=sys.stderr)
    loaded_at = time.perf_counter()
    bench = Bench(plan, *load_models(plan))
    load_seconds = time.perf_counter() - loaded_at

    first_prompt = next(p for prompts in plan.prompts.values() for p in prompts)
    if spec.warmup:  # first forwards of a process are slow (allocations, kernel choice): keep them out of the timings
        warm = dataclasses.replace(first_prompt, turns=first_prompt.turns[:1])
        saved, bench.max_new_tokens = bench.max_new_tokens, min(spec.max_new_tokens, 16)
        run_prompt(bench, warm, 0.0, spec.seeds[0])
        bench.max_new_tokens, bench._prefill_cache = saved, {}

    from tqdm.auto import tqdm

    runs = [(t, s) for t in spec.temperatures for s in (spec.seeds if t > 0 else spec.seeds[:1])]
    total = sum(len(p.turns) for prompts in plan.prompts.values() for p in prompts) * len(runs) * len(bench.methods)
    turns_by_row: dict[tuple[str, float, str], list[TurnResult]] = {}
    started = time.perf_counter()
    with tqdm(total=total, desc="hf-retrace bench", unit="request", disable=not spec.progress, file=sys.stderr) as bar:
        for dataset, prompts in plan.prompts.items():
            for temperature, seed in runs:
                for prompt in prompts:
                    for turn in run_prompt(bench, prompt, temperature, seed, on_request=lambda: bar.update(1)):
                        turns_by_row.setdefault((dataset, temperature, turn.method), []).append(turn)
    bench_seconds = time.perf_counter() - started

    results: dict[str, dict[str, dict[str, Any]]] = {}
    rows = []
    for dataset in plan.prompts:
        for temperature in spec.temperatures:
            plain = summarize(turns_by_row[(dataset, temperature, "plain")], ALL_METHODS["plain"], None, temperature)
            plain_spt = plain["decode_seconds_per_token"]
            for method in bench.methods:
                row = summarize(turns_by_row[(dataset, temperature, method.name)], method, plain_spt, temperature)
                row = {"dataset": dataset, **row}
                rows.append(row)
                results.setdefault(dataset, {}).setdefault(method.name, {})[temperature_label(temperature)] = row
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": _settings(plan),
        "environment": _environment(bench, load_seconds, bench_seconds),
        "methods": {m.name: m.description for m in bench.methods},
        "skipped": dict(plan.skipped),
        "notes": list(plan.notes),
        "results": results,
        "rows": rows,
        "lossless": _lossless_summary(rows),
    }


def _settings(plan: BenchPlan) -> dict[str, Any]:
    from .. import defaults
    from ..loading import portable_path

    spec = plan.spec
    default = spec.target in (None, "default")
    return {
        "target": f"{defaults.DEFAULT_TARGET_HUB_ID} (converted default)" if default else portable_path(plan.target_path),
        "drafters": {name: portable_path(path) for name, path in plan.drafter_paths.items()},
        "datasets": {name: len(prompts) for name, prompts in plan.prompts.items()},
        "methods": [m.name for m in plan.methods],
        "temperatures": list(spec.temperatures),
        "seeds": list(spec.seeds),
        "max_new_tokens": spec.max_new_tokens,
        "limit": spec.limit,
        "dtype": spec.dtype,
        "quantization": spec.quantization,
        "warmup": spec.warmup,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
        "near_tie_ulps": NEAR_TIE_ULPS,
        "timing": "decode only: generate wall time minus one timed target prefill forward per request; "
                  "tokens after the first (the prefill's)",
    }


def _environment(bench: Bench, load_seconds: float, bench_seconds: float) -> dict[str, Any]:
    import transformers

    from .. import __version__

    return {
        "harness": "Hugging Face transformers generate(), eager, batch size 1",
        "device": str(bench.target.device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_retrace": __version__,
        "load_seconds": load_seconds,
        "bench_seconds": bench_seconds,
    }


def _lossless_summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "compared_requests": sum(r["compared_requests"] for r in rows),
        "mismatches": sum(r["mismatches"] or 0 for r in rows),
        "mismatch_bugs": sum(r["mismatch_bugs"] or 0 for r in rows),
        "mismatch_near_ties": sum(r["mismatch_near_ties"] or 0 for r in rows),
    }
