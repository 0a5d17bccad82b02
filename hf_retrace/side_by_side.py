"""Plain ``generate`` and drafted ``generate`` on the same prompt: same answer, two speeds.

At T=0 the two answers are compared token for token; where they part, :func:`hf_retrace.divergence.find_divergence`
(the benchmark's classifier) says where, with which tokens, and whether the target's top-2 logit gap there makes it a
bf16 near-tie or a bug. :func:`describe_round` names what ran, in the README's words.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .chat import prompt_token_ids
from .divergence import NEAR_TIE_ULPS, Divergence, find_divergence
from .generation.policy import shipped_policy
from .sampling import sampling_kwargs
from .stats import speedup_over_plain, tokens_per_second_of


@dataclass
class Run:
    """One ``generate`` call: the new tokens, their text, the wall time, and the drafter's stats (if any)."""

    token_ids: list[int]
    text: str
    seconds: float
    stats: dict | None = None

    @property
    def tokens_per_second(self) -> float:
        return tokens_per_second_of(len(self.token_ids), self.seconds)


@dataclass
class SideBySide:
    """Both runs of one prompt; at T=0 (``compared``) their first divergence, if any, classified.

    Example::

        result = compare(target, tokenizer, drafter, "Hi!")
        print("\n".join(result.outcome_lines(tokenizer)))
    """

    prompt: str
    plain: Run
    drafted: Run
    extra: dict = field(default_factory=dict)
    temperature: float = 0.0
    dtype: str = "fp32"  # the target's weights: "bf16" | "fp16" | "fp32" (what the near-tie rule reads)
    divergence: Divergence | None = None  # T=0 only: where the drafted answer left plain's (None: identical)
    ran: str = ""  # what drafted: describe_round()

    @property
    def identical(self) -> bool:
        return self.plain.token_ids == self.drafted.token_ids

    @property
    def compared(self) -> bool:
        """Token-for-token comparison applies at T=0 only (sampled runs draw different random numbers)."""
        return self.temperature == 0

    @property
    def speedup(self) -> float:
        """Drafted tokens/s over plain tokens/s (the two answers may differ in length at bf16 near-ties)."""
        return speedup_over_plain(self.drafted.tokens_per_second, self.plain.tokens_per_second) or 0.0

    def as_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "answer": self.drafted.text,
            "identical_to_plain": self.identical,
            "compared_to_plain": self.compared,
            "divergence": asdict(self.divergence) if self.divergence is not None else None,
            "ran": self.ran,
            "tau": (self.drafted.stats or {}).get("mean_acceptance_length"),
            "tokens_per_second_plain": self.plain.tokens_per_second,
            "tokens_per_second_drafted": self.drafted.tokens_per_second,
            "speedup": self.speedup,
            "plain": asdict(self.plain),
            "drafted": asdict(self.drafted),
            **self.extra,
        }

    def outcome_lines(self, tokenizer: Any) -> list[str]:
        """What the comparison found, in words: identical, where and why the answers part, or not compared (T>0)."""
        plain, drafted = self.plain.token_ids, self.drafted.token_ids
        if not self.compared:
            return [f"outputs: not compared token for token: at temperature {self.temperature:g} the two runs draw "
                    "different random numbers, so they are two samples of the same distribution (the sampling law "
                    "is tested: tests/test_sampling_law.py)."]
        if self.identical:
            return [f"outputs: identical to plain generate, token for token ({len(plain)} tokens)."]
        at = self.divergence
        if at is None:  # a SideBySide built by hand: compare() always classifies a T=0 divergence
            return ["outputs: differ from plain generate; not classified (compare() finds where and why)."]
        lines = [f"outputs: identical for the first {at.position} tokens, then part at token {at.position}: plain "
                 f"{_token_words(tokenizer, at.plain_token)}, drafted {_token_words(tokenizer, at.method_token)}."]
        gap = f"the target's top-2 logit gap there (one forward over plain's tokens) is {at.top2_gap:.4g}"
        if self.dtype == "bf16":
            gap += f", {at.top2_gap / at.bf16_ulp:.2g} bf16 ulps at logit magnitude {at.logit_magnitude:.3g}"
        if at.verdict == "near-tie":
            lines.append(f"  {gap}: a near-tie (within {NEAR_TIE_ULPS} ulps), so bf16 rounding, not a bug: the "
                         "drafted run scores that position in a many-token verify, which rounds differently from "
                         "one-token decoding. --dtype fp32 compares exactly.")
        else:
            reason = (f"above {NEAR_TIE_ULPS} ulps, so not rounding" if self.dtype == "bf16"
                      else f"in {self.dtype} every divergence counts (near-ties are classified in bf16 only)")
            lines.append(f"  {gap}: {reason}. This is a bug: please report it with this command and its output.")
        return lines


def _token_words(tokenizer: Any, token: int | None) -> str:
    """A token as a user reads it: its text and id (None: that run had already stopped)."""
    if token is None:
        return "(had stopped)"
    return f"{tokenizer.decode([token])!r} (id {token})"


def describe_round(drafter: Any, stats: dict | None = None) -> str:
    """What drafted, in the README's words ("What ran"): the call's own round policy (``last_stats.policy``), or the
    drafter's shipped one where the call recorded none."""
    if stats and stats.get("policy"):
        return str(stats["policy"])
    return shipped_policy(drafter.config).describe()


def chat_input_ids(tokenizer: Any, prompt: str) -> torch.Tensor:
    """The prompt as one user turn with the generation prompt (:func:`hf_retrace.chat.prompt_token_ids`), ``[1, T]``."""
    return torch.tensor([prompt_token_ids(tokenizer, [prompt])[0]], dtype=torch.long)


def timed_generate(target: Any, tokenizer: Any, input_ids: torch.Tensor, **kwargs: Any) -> Run:
    drafter = kwargs.get("assistant_model")
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(input_ids.to(target.device), **kwargs)
    new = out[0, input_ids.shape[1] :].tolist()  # read before the clock stops: waits for the device's queued work
    seconds = time.perf_counter() - started
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
    """Run plain decoding and drafted decoding on ``prompt`` (same seed) and return both; at T=0, classify where the
    answers part (one more target forward, only when they do)."""
    input_ids = chat_input_ids(tokenizer, prompt)
    sampling = sampling_kwargs(temperature, max_new_tokens)
    if warmup:  # the first forwards in a process are slow (kernel set-up): keep them out of the timings
        timed_generate(target, tokenizer, input_ids, max_new_tokens=4, do_sample=False)
        timed_generate(target, tokenizer, input_ids, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    torch.manual_seed(seed)
    plain = timed_generate(target, tokenizer, input_ids, **sampling)
    torch.manual_seed(seed)
    drafted = timed_generate(target, tokenizer, input_ids, assistant_model=drafter, **sampling)
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(target.dtype, "fp32")
    divergence = None
    if temperature == 0 and plain.token_ids != drafted.token_ids:
        divergence = find_divergence(target, input_ids, plain.token_ids, drafted.token_ids, dtype)
    return SideBySide(prompt, plain, drafted, temperature=temperature, dtype=dtype, divergence=divergence,
                      ran=describe_round(drafter, drafted.stats))
