"""The Gradio demo: plain decoding next to DFlash / ReTrace, streamed round by round.

Layers, bottom up:

* :class:`RoundStreamer` — a transformers ``BaseStreamer`` that runs inside the generating thread. transformers
  ``put``\\ s each round's committed tokens *before* the candidate generator records the round, so a speculative round
  is posted one ``put`` later (or at ``end()``), once its ``(accepted, drafted, fused)`` entry is in the live
  :class:`~hf_retrace.GenerationStats` of that thread (``drafter.last_stats`` is per thread).
* :class:`DemoEngine` — one loaded target + tokenizer + drafter, shared by every request and never mutated by one:
  "DFlash backbone" and "ReTrace" are two *views* of the same drafter weights, each with its own config. A request
  runs ``generate`` in a worker thread of its own and reads that thread's rounds from a queue of its own.
* :func:`build_app` — the Gradio page (``gr.Blocks`` + queue); :func:`launch` serves it.
"""

from __future__ import annotations

import copy
import html
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no phoning home from an offline demo

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..generation.dispatch import check_target
from ..side_by_side import chat_input_ids
from ..stats import GenerationStats

__all__ = [
    "METHODS",
    "DemoEngine",
    "DemoError",
    "Limits",
    "RoundInfo",
    "RoundStreamer",
    "SideState",
    "Snapshot",
    "build_app",
    "launch",
    "render_tokens",
]

logger = logging.getLogger("hf_retrace.demo")

METHODS = {
    "plain": "Plain decoding only",
    "dflash": "DFlash backbone (ReTrace off)",
    "retrace": "ReTrace",
}

EXAMPLE_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five fruits and the colour of each.",
]


class DemoError(ValueError):
    """A request (or a start-up argument) the demo refuses; the message is shown to the user as is."""


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 1024
    max_prompt_chars: int = 8000
    max_prompt_tokens: int = 2048
    max_temperature: float = 2.0
    max_seed: int = 2**31 - 1


# --------------------------------------------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class RoundInfo:
    """One committed chunk: ``tokens`` = ``accepted`` accepted drafts, then the one token the target supplied.

    ``drafted == 0`` marks a round without drafts (plain decoding, the prefill, or no room left to draft).
    ``fused``: ReTrace drafted this block with the previous round's rejected suffix fused in.
    """

    tokens: tuple[int, ...]
    accepted: int = 0
    drafted: int = 0
    fused: bool = False
    seconds: float = 0.0  # since the generate call started

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted


@dataclass(frozen=True)
class _Finished:
    seconds: float
    stats: dict | None
    error: BaseException | None = None


