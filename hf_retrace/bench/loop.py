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

__all__ = ["Bench", "TurnResult", "run_prompt"]


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
    answers between them (:func:`hf_retrace.chat.prompt_token_ids`). On every turn plain runs first: its answer is the
    T=0 reference for the others.
    """
    sampling = sampling_kwargs(temperature, bench.max_new_tokens)
    histories: dict[str, list[str]] = {method.name: [] for method in bench.methods}
    results = []
    for turn, user_message in enumerate(prompt.turns):
        plain: tuple[torch.Tensor, list[int]] | None = None
        for method in bench.methods:
            history = histories[method.name]
            token_ids = prompt_token_ids(bench.tokenizer, [user_message], [history])[0]
            input_ids = torch.tensor([token_ids], dtype=torch.long)
            prefill_seconds = bench.prefill_seconds(input_ids, onednn=method.onednn)

            torch.manual_seed(seed)
            with bench.rounds_of(method) as rounds:
                run = timed_generate(bench.target, bench.tokenizer, input_ids,
                                     attention_mask=torch.ones_like(input_ids), **bench.generate_kwargs(method),
                                     **sampling)

            if method.kind == "plain":
                plain = (input_ids, run.token_ids)
            comparison = compare_with_plain(bench.target, bench.dtype, method, temperature, input_ids,
                                            run.token_ids, plain)
            histories[method.name] = [*history, user_message, run.text]
            results.append(TurnResult(prompt.id, turn, seed, method.name, input_ids.shape[1], run, prefill_seconds,
                                      rounds["stats"], comparison))
            on_request()
    return results
