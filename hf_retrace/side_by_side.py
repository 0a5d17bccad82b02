"""Plain ``generate`` and drafted ``generate`` on the same prompt: same answer, two speeds."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .sampling import sampling_kwargs


@dataclass
class Run:
    """One ``generate`` call: the new tokens, their text, the wall time, and the drafter's stats (if any)."""

    token_ids: list[int]
    text: str
    seconds: float
    stats: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SideBySide:
    prompt: str
    plain: Run
    drafted: Run
    extra: dict = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return self.plain.token_ids == self.drafted.token_ids

    @property
    def speedup(self) -> float:
        """Drafted tokens/s over plain tokens/s (the two answers may differ in length at bf16 near-ties)."""
        plain = self.plain.tokens_per_second
        return self.drafted.tokens_per_second / plain if plain > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "answer": self.drafted.text,
            "identical_to_plain": self.identical,
            "tau": (self.drafted.stats or {}).get("mean_acceptance_length"),
            "tokens_per_second_plain": self.plain.tokens_per_second,
            "tokens_per_second_drafted": self.drafted.tokens_per_second,
            "speedup": self.speedup,
            "plain": asdict(self.plain),
            "drafted": asdict(self.drafted),
            **self.extra,
        }


def chat_input_ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    """The prompt as one user turn with the generation prompt (thinking off where the template has it)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def timed_generate(target: Any, tokenizer: Any, input_ids: torch.Tensor, **kwargs: Any) -> Run:
    drafter = kwargs.get("assistant_model")
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(input_ids.to(target.device), **kwargs)
    seconds = time.perf_counter() - started
    new = out[0, input_ids.shape[1] :].tolist()
    stats = drafter.last_stats.as_dict() if drafter is not None and drafter.last_stats is not None else None
    return Run(new, tokenizer.decode(new, skip_special_tokens=True), seconds, stats)


def compare(
    target: Any,
    tokenizer: Any,
    drafter: Any,
    prompt: str,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    warmup: bool = True,
) -> SideBySide:
    """Run plain decoding and drafted decoding on ``prompt`` (same seed) and return both."""
    input_ids = chat_input_ids(tokenizer, prompt)
    sampling = sampling_kwargs(temperature, max_new_tokens)
    if warmup:  # the first forwards in a process are slow (kernel set-up): keep them out of the timings
        timed_generate(target, tokenizer, input_ids, max_new_tokens=4, do_sample=False)
        timed_generate(target, tokenizer, input_ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    torch.manual_seed(seed)
    plain = timed_generate(target, tokenizer, input_ids, **sampling)
    torch.manual_seed(seed)
    drafted = timed_generate(target, tokenizer, input_ids, assistant_model=drafter, **sampling)
    return SideBySide(prompt, plain, drafted)