class RoundStreamer(BaseStreamer):
    """A streamer for one ``generate`` call that hands complete :class:`RoundInfo` objects to ``sink``.

    Runs in the generating thread. With a drafter, the round info comes from that thread's live
    ``GenerationStats.round_log``: hf_retrace hands a round's tokens to the streamer once the round is verified,
    recorded and checked for stops (:mod:`hf_retrace.generation.stopping`), so each ``put`` is posted at once with the
    newest recorded round, or as a round without drafts (the prefill). Without a drafter every ``put`` is one plain
    token.
    """

    def __init__(self, sink: Callable[[RoundInfo], None], drafter: Any = None, started: float | None = None):
        self._sink = sink
        self._drafter = drafter
        self._started = time.perf_counter() if started is None else started
        self._prompt_seen = False
        self._pending: tuple[tuple[int, ...], float] | None = None
        self._rounds_read = 0

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first echoes the prompt
            self._prompt_seen = True
            return
        tokens = tuple(int(t) for t in value.reshape(-1).tolist())
        now = time.perf_counter() - self._started
        if self._drafter is None:
            for t in tokens:
                self._sink(RoundInfo((t,), seconds=now))
            return
        self._pending = (tokens, now)
        self._post_pending()

    def end(self) -> None:
        self._post_pending()

    def _post_pending(self) -> None:
        if self._pending is None:
            return
        tokens, seconds = self._pending
        self._pending = None
        stats = self._drafter.last_stats  # this thread's stats: the live object of the running generate call
        log = stats.round_log if stats is not None else []
        if len(log) > self._rounds_read:
            accepted, drafted, fused = log[self._rounds_read]
            self._rounds_read += 1
            accepted = min(int(accepted), len(tokens) - 1)
        else:  # the prefill (or a round with no room to draft): the target's token alone
            accepted, drafted, fused = 0, 0, False
        self._sink(RoundInfo(tokens, accepted, int(drafted), bool(fused), seconds))


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class IncrementalDetokenizer:
    """Text of each new token, decoded with a few tokens of left context (multi-byte characters are held back)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""


@dataclass
class SideState:
    """One side of the comparison as the page shows it; owned by one request, filled from its worker's rounds."""

    method: str
    title: str
    tokenizer: Any = field(repr=False, default=None)
    rounds: list[RoundInfo] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pieces: list[list[str]] = field(default_factory=list)  # per round, the text of each of its tokens
    seconds: float = 0.0
    done: bool = False
    stats: dict | None = None
    _detok: IncrementalDetokenizer | None = field(default=None, repr=False)

    def add_round(self, info: RoundInfo) -> None:
        if self._detok is None:
            self._detok = IncrementalDetokenizer(self.tokenizer)
        self.rounds.append(info)
        self.token_ids.extend(info.tokens)
        self.pieces.append([self._detok.add(t) for t in info.tokens])
        self.seconds = max(self.seconds, info.seconds)

    def finish(self, finished: _Finished) -> None:
        if self._detok is not None and self.pieces:
            self.pieces[-1][-1] += self._detok.flush()
        self.seconds, self.stats, self.done = finished.seconds, finished.stats, True

    # --- what the page shows ---
    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True) if self.tokenizer else ""

    @property
    def drafted_rounds(self) -> list[RoundInfo]:
        return [r for r in self.rounds if r.drafted > 0]

    @property
    def tau(self) -> float:
        """Tokens committed per target forward over the drafting rounds (the drafter's tau); 1 for plain decoding."""
        rounds = self.drafted_rounds
        if not rounds:
            return 1.0 if self.rounds else 0.0
        stats = GenerationStats()  # tau is defined once, there
        for r in rounds:
            stats.record_round(r.drafted, r.accepted, r.fused)
        return stats.mean_acceptance_length

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict:
        out = {
            "method": self.method,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "new_tokens": len(self.token_ids),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }
        if self.method != "plain":
            out["tau"] = round(self.tau, 4)
            out["rounds"] = [[r.accepted, r.drafted, r.fused] for r in self.drafted_rounds]
            out["fused_rounds"] = sum(r.fused for r in self.rounds)
            out["target_only_tokens"] = sum(len(r.tokens) for r in self.rounds if r.drafted == 0)
            out["stats"] = self.stats
        return out


@dataclass
class Snapshot:
    """What one update of the page shows: both sides so far, and a one-line status."""

    plain: SideState
    drafted: SideState | None
    status: str
    done: bool = False
    temperature: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool | None:
        if self.drafted is None or not (self.plain.done and self.drafted.done):
            return None
        return self.plain.token_ids == self.drafted.token_ids

    @property
    def speedup(self) -> float | None:
        if self.drafted is None or not self.plain.done or self.drafted.tokens_per_second == 0:
            return None
        plain = self.plain.tokens_per_second
        return self.drafted.tokens_per_second / plain if plain > 0 else None

    def summary(self) -> dict:
        return {
            "temperature": self.temperature,
            "plain": self.plain.summary(),
            "drafted": self.drafted.summary() if self.drafted is not None else None,
            "identical": self.identical,
            "speedup": round(self.speedup, 4) if self.speedup is not None else None,
            "notes": list(self.notes),
        }


# ------------------------------------------------------------------------------------------------------------ engine


def drafter_view(drafter: Any, use_retrace: bool) -> Any:
    """The same drafter (shared weights and modules) with a config of its own where ``use_retrace`` is fixed.

    A shallow copy shares ``_parameters``/``_modules``; only ``config`` is replaced. Nothing is mutated per request.
    """
    view = copy.copy(drafter)
    view.config = copy.deepcopy(drafter.config)
    view.config.use_retrace = use_retrace
    return view


