"""What one demo request may ask for: the methods, the limits, and the error the page shows as is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = {
    "plain": "Plain decoding only",
    "dflash": "DFlash backbone (ReTrace off)",
    "retrace": "ReTrace",
}


class DemoError(ValueError):
    """A request (or a start-up argument) the demo refuses; the message is shown to the user as is."""


@dataclass(frozen=True)
class Limits:
    """The largest request the page accepts; :meth:`validate` normalises one request or says what is wrong.

    Example: ``Limits(max_new_tokens=256).validate("Hi", "retrace", 0, 64, 0) == ("Hi", "retrace", 0.0, 64, 0)``
    """

    max_new_tokens: int = 1024
    max_prompt_chars: int = 8000
    max_prompt_tokens: int = 2048
    max_temperature: float = 2.0
    max_seed: int = 2**31 - 1

    def validate(self, prompt: Any, method: Any, temperature: Any, max_new_tokens: Any, seed: Any) -> tuple:
        """Normalised ``(prompt, method, temperature, max_new_tokens, seed)``, or a DemoError saying what is wrong."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise DemoError("the prompt is empty: type a question or an instruction.")
        if len(prompt) > self.max_prompt_chars:
            raise DemoError(f"the prompt is {len(prompt)} characters long; the limit is {self.max_prompt_chars}.")
        if method not in METHODS:
            raise DemoError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")
        try:
            temperature = float(temperature if temperature is not None else 0.0)
        except (TypeError, ValueError):
            raise DemoError(f"temperature must be a number, got {temperature!r}.") from None
        if not 0.0 <= temperature <= self.max_temperature:  # also rejects NaN
            raise DemoError(f"temperature must be between 0 and {self.max_temperature}, got {temperature}.")
        try:
            as_float = float(max_new_tokens)
        except (TypeError, ValueError):
            raise DemoError(f"max new tokens must be a whole number, got {max_new_tokens!r}.") from None
        if not as_float.is_integer() or not 1 <= as_float <= self.max_new_tokens:
            raise DemoError(f"max new tokens must be a whole number from 1 to {self.max_new_tokens}, "
                            f"got {max_new_tokens}.")
        try:
            seed_f = float(seed if seed is not None else 0)
        except (TypeError, ValueError):
            raise DemoError(f"the seed must be a whole number, got {seed!r}.") from None
        if not seed_f.is_integer() or not 0 <= seed_f <= self.max_seed:
            raise DemoError(f"the seed must be a whole number from 0 to {self.max_seed}, got {seed}.")
        return prompt, method, temperature, int(as_float), int(seed_f)
