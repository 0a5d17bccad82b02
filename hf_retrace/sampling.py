"""The ``generate`` settings of one temperature, the same for the CLI comparison, the benchmark and the demo."""

from __future__ import annotations

from typing import Any


def sampling_kwargs(temperature: float, max_new_tokens: int) -> dict[str, Any]:
    """Greedy at ``temperature`` 0, else sampling from the pure tempered distribution.

    ``top_k`` / ``top_p`` are unset either way, so a target whose generation config truncates the distribution
    still samples (or argmaxes) exactly the law that the numbers are reported for.

    >>> sampling_kwargs(0.7, 64)["do_sample"]
    True
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}.")
    sampled = temperature > 0
    return dict(do_sample=sampled, temperature=temperature if sampled else None, top_k=None, top_p=None,
                max_new_tokens=max_new_tokens)
