"""A wall-clock budget for one process's training loop (``hf-retrace train --max-minutes``).

The trainer fits its learning-rate schedule to the steps the budget holds, once their speed is known, and stops the loop
when the budget is spent (``Trainer._fit_to_budget``); this module only keeps the time.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["BUDGET_FIT_SHARE", "BUDGET_FIT_STEPS", "BUDGET_SAFETY", "BUDGET_SKIP_STEPS", "TimeBudget"]

# A time budget (``TrainingArguments.max_seconds``) fits the schedule to the speed of this process's steps
# ``BUDGET_SKIP_STEPS`` to ``BUDGET_SKIP_STEPS + BUDGET_FIT_STEPS`` (the first ones pay for warm-up: allocations,
# kernels chosen, caches filled), or of those done once ``BUDGET_FIT_SHARE`` of the budget has passed if that is sooner;
# the steps it fits are ``BUDGET_SAFETY`` of what the rest of the budget holds at that speed.
BUDGET_SKIP_STEPS = 2
BUDGET_FIT_STEPS = 10
BUDGET_FIT_SHARE = 0.1
BUDGET_SAFETY = 0.95


class TimeBudget:
    """One process's wall-clock budget for the loop: how fast its steps run (periodic evaluations apart), when that
    speed is known well enough to fit the schedule to it, and how much of the budget is left."""

    def __init__(self, seconds: float, clock: Callable[[], float]):
        self.seconds, self.clock = float(seconds), clock
        self.start = clock()  # before the starting evaluation: it spends the budget too
        self.eval_seconds = 0.0  # the latest evaluation's
        self.steps = 0  # steps done in this process
        self._mark = (self.start, 0, 0.0)  # (time, steps, evaluation seconds) where the timing of steps starts
        self._evals = 0.0  # evaluation seconds inside the loop so far

    def loop_started(self, eval_seconds: float) -> None:
        """After the starting evaluation (``eval_seconds``, 0 without one): the steps are timed from here."""
        self.eval_seconds = eval_seconds or self.eval_seconds
        self._mark = (self.clock(), 0, 0.0)

    def step_done(self, eval_seconds: float) -> None:
        self.steps += 1
        if eval_seconds:
            self.eval_seconds = eval_seconds
            self._evals += eval_seconds
        if self.steps == BUDGET_SKIP_STEPS:  # the warm-up steps are not timed
            self._mark = (self.clock(), self.steps, self._evals)

    def fit_ready(self) -> bool:
        timed = self.steps - self._mark[1]
        return (self.steps >= BUDGET_SKIP_STEPS and timed >= BUDGET_FIT_STEPS) or (
            self.clock() - self.start >= BUDGET_FIT_SHARE * self.seconds and timed >= 1)

    def seconds_per_step(self) -> float:
        when, steps, evals = self._mark
        return max(self.clock() - when - (self._evals - evals), 0.0) / max(self.steps - steps, 1)

    def remaining(self) -> float:
        return self.start + self.seconds - self.clock()