@dataclass(frozen=True)
class DrafterViews:
    source: str
    backbone: Any
    retrace: Any | None  # None: the drafter has no ReTrace module (a plain DFlash checkpoint)
    retrace_trained: bool

    @classmethod
    def of(cls, drafter: Any, source: str) -> "DrafterViews":
        has_retrace = getattr(drafter, "retrace", None) is not None and drafter.config.retrace
        return cls(
            source=source,
            backbone=drafter_view(drafter, False),
            retrace=drafter_view(drafter, True) if has_retrace else None,
            retrace_trained=bool(drafter.config.retrace_trained),
        )

    def for_method(self, method: str) -> Any:
        if method == "dflash":
            return self.backbone
        if self.retrace is None:
            raise DemoError(
                f"the drafter {self.source} has no ReTrace module (a plain DFlash checkpoint): choose "
                f"'{METHODS['dflash']}'."
            )
        return self.retrace


class DemoEngine:
    """One target + tokenizer + drafter, shared read-only by every request; :meth:`stream` serves one request."""

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
        self.allow_custom_drafters = allow_custom_drafters
        self.update_interval = update_interval
        self.target_source = target_source or str(getattr(target.config, "_name_or_path", "") or type(target).__name__)
        try:
            check_target(drafter, target)
        except ValueError as exc:
            raise DemoError(str(exc)) from exc
        self.drafters = DrafterViews.of(drafter.eval(), drafter_source or str(getattr(drafter, "name_or_path", "")))
        self._custom: OrderedDict[str, DrafterViews] = OrderedDict()
        self._custom_lock = threading.Lock()
        self._sampling_lock = threading.Lock()  # torch's sampling RNG is process-wide: one seeded run at a time
        if warmup:
            self.warmup()

    @classmethod
    def from_pretrained(
        cls, target: str | None = None, drafter: str | None = None, dtype: str = "fp32", **kwargs: Any
    ) -> "DemoEngine":
        """Load a target/drafter pair (Hub ids or folders; ``None`` = the embedded default) with ``loading.load_pair``."""
        from ..loading import load_pair

        try:
            model, tokenizer, draft_model = load_pair(target, drafter, dtype)
        except Exception as exc:  # noqa: BLE001 - every loading failure becomes one readable line
            raise DemoError(f"could not load target={target or 'default'} drafter={drafter or 'default'}: "
                            f"{type(exc).__name__}: {exc}") from exc
        from ..defaults import DEFAULT_TARGET_HUB_ID

        return cls(model, tokenizer, draft_model, drafter_source=drafter or "the default drafter",
                   target_source=target or f"{DEFAULT_TARGET_HUB_ID} (embedded default)", **kwargs)

    def describe_drafter(self) -> str:
        views = self.drafters
        cfg = views.backbone.config
        retrace = "none" if views.retrace is None else ("trained" if views.retrace_trained else "untrained")
        return f"{views.source} (block size {cfg.block_size}, ReTrace module: {retrace})"

    # --- requests ------------------------------------------------------------------------------------------------
    def validate(self, prompt: Any, method: Any, temperature: Any, max_new_tokens: Any, seed: Any) -> tuple:
        """Normalised ``(prompt, method, temperature, max_new_tokens, seed)``, or a DemoError saying what is wrong."""
        lim = self.limits
        if not isinstance(prompt, str) or not prompt.strip():
            raise DemoError("the prompt is empty: type a question or an instruction.")
        if len(prompt) > lim.max_prompt_chars:
            raise DemoError(f"the prompt is {len(prompt)} characters long; the limit is {lim.max_prompt_chars}.")
        if method not in METHODS:
            raise DemoError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}.")
        try:
            temperature = float(temperature if temperature is not None else 0.0)
        except (TypeError, ValueError):
            raise DemoError(f"temperature must be a number, got {temperature!r}.") from None
        if not 0.0 <= temperature <= lim.max_temperature:  # also rejects NaN
            raise DemoError(f"temperature must be between 0 and {lim.max_temperature}, got {temperature}.")
        try:
            as_float = float(max_new_tokens)
        except (TypeError, ValueError):
            raise DemoError(f"max new tokens must be a whole number, got {max_new_tokens!r}.") from None
        if not as_float.is_integer() or not 1 <= as_float <= lim.max_new_tokens:
            raise DemoError(f"max new tokens must be a whole number from 1 to {lim.max_new_tokens}, "
                            f"got {max_new_tokens}.")
        try:
            seed_f = float(seed if seed is not None else 0)
        except (TypeError, ValueError):
            raise DemoError(f"the seed must be a whole number, got {seed!r}.") from None
        if not seed_f.is_integer() or not 0 <= seed_f <= lim.max_seed:
            raise DemoError(f"the seed must be a whole number from 0 to {lim.max_seed}, got {seed}.")
        return prompt, method, temperature, int(as_float), int(seed_f)

    def drafter_for(self, path: str | None) -> DrafterViews:
        """The startup drafter, or (``path`` given) a local drafter folder loaded once and kept (at most two)."""
        if path is None or not str(path).strip():
            return self.drafters
        if not self.allow_custom_drafters:
            raise DemoError("this server does not load other drafters (it is shared or listens beyond localhost); "
                            "leave the drafter folder empty.")
        folder = Path(str(path).strip()).expanduser()
        if not folder.is_dir():
            raise DemoError(f"{str(path).strip()!r} is not a folder on the server; give the folder of a drafter "
                            "(config.json + model.safetensors).")
        key = str(folder.resolve())
        with self._custom_lock:
            if key in self._custom:
                self._custom.move_to_end(key)
                return self._custom[key]
            if not (folder / "config.json").is_file():
                raise DemoError(f"{key} is not a drafter folder: it has no config.json.")
            from ..modeling import ReTraceDrafter

            try:
                drafter = ReTraceDrafter.from_pretrained(key, dtype=self.target.dtype, local_files_only=True)
                drafter = drafter.to(self.target.device).eval()
                check_target(drafter, self.target)
            except Exception as exc:  # noqa: BLE001 - a wrong folder is the user's input, not a server failure
                raise DemoError(f"{key} is not a drafter for this target: {exc}") from exc
            views = DrafterViews.of(drafter, key)
            self._custom[key] = views
            while len(self._custom) > 2:
                self._custom.popitem(last=False)
            return views

    def input_ids(self, prompt: str) -> torch.Tensor:
        ids = chat_input_ids(self.tokenizer, prompt)
        if ids.shape[1] > self.limits.max_prompt_tokens:
            raise DemoError(f"the prompt is {ids.shape[1]} tokens long; the limit is {self.limits.max_prompt_tokens}.")
        return ids

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
        limit = getattr(self.target.config.get_text_config(), "max_position_embeddings", None)
        if limit and input_ids.shape[1] + max_new_tokens > limit:
            raise DemoError(f"prompt ({input_ids.shape[1]} tokens) + {max_new_tokens} new tokens exceeds the "
                            f"target's context of {limit} positions.")
        gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
        if temperature > 0:
            gen_kwargs["temperature"] = temperature
        else:
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)

        cancel = cancel or threading.Event()
        plain = SideState("plain", "Plain decoding", self.tokenizer)
        drafted = SideState(method, METHODS[method], self.tokenizer) if drafter is not None else None
        snap = Snapshot(plain, drafted, "Plain decoding…", temperature=temperature)
        if method == "retrace" and not views.retrace_trained:
            snap.notes.append("This drafter's ReTrace module is untrained (zero output): its drafts equal the "
                              "backbone's; fused rounds are still marked.")
        if temperature > 0:
            snap.notes.append("Sampling: both sides draw from the same distribution, so their texts differ; the "
                              "seed makes each side repeatable.")
        lock = self._sampling_lock if temperature > 0 else None
        if lock is not None and not lock.acquire(timeout=600):
            raise DemoError("the server is busy with other sampled requests; try again.")
        try:
            yield snap
            sides = [(plain, None)] + ([(drafted, drafter)] if drafted is not None else [])
            for side, model in sides:
                snap.status = f"{side.title}…"
                for _ in self._run_side(side, input_ids, gen_kwargs, model, seed if temperature > 0 else None, cancel):
                    yield snap
            snap.done = True
            snap.status = _final_status(snap)
            yield snap
        finally:
            cancel.set()  # stops a generate still running if the consumer went away
            if lock is not None:
                lock.release()

    def _run_side(
        self,
        side: SideState,
        input_ids: torch.Tensor,
        gen_kwargs: dict,
        drafter: Any,
        seed: int | None,
        cancel: threading.Event,
    ) -> Iterator[None]:
        events: "queue.Queue[RoundInfo | _Finished]" = queue.Queue()
        target = self.target

        def work() -> None:
            started = time.perf_counter()
            try:
                if seed is not None:
                    torch.manual_seed(seed)
                streamer = RoundStreamer(events.put, drafter, started)
                stop = StoppingCriteriaList([_Cancelled(cancel)])
                kwargs = dict(gen_kwargs, streamer=streamer, stopping_criteria=stop)
                if drafter is not None:
                    kwargs["assistant_model"] = drafter
                ids = input_ids.to(target.device)
                with torch.inference_mode():
                    target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                seconds = time.perf_counter() - started
                stats = drafter.last_stats if drafter is not None else None  # this thread's stats
                summary = None
                if stats is not None:
                    summary = stats.as_dict() | {"round_log": [list(r) for r in stats.round_log]}
                events.put(_Finished(seconds, summary))
            except BaseException as exc:  # noqa: BLE001 - reported to the request, never kills the server
                logger.exception("generate failed")
                events.put(_Finished(time.perf_counter() - started, None, exc))

        thread = threading.Thread(target=work, name=f"hf-retrace-demo-{side.method}", daemon=True)
        thread.start()
        last_yield = time.perf_counter()
        try:
            while True:
                try:
                    event = events.get(timeout=self.update_interval)
                except queue.Empty:
                    continue
                finished = None
                while True:  # drain what arrived meanwhile
                    if isinstance(event, _Finished):
                        finished = event
                        break
                    side.add_round(event)
                    try:
                        event = events.get_nowait()
                    except queue.Empty:
                        break
                if finished is not None:
                    if finished.error is not None:
                        exc = finished.error
                        raise DemoError(f"{side.title} failed: {type(exc).__name__}: {exc}") from exc
                    side.finish(finished)
                    return
                if time.perf_counter() - last_yield >= self.update_interval:
                    last_yield = time.perf_counter()
                    yield
        finally:
            if thread.is_alive():
                cancel.set()
                thread.join(timeout=30)

    def warmup(self) -> None:
        """A few short generate calls so the first request's timings do not include kernel set-up."""
        ids = chat_input_ids(self.tokenizer, "Hi")
        kwargs = dict(max_new_tokens=3, do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            for drafter in (None, self.drafters.backbone, self.drafters.retrace or self.drafters.backbone):
                extra = {"assistant_model": drafter} if drafter is not None else {}
                ids_dev = ids.to(self.target.device)
                self.target.generate(ids_dev, attention_mask=torch.ones_like(ids_dev), **kwargs, **extra)


def _final_status(snap: Snapshot) -> str:
    notes = "".join(f"  \n<small>{html.escape(note)}</small>" for note in snap.notes)
    return _final_line(snap) + notes


def _final_line(snap: Snapshot) -> str:
    if snap.drafted is None:
        return f"Done: {len(snap.plain.token_ids)} tokens at {snap.plain.tokens_per_second:.1f} tokens/s."
    same = snap.identical
    if snap.temperature > 0:
        agree = "sampled: the two texts are independent draws"
    else:
        agree = "identical to plain decoding ✓" if same else "differs from plain decoding ✗"
    speed = f"{snap.speedup:.2f}×" if snap.speedup is not None else "n/a"
    return f"Done: {snap.drafted.title} τ = {snap.drafted.tau:.2f}, speed-up {speed}; {agree}."


# ---------------------------------------------------------------------------------------------------------- rendering

CSS = """
.hfr-tokens { white-space: pre-wrap; word-break: break-word; line-height: 1.9; font-size: 15px;
  min-height: 4em; padding: 10px 12px; border: 1px solid var(--border-color-primary, #ddd); border-radius: 8px; }
.hfr-tokens.hfr-running::after { content: "▌"; opacity: .5; }
.hfr-tokens span { border-radius: 3px; }
.hfr-acc { background: #c6f0c2; }
.hfr-cor { background: #ffd3a1; }
.hfr-bon { background: #c9defc; }
.hfr-tgt { background: #e6e6e6; }
.hfr-round.hfr-fused { border-bottom: 3px solid #9b59d0;
  box-decoration-break: clone; -webkit-box-decoration-break: clone; }
.hfr-nl::after { content: "↵"; opacity: .5; font-size: .85em; }
.hfr-rej::after { content: "✗" attr(data-n); font-size: 10px; vertical-align: super; color: #c0392b;
  margin-left: 1px; }
.hfr-legend { display: flex; flex-wrap: wrap; gap: 6px 14px; font-size: 13px; align-items: center; }
.hfr-legend span.sw { display: inline-block; padding: 0 6px; border-radius: 3px; }
.hfr-metrics { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 8px; }
.hfr-metric { border: 1px solid var(--border-color-primary, #ddd); border-radius: 8px; padding: 6px 10px; }
.hfr-metric b { display: block; font-size: 20px; }
.hfr-metric small { color: var(--body-text-color-subdued, #777); }
.hfr-empty { color: var(--body-text-color-subdued, #888); font-style: italic; }
"""

LEGEND_HTML = (
    '<div class="hfr-legend" id="hfr-legend">'
    '<span><span class="sw hfr-acc">drafted, accepted</span></span>'
    '<span><span class="sw hfr-cor">target\'s correction</span><span class="hfr-rej" data-n="n"></span> '
    "(after n drafts were rejected)</span>"
    '<span><span class="sw hfr-bon">target\'s bonus</span> (whole block accepted)</span>'
    '<span><span class="sw hfr-tgt">target alone</span> (no draft: first token)</span>'
    '<span><span class="hfr-round hfr-fused">ReTrace-fused round</span> (the block reused the kept rejected '
    "suffix of the round before)</span>"
    "</div>"
)


def _kind(info: RoundInfo, index: int) -> str:
    if index < info.accepted:
        return "hfr-acc"
    if info.drafted == 0:
        return "hfr-tgt"
    return "hfr-bon" if info.rejected == 0 else "hfr-cor"


def render_tokens(side: SideState | None, placeholder: str = "") -> str:
    """The answer as HTML; for a drafted side one span per round, coloured per token (see ``LEGEND_HTML``)."""
    if side is None:
        return f'<div class="hfr-tokens"><span class="hfr-empty">{html.escape(placeholder)}</span></div>'
    running = "" if side.done else " hfr-running"
    if side.method == "plain":
        text = "".join(p for pieces in side.pieces for p in pieces)
        return f'<div class="hfr-tokens{running}">{html.escape(text)}</div>'
    parts = [f'<div class="hfr-tokens{running}">']
    for n, (info, pieces) in enumerate(zip(side.rounds, side.pieces), start=1):
        if info.drafted:
            title = f"round {n}: {info.accepted}/{info.drafted} drafts accepted" + (
                ", block fused with the kept rejected suffix" if info.fused else "")
        else:
            title = f"round {n}: target token (no draft)"
        parts.append(f'<span class="hfr-round{" hfr-fused" if info.fused else ""}" title="{html.escape(title)}">')
        marker = f'<span class="hfr-rej" data-n="{info.rejected}"></span>' if info.rejected > 0 else ""
        last = max((i for i, piece in enumerate(pieces) if piece), default=-1)
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            body = piece.rstrip("\n")
            newlines = piece[len(body) :]  # kept outside the coloured span, after the round's rejection marker
            kind = _kind(info, i) + (" hfr-nl" if newlines else "")
            parts.append(f'<span class="{kind}">{html.escape(body)}</span>')
            if i == last:
                parts.append(marker)
            parts.append(newlines)
        if last < 0:
            parts.append(marker)
        parts.append("</span>")
    parts.append("</div>")
    return "".join(parts)


def render_metrics(snap: Snapshot | None) -> str:
    if snap is None:
        return '<div class="hfr-metrics"></div>'

    def card(label: str, value: str, sub: str = "") -> str:
        return f'<div class="hfr-metric"><small>{html.escape(label)}</small><b>{html.escape(value)}</b>' \
               f'<small>{html.escape(sub)}</small></div>'

    p, d = snap.plain, snap.drafted
    cards = [card("plain decoding", f"{p.tokens_per_second:.1f} tok/s",
                  f"{len(p.token_ids)} tokens, {p.seconds:.2f} s")]
    if d is not None:
        cards.append(card(d.title, f"{d.tokens_per_second:.1f} tok/s", f"{len(d.token_ids)} tokens, {d.seconds:.2f} s"))
        rounds = d.drafted_rounds
        cards.append(card("τ (tokens per target forward)", f"{d.tau:.2f}" if rounds else "–",
                          f"{len(rounds)} drafting rounds"))
        cards.append(card("speed-up", f"{snap.speedup:.2f}×" if snap.speedup is not None else "–",
                          "drafted vs plain tokens/s"))
        if d.method == "retrace":
            fused = sum(r.fused for r in d.rounds)
            kept = (d.stats or {}).get("kept_token_commit_rate")
            cards.append(card("ReTrace-fused rounds", f"{fused}/{len(rounds)}" if rounds else "–",
                              f"kept rejected tokens later committed: {kept:.0%}" if kept is not None else ""))
        same = snap.identical
        if same is not None and snap.temperature == 0:
            cards.append(card("same text as plain?", "yes ✓" if same else "no ✗", "greedy: lossless"))
    return '<div class="hfr-metrics" id="hfr-metrics">' + "".join(cards) + "</div>"


def acceptance_frame(snap: Snapshot | None):
    """Per-position acceptance of the finished drafted side as a DataFrame (None when there is nothing to plot)."""
    import pandas as pd

    if snap is None or snap.drafted is None or not snap.drafted.done or not snap.drafted.stats:
        return None
    rates = snap.drafted.stats.get("per_position_acceptance") or []
    if not rates:
        return None
    slots = [str(i) for i in range(1, len(rates) + 1)]  # categories (a numeric x would be a continuous axis)
    return pd.DataFrame({"draft slot": slots, "acceptance rate": [float(r) for r in rates]})


# ---------------------------------------------------------------------------------------------------------------- UI


class _Handler:
    """The page's one event: validate, stream the engine's snapshots as component values, report errors in the page."""

    def __init__(self, engine: DemoEngine):
        self.engine = engine

    def __call__(self, prompt, method, temperature, max_new_tokens, seed, drafter_path):
        import gradio as gr

        stream = None
        try:
            stream = self.engine.stream(prompt, method, temperature, max_new_tokens, seed, drafter_path or None)
            for n, snap in enumerate(stream):
                if n == 0:
                    for note in snap.notes:
                        gr.Info(note)
                yield self._values(snap)
        except DemoError as exc:
            yield self._status_only(f"⚠️ {exc}")
            raise gr.Error(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - one failed request must not look like a crash
            logger.exception("request failed")
            yield self._status_only(f"⚠️ the request failed: {type(exc).__name__}: {exc}")
            raise gr.Error(f"the request failed: {type(exc).__name__}: {exc}") from None
        finally:
            if stream is not None:
                stream.close()

    @staticmethod
    def _values(snap: Snapshot) -> tuple:
        if snap.drafted is None:
            drafted = render_tokens(None, "Plain decoding only: choose DFlash or ReTrace to compare.")
        elif not snap.drafted.rounds and not snap.drafted.done:
            drafted = render_tokens(None, "starts when plain decoding has finished…")
        else:
            drafted = render_tokens(snap.drafted)
        return (
            render_tokens(snap.plain),
            drafted,
            render_metrics(snap),
            _plot_update(acceptance_frame(snap)),
            snap.summary() if snap.done else None,
            snap.status,
        )

    @staticmethod
    def _status_only(message: str) -> tuple:
        import gradio as gr

        return (gr.update(), gr.update(), gr.update(), gr.update(), gr.update(), message)


def _plot_update(frame: Any) -> Any:
    import gradio as gr

    if frame is None:
        return None
    return gr.update(value=frame, sort=list(frame["draft slot"]))  # slot order, not "1, 10, 11, ..., 2"


def _theme():
    import gradio as gr

    system = ["ui-sans-serif", "system-ui", "-apple-system", "Segoe UI", "Roboto", "sans-serif"]
    mono = ["ui-monospace", "SFMono-Regular", "Menlo", "monospace"]
    return gr.themes.Default(font=system, font_mono=mono)  # no web fonts: the page also works offline


def build_app(engine: DemoEngine, concurrency: int = 2, title: str = "hf-retrace: ReTrace live") -> Any:
    """The Gradio page for ``engine``. ``concurrency``: requests generating at once (more wait in the queue)."""
    import warnings

    import gradio as gr

    retrace_ok = engine.drafters.retrace is not None
    choices = [(label, key) for key, label in METHODS.items() if key != "retrace" or retrace_ok]
    with warnings.catch_warnings():  # gradio 6 moved css/theme to launch(); Blocks() still honours them
        warnings.simplefilter("ignore")
        blocks = gr.Blocks(title=title, css=CSS, theme=_theme(), analytics_enabled=False)
    with blocks:
        gr.Markdown(
            f"## {title}\n"
            "Lossless speculative decoding: a DFlash block drafter proposes a block of tokens per round and the target "
            "verifies the block in one forward. With **ReTrace**, the drafts the target rejected are kept and fused "
            "into the next block. Left: plain decoding; right: the chosen method, round by round.\n\n"
            f"<small>target: `{engine.target_source}` · drafter: `{engine.describe_drafter()}` · "
            f"dtype {str(engine.target.dtype).replace('torch.', '')}</small>"
        )
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=3, max_lines=12, elem_id="hfr-prompt",
                                    placeholder="Ask something…", max_length=engine.limits.max_prompt_chars)
            with gr.Column(scale=2):
                method = gr.Radio(choices, value="retrace" if retrace_ok else "dflash", label="Method",
                                  elem_id="hfr-method")
                with gr.Row():
                    temperature = gr.Slider(0.0, engine.limits.max_temperature, value=0.0, step=0.05,
                                            label="Temperature (0 = greedy)", elem_id="hfr-temperature")
                    max_new_tokens = gr.Slider(1, engine.limits.max_new_tokens,
                                               value=min(128, engine.limits.max_new_tokens), step=1,
                                               label="Max new tokens", elem_id="hfr-max-new-tokens")
        with gr.Accordion("More settings", open=False):
            with gr.Row():
                seed = gr.Number(value=0, precision=0, label="Seed (sampling only)", minimum=0,
                                 maximum=engine.limits.max_seed)
                drafter_path = gr.Textbox(
                    label="Drafter folder on the server (empty: the loaded drafter)", elem_id="hfr-drafter",
                    interactive=engine.allow_custom_drafters,
                    placeholder="/path/to/drafter" if engine.allow_custom_drafters else "disabled on shared servers",
                )
        run = gr.Button("Generate side by side", variant="primary", elem_id="hfr-run")
        status = gr.Markdown("Type a prompt and press *Generate*.", elem_id="hfr-status")
        with gr.Row(equal_height=False):
            with gr.Column():
                gr.Markdown("### Plain decoding\n<small>one target forward per token</small>")
                plain_out = gr.HTML(render_tokens(None, "(the answer appears here)"), elem_id="hfr-plain-output")
            with gr.Column():
                gr.Markdown("### Speculative decoding\n<small>one target forward per round</small>")
                gr.HTML(LEGEND_HTML)
                drafted_out = gr.HTML(render_tokens(None, "(the answer appears here)"), elem_id="hfr-drafted-output")
        metrics = gr.HTML(render_metrics(None), elem_id="hfr-metrics-box")
        plot = gr.BarPlot(
            None, x="draft slot", y="acceptance rate", y_lim=[0, 1], height=220, elem_id="hfr-acceptance-plot",
            label="Per-position acceptance (share of rounds whose draft at this slot was accepted)",
            x_title="draft slot", y_title="acceptance rate",
        )
        with gr.Accordion("Details (JSON)", open=False):
            summary = gr.JSON(label="Summary of the last run", elem_id="hfr-summary")
        gr.Examples(EXAMPLE_PROMPTS, inputs=[prompt], label="Examples")

        inputs = [prompt, method, temperature, max_new_tokens, seed, drafter_path]
        outputs = [plain_out, drafted_out, metrics, plot, summary, status]
        handler = _Handler(engine)

        def generate_side_by_side(prompt, method, temperature, max_new_tokens, seed, drafter_path):
            yield from handler(prompt, method, temperature, max_new_tokens, seed, drafter_path)

        gr.on([run.click, prompt.submit], generate_side_by_side, inputs, outputs, api_name="run",
              concurrency_limit=concurrency, show_progress="minimal",
              preprocess=False)  # raw values: validate() names the field in its messages
    blocks.queue(max_size=64, default_concurrency_limit=concurrency)
    return blocks


def launch(app: Any, host: str = "127.0.0.1", port: int | None = 7860, share: bool = False, **kwargs: Any):
    """Serve ``app`` (blocks until stopped unless ``prevent_thread_lock=True``)."""
    kwargs.setdefault("show_error", True)
    kwargs.setdefault("ssr_mode", False)  # SSR needs Node.js and adds nothing here
    return app.launch(server_name=host, server_port=port, share=share, **kwargs)
