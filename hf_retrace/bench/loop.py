"""The timed loop: the loaded models (:class:`Bench`) and every method on one prompt, turn by turn
(:func:`run_prompt`).

Prefill is excluded: before each request the target runs one timed forward over the request's input ids
(``use_cache=True, logits_to_keep=1``: what ``generate``'s first forward does), measured once per distinct input.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..chat import prompt_token_ids
from ..generation.placement import synchronize
from ..machine import onednn_matmuls
from ..sampling import sampling_kwargs
from ..side_by_side import Run, timed_generate
from ..stats import GenerationStats
from .datasets import BenchPrompt
from .divergence import Comparison, compare_with_plain
from .methods import PROMPT_LOOKUP_NUM_TOKENS, Method
from .plan import BenchPlan
from .recording import recording_rounds

__all__ = ["Bench", "TurnResult", "call_order", "median_call", "run_prompt"]


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
    """The loaded models plus how each method calls ``generate`` and where its rounds are recorded.

    Example::

        bench = Bench(plan, target, tokenizer, {path: drafter for path in plan.drafter_paths.values()})
        turns = run_prompt(bench, plan.prompts["gsm8k"][0], temperature=0.0, seed=0)
    """

    def __init__(self, plan: BenchPlan, target: Any, tokenizer: Any, drafters: dict[str, Any]):
        self.plan, self.target, self.tokenizer = plan, target, tokenizer
        self.methods = plan.methods
        self.max_new_tokens = plan.spec.max_new_tokens
        self.dtype = plan.spec.dtype
        by_name = {method.name: method for method in self.methods}
        self.drafters = {name: by_name[name].drafter_view(drafters[path]) if by_name.get(name, None) is not None
                         and by_name[name].kind == "drafter" else drafters[path]
                         for name, path in plan.drafter_paths.items()}
        self.native_assistants = {}
        for method in self.methods:
            if method.kind == "native":
                from .native import build_native_assistant

                self.native_assistants[method.name] = build_native_assistant(self.drafters[method.name])
        self._prefill_cache: dict[tuple[bool | int, ...], float] = {}
        self.repeats = plan.spec.repeats  # timed calls per request and method (the median kept)

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
        """One call's rounds; yields ``{"stats": GenerationStats | None}``, filled after the call."""
        recorded: dict[str, GenerationStats | None] = {"stats": None}
        if method.kind == "drafter":
            drafter = self.drafters[method.name]  # a view with the method's round policy
            yield recorded
            recorded["stats"] = drafter.last_stats
        elif method.kind in ("prompt-lookup", "native"):
            stats = GenerationStats()
            if method.kind == "native":
                self.native_assistants[method.name].last_stats = stats
            with recording_rounds(self.target, stats):
                yield recorded
            recorded["stats"] = stats
        elif not method.onednn:
            with onednn_matmuls(False):
                yield recorded
        else:
            yield recorded

    @torch.inference_mode()
    def prefill_seconds(self, input_ids: torch.Tensor, onednn: bool = True) -> float:
        """Seconds of one target forward over ``input_ids`` (what ``generate``'s prefill does), measured once per
        setting of torch's oneDNN matmuls (``onednn``: as the call runs them, :attr:`Method.onednn`)."""
        key = (onednn, *input_ids[0].tolist())
        if key not in self._prefill_cache:
            ids = input_ids.to(self.target.device)
            synchronize(ids.device)
            with onednn_matmuls(onednn):
                started = time.perf_counter()
                out = self.target(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                                  logits_to_keep=1)
                synchronize(out.logits.device)
                self._prefill_cache[key] = time.perf_counter() - started
        return self._prefill_cache[key]

    def forget_prefill_timings(self) -> None:
        """Drop the prefill measurements (those of the warm-up are not representative)."""
        self._prefill_cache = {}


def run_prompt(bench: Bench, prompt: BenchPrompt, temperature: float, seed: int,
               on_request: Callable[[], None] = lambda: None) -> list[TurnResult]:
    """Every method on one prompt, turn by turn; one :class:`TurnResult` per (turn, method).

    Each method keeps its own conversation: turn k's input holds the user turns so far with the method's own previous
    answers between them (:func:`hf_retrace.chat.prompt_token_ids`). Plain's answer is the T=0 reference for the
    others. With ``bench.repeats`` R > 1 each call runs R times, seeded alike (the same tokens each time), the
    methods' order reversed every other repeat so that none always runs first or last, and the call whose decode time
    is the median is kept: methods compared on one run drift against each other by a few percent.
    """
    sampling = sampling_kwargs(temperature, bench.max_new_tokens)
    histories: dict[str, list[str]] = {method.name: [] for method in bench.methods}
    results = []
    for turn, user_message in enumerate(prompt.turns):
        inputs = {method.name: torch.tensor([prompt_token_ids(bench.tokenizer, [user_message],
                                                              [histories[method.name]])[0]], dtype=torch.long)
                  for method in bench.methods}
        calls: dict[str, list[tuple[Run, float, GenerationStats | None]]] = {m.name: [] for m in bench.methods}
        for repeat in range(bench.repeats):
            for method in call_order(bench.methods, repeat):
                input_ids = inputs[method.name]
                prefill_seconds = bench.prefill_seconds(input_ids, onednn=method.onednn)
                torch.manual_seed(seed)
                with bench.rounds_of(method) as rounds:
                    run = timed_generate(bench.target, bench.tokenizer, input_ids,
                                         attention_mask=torch.ones_like(input_ids), **bench.generate_kwargs(method),
                                         **sampling)
                calls[method.name].append((run, prefill_seconds, rounds["stats"]))
        kept = {name: median_call(timed) for name, timed in calls.items()}
        reference = next((m.name for m in bench.methods if m.kind == "plain"), None)
        plain = None if reference is None else (inputs[reference], kept[reference][0].token_ids)
        for method in bench.methods:
            run, prefill_seconds, stats = kept[method.name]
            input_ids = inputs[method.name]
            comparison = compare_with_plain(bench.target, bench.dtype, method, temperature, input_ids,
                                            run.token_ids, plain)
            histories[method.name] = [*histories[method.name], user_message, run.text]
            results.append(TurnResult(prompt.id, turn, seed, method.name, input_ids.shape[1], run, prefill_seconds,
                                      stats, comparison))
            on_request()
    return results


def call_order(methods: list[Method], repeat: int) -> list[Method]:
    """The methods' order on ``repeat``: as given, reversed every other time, so that no method always runs first (or
    last) on a request or a batch."""
    return methods if repeat % 2 == 0 else methods[::-1]


def median_call(calls: list[tuple[Run, float, Any]]) -> tuple[Run, float, Any]:
    """Of one request's repeated calls ``(run, prefill seconds, stats)``, the one whose decode time (wall time minus
    prefill) is the median (the lower of the middle two for an even count).

    >>> [median_call([(Run([], "", s), 0.0, None) for s in times])[0].seconds for times in ([3, 1, 2], [4, 1, 3, 2])]
    [2, 2]
    """
    ordered = sorted(calls, key=lambda call: call[0].seconds - call[1])
    return ordered[(len(ordered) - 1) // 2]
