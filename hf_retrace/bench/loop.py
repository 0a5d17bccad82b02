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

from ..sampling import sampling_kwargs
from ..side_by_side import Run, chat_input_ids, timed_generate
from ..stats import GenerationStats
from .datasets import BenchPrompt
from .divergence import Comparison, compare_with_plain
from .methods import PROMPT_LOOKUP_NUM_TOKENS, Method
from .plan import BenchPlan
from .recording import drafter_switches, recording_rounds

__all__ = ["Bench", "TurnResult", "conversation_input_ids", "run_prompt"]


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
            with drafter_switches(drafter, method):
                yield recorded
            recorded["stats"] = drafter.last_stats
        elif method.kind in ("prompt-lookup", "native"):
            stats = GenerationStats()
            if method.kind == "native":
                self.native_assistants[method.name].last_stats = stats
            with recording_rounds(self.target, stats):
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

    def forget_prefill_timings(self) -> None:
        """Drop the prefill measurements (those of the warm-up are not representative)."""
        self._prefill_cache = {}


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
    sampling = sampling_kwargs(temperature, bench.max_new_tokens)
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
            comparison = compare_with_plain(bench.target, bench.dtype, method, temperature, input_ids,
                                            run.token_ids, plain)
            conversations[method.name] = messages + [{"role": "assistant", "content": run.text}]
            results.append(TurnResult(prompt.id, turn, seed, method.name, input_ids.shape[1], run, prefill_seconds,
                                      rounds["stats"], comparison))
            on_request()
    return results
