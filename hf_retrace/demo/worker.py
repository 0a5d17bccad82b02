"""One ``generate`` call in a thread of its own, read round by round from a queue of its own.

Stopping never waits for the thread: gradio closes a request's generator on its event loop, and a join there would
freeze every other page for the rest of a round. :meth:`GenerateWorker.stop` sets the call's cancel event, a stopping
criterion ends ``generate`` at its next round, and the thread itself releases what it holds (the sampling lock).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .limits import DemoError
from .rounds import RoundInfo, RoundStreamer

logger = logging.getLogger("hf_retrace.demo")


@dataclass(frozen=True)
class Finished:
    """A worker's last event: its ``generate`` returned (``stats``: the drafter's, with the round log) or raised."""

    seconds: float
    stats: dict | None
    error: BaseException | None = None


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class GenerateWorker:
    """``target.generate`` (drafted by ``drafter``, or plain) for one side of one request, in a thread of its own.

    ``sampling_lock``: held by the thread for exactly its ``manual_seed`` + ``generate`` (torch's sampling RNG is
    process-wide, so one seeded run at a time is what makes a seed repeatable). Example::

        worker = GenerateWorker(target, input_ids, {"max_new_tokens": 32, "do_sample": False}, drafter)
        worker.start()
        events = []
        while not events or not isinstance(events[-1], Finished):
            events += worker.wait(0.1)  # RoundInfo ..., then one Finished
    """

    lock_poll_seconds = 0.05  # how often a thread waiting for the sampling lock looks at its cancel event

    def __init__(
        self,
        target: Any,
        input_ids: torch.Tensor,
        gen_kwargs: dict,
        drafter: Any = None,
        *,
        seed: int | None = None,
        sampling_lock: threading.Lock | None = None,
        lock_timeout: float = 600.0,
        cancel: threading.Event | None = None,
        name: str = "hf-retrace-demo",
    ):
        self.target, self.input_ids, self.gen_kwargs, self.drafter = target, input_ids, gen_kwargs, drafter
        self.seed, self.sampling_lock, self.lock_timeout = seed, sampling_lock, lock_timeout
        self.cancel = cancel or threading.Event()
        self.waiting = False  # True while the thread waits for another request's sampled generate to end
        self._events: "queue.Queue[RoundInfo | Finished]" = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the running ``generate`` to end at its next round; returns at once."""
        self.cancel.set()

    def wait(self, seconds: float) -> list[RoundInfo | Finished]:
        """What the thread posted within ``seconds``; returns early with the :class:`Finished` that ends the call."""
        deadline = time.perf_counter() + seconds
        events: list[RoundInfo | Finished] = []
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                return events
            events.append(event)
            if isinstance(event, Finished):
                return events

    # --- the thread ---------------------------------------------------------------------------------------------
    def _work(self) -> None:
        started = time.perf_counter()
        try:
            if self.sampling_lock is not None and not self._acquire_sampling_lock():
                self._events.put(Finished(0.0, None))  # cancelled while waiting: nothing was generated
                return
            try:
                finished = self._generate()
            finally:
                if self.sampling_lock is not None:
                    self.sampling_lock.release()
            self._events.put(finished)
        except BaseException as exc:  # noqa: BLE001 - reported to the request, never kills the server
            logger.exception("generate failed")
            self._events.put(Finished(time.perf_counter() - started, None, exc))

    def _acquire_sampling_lock(self) -> bool:
        """Wait for the sampling lock; False when the request was cancelled meanwhile."""
        lock = self.sampling_lock
        if lock.acquire(blocking=False):
            return True
        self.waiting = True
        deadline = time.perf_counter() + self.lock_timeout
        try:
            while not lock.acquire(timeout=self.lock_poll_seconds):
                if self.cancel.is_set():
                    return False
                if time.perf_counter() > deadline:
                    raise DemoError(f"the server was busy with other sampled requests for {self.lock_timeout:.0f} s; "
                                    "try again later, or use temperature 0 (greedy requests do not wait).")
            return True
        finally:
            self.waiting = False

    def _generate(self) -> Finished:
        started = time.perf_counter()
        if self.seed is not None:
            torch.manual_seed(self.seed)
        streamer = RoundStreamer(self._events.put, self.drafter, started)
        stop = StoppingCriteriaList([_Cancelled(self.cancel)])
        kwargs = dict(self.gen_kwargs, streamer=streamer, stopping_criteria=stop)
        if self.drafter is not None:
            kwargs["assistant_model"] = self.drafter
        ids = self.input_ids.to(self.target.device)
        with torch.inference_mode():
            self.target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - started
        stats = self.drafter.last_stats if self.drafter is not None else None  # this thread's stats
        summary = None if stats is None else stats.as_dict() | {"round_log": [list(r) for r in stats.round_log]}
        return Finished(seconds, summary)
