"""The demo's engine: one loaded target + tokenizer + drafter, shared read-only by every request.

"DFlash backbone" and "ReTrace" are two *views* of the same drafter weights, each with its own config. A request
(:meth:`DemoEngine.stream`) runs each side's ``generate`` in a :class:`~hf_retrace.demo.worker.GenerateWorker` of its
own and yields a :class:`~hf_retrace.demo.snapshot.Snapshot` as the rounds arrive.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import torch

from ..generation.checks import check_context, check_target
from ..sampling import sampling_kwargs
from ..side_by_side import chat_input_ids
from .drafters import DrafterFolders, DrafterViews
from .limits import METHODS, DemoError, Limits
from .snapshot import SideState, Snapshot, final_status
from .worker import Finished, GenerateWorker


class DemoEngine:
    """One target + tokenizer + drafter, shared read-only by every request; :meth:`stream` serves one request.

    Example: ``for snap in DemoEngine.from_pretrained(None, None).stream("Hi", "retrace"): print(snap.status)``
    """

    def __init__(
        self,
        target: Any,
        tokenizer: Any,
        drafter: Any,
        *,
        drafter_source: str = "",
        target_source: str = "",
        limits: Limits | None = None,
        allow_custom_drafters: bool = True,
        warmup: bool = True,
        update_interval: float = 0.12,
    ):
        self.target = target.eval()
        self.tokenizer = tokenizer
        self.limits = limits or Limits()
        self.allow_custom_drafters = allow_custom_drafters  # launch() turns it off on a server others can reach
        self.update_interval = update_interval
        name = getattr(target.config, "_name_or_path", "") or type(target).__name__
        self.target_source = target_source or str(name)
        try:
            check_target(drafter, target)
        except ValueError as exc:
            raise DemoError(str(exc)) from exc
        self.drafters = DrafterViews.of(drafter.eval(), drafter_source or str(getattr(drafter, "name_or_path", "")))
        self._folders = DrafterFolders(self.target)
        self._sampling_lock = threading.Lock()  # torch's sampling RNG is process-wide: one seeded generate at a time
        if warmup:
            self.warmup()

    @classmethod
    def from_pretrained(
        cls, target: str | None = None, drafter: str | None = None, dtype: str = "fp32", device: str | None = None,
        device_map: Any = None, **kwargs: Any
    ) -> "DemoEngine":
        """Load a target/drafter pair (Hub ids or folders; ``None``: the embedded default) with ``load_pair``, on
        ``device`` or placed by ``device_map`` (default: the CPU)."""
        from ..loading import load_pair

        try:
            model, tokenizer, draft_model = load_pair(target, drafter, dtype, device=device, device_map=device_map)
        except Exception as exc:  # noqa: BLE001 - every loading failure becomes one readable line
            raise DemoError(f"could not load target={target or 'default'} drafter={drafter or 'default'}: "
                            f"{type(exc).__name__}: {exc}") from exc
        from ..defaults import DEFAULT_TARGET_HUB_ID

        return cls(model, tokenizer, draft_model, drafter_source=drafter or "the default drafter",
                   target_source=target or f"{DEFAULT_TARGET_HUB_ID} (embedded default)", **kwargs)

    def describe_drafter(self) -> str:
        views = self.drafters
        cfg = views.backbone.config
        return f"{views.source} (block size {cfg.block_size}, ReTrace module: {cfg.retrace})"

    # --- requests ------------------------------------------------------------------------------------------------
    def validate(self, prompt: Any, method: Any, temperature: Any, max_new_tokens: Any, seed: Any) -> tuple:
        """Normalised ``(prompt, method, temperature, max_new_tokens, seed)``, or a DemoError saying what is wrong."""
        return self.limits.validate(prompt, method, temperature, max_new_tokens, seed)

    def drafter_for(self, path: str | None) -> DrafterViews:
        """The startup drafter, or (``path`` given) a local drafter folder loaded once and kept (at most two)."""
        if path is None or not str(path).strip():
            return self.drafters
        if not self.allow_custom_drafters:
            raise DemoError("this server does not load other drafters (it is shared or listens beyond localhost); "
                            "leave the drafter folder empty. Whoever runs the server can allow it with "
                            "--allow-custom-drafters (launch(..., allow_custom_drafters=True)).")
        return self._folders.get(path)

    def input_ids(self, prompt: str) -> torch.Tensor:
        ids = chat_input_ids(self.tokenizer, prompt)
        if ids.shape[1] > self.limits.max_prompt_tokens:
            raise DemoError(f"the prompt is {ids.shape[1]} tokens long; the limit is {self.limits.max_prompt_tokens}.")
        return ids

    def _check_context(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        try:  # the library's rule (checks.check_context); the page also counts the new tokens
            check_context(self.target, input_ids.shape[1], max_new_tokens)
        except ValueError as error:
            raise DemoError(str(error)) from None

    def stream(
        self,
        prompt: str,
        method: str = "retrace",
        temperature: float = 0.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        drafter_path: str | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Snapshot]:
        """Answer ``prompt`` with plain decoding, then with ``method``; yield a :class:`Snapshot` as rounds arrive.

        Everything this call touches beyond the shared (read-only) models is its own: the worker threads, the queues,
        the streamers, the stats. Closing the iterator stops the running ``generate`` at its next round.
        """
        prompt, method, temperature, max_new_tokens, seed = self.validate(
            prompt, method, temperature, max_new_tokens, seed
        )
        views = self.drafter_for(drafter_path)
        drafter = views.for_method(method) if method != "plain" else None
        input_ids = self.input_ids(prompt)
        self._check_context(input_ids, max_new_tokens)
        cancel = cancel or threading.Event()
        snap = self._first_snapshot(method, temperature, drafter is not None, views)
        sides = [(snap.plain, None)] + ([(snap.drafted, drafter)] if drafter is not None else [])
        sampled = temperature > 0
        try:
            yield snap
            for side, model in sides:
                worker = GenerateWorker(
                    self.target, input_ids, sampling_kwargs(temperature, max_new_tokens), model,
                    seed=seed if sampled else None, sampling_lock=self._sampling_lock if sampled else None,
                    cancel=cancel, name=f"hf-retrace-demo-{side.method}",
                )
                yield from self._run_side(snap, side, worker)
            snap.done = True
            snap.status = final_status(snap)
            yield snap
        finally:
            cancel.set()  # stops a generate still running if the consumer went away

    def _first_snapshot(self, method: str, temperature: float, drafted: bool, views: DrafterViews) -> Snapshot:
        plain = SideState("plain", "Plain decoding", self.tokenizer)
        side = SideState(method, METHODS[method], self.tokenizer) if drafted else None
        snap = Snapshot(plain, side, "Plain decoding…", temperature=temperature)
        if method == "retrace" and views.retrace_state == "untrained":
            snap.notes.append("This drafter's ReTrace module is untrained (zero output): its drafts equal the "
                              "backbone's; fused rounds are still marked.")
        if temperature > 0:
            snap.notes.append("Sampling: both sides draw from the same distribution, so their texts differ; the "
                              "seed makes each side repeatable.")
        return snap

    def _run_side(self, snap: Snapshot, side: SideState, worker: GenerateWorker) -> Iterator[Snapshot]:
        """Fold ``worker``'s rounds into ``side``, yielding ``snap`` every ``update_interval``, also while no round
        arrives, so a server drops a request whose client went away within one interval, not at the next round."""
        worker.start()
        try:
            while True:
                for event in worker.wait(self.update_interval):
                    if isinstance(event, Finished):
                        if event.error is not None:
                            raise _side_error(side, event.error)
                        side.finish(event.seconds, event.stats)
                        return
                    side.add_round(event)
                waiting = " (waiting for another sampled request to finish)" if worker.waiting else ""
                snap.status = f"{side.title}…{waiting}"
                yield snap
        finally:
            if not side.done:  # the request is closing: never joined, that would hold up the server for a round
                worker.stop()

    def warmup(self) -> None:
        """A few short generate calls so the first request's timings do not include kernel set-up."""
        ids = chat_input_ids(self.tokenizer, "Hi")
        kwargs = sampling_kwargs(0.0, 3)
        with torch.inference_mode():
            for drafter in (None, self.drafters.backbone, self.drafters.retrace or self.drafters.backbone):
                extra = {"assistant_model": drafter} if drafter is not None else {}
                ids_dev = ids.to(self.target.device)
                self.target.generate(ids_dev, attention_mask=torch.ones_like(ids_dev), **kwargs, **extra)


def _side_error(side: SideState, exc: BaseException) -> DemoError:
    """The message a request gets when its ``generate`` raised: what failed, and that the server is still up."""
    if isinstance(exc, DemoError):
        return exc
    error = DemoError(f"{side.title} failed inside generate ({type(exc).__name__}: {exc}). The server keeps serving: "
                      "try again; if it fails again, the server's log has the traceback.")
    error.__cause__ = exc
    return error
