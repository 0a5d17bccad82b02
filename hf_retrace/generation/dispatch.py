"""The narrow hook into transformers' ``generate``: hf_retrace drafters get our candidate generator.

``install(resolver=..., observer=...)`` (run by ``import hf_retrace`` with the machine's tuned policies) wraps three
``GenerationMixin`` methods once, chaining to whatever was there; each diverts only when ``assistant_model`` is an
hf_retrace drafter, so every other assistant keeps stock behaviour. A call passes through the dispatch once: the mode
check (the first of transformers' steps to see the drafter, before the target runs) opens a :class:`DrafterCall`,
which checks the mode and the drafter/target pair; the assisted loop's hook checks the prompt and resolves the round
policy on it, and runs the call (a batch in our own loop, a plain policy as plain decoding); the generator builder
takes the call's policy. Each rule runs once per call. Users who refuse a global patch set
``HF_RETRACE_NO_GLOBAL_PATCH=1`` and call ``attach(target)``.
"""

from __future__ import annotations

import inspect
import os
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode

from ..machine import onednn_from_width
from ..stats import GenerationStats, last_stats_slot
from .candidate_generator import ReTraceCandidateGenerator
from .checks import _loop_indexes_attentions, check_generation_mode, check_inputs, check_target, is_drafter
from .policy import CallObserver, PolicyResolver, RoundPolicy, resolve_policy
from .stopping import PerTokenStopping, StopAwareStreamer

_WRAPPED = "_hf_retrace_wrapped"  # on our hooks: the method each wraps
_DISPATCH = "_hf_retrace_dispatch"  # on our hooks: the Dispatch each consults
_OURS: set[int] = set()  # ids of our own hooks (functools.wraps copies the marker, never the identity)


def _stop_per_token(original, self, args: tuple, kwargs: dict, generators: list):
    """(args, kwargs, stopping) with the call's stopping criteria checked at every committed token, and its streamer
    held back until each round's check ran (``stopping`` is None when the call has no criteria to wrap)."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    criteria = bound.arguments.get("stopping_criteria")
    input_ids = bound.arguments.get("input_ids")
    if criteria is None or input_ids is None or input_ids.shape[0] != 1:
        return args, kwargs, None
    stopping = PerTokenStopping(criteria, input_ids.shape[1], generators)
    model_kwargs = bound.arguments.get("model_kwargs") or {}
    stopping.cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # cropped with the output
    bound.arguments["stopping_criteria"] = stopping
    if bound.arguments.get("streamer") is not None:
        bound.arguments["streamer"] = StopAwareStreamer(bound.arguments["streamer"], stopping)
    return bound.args[1:], bound.kwargs, stopping


class AttentionsAsPlain:
    """The ``attentions`` of a call with a drafter as plain ``generate`` returns them, one entry per new token.

    transformers' assisted loop splits each verify's weights per token, cut at the token's own position; plain returns
    each forward's weights whole: over a static cache they span the cache's whole length (zeros past the position),
    and where the attention computes no weights (sdpa, flash) plain returns what the forward gave (an empty tuple or
    one ``None`` per layer) while the loop returns nothing. Reads the prefill's output to tell which; idle unless the
    call returns attentions."""

    def __init__(self, target: Any, original: Any, args: tuple, kwargs: dict):
        config = inspect.signature(original).bind(target, *args, **kwargs).arguments.get("generation_config")
        self.prompt_length = _arg(args, kwargs, 0, "input_ids").shape[1]
        self.prefill: tuple | None = None
        wanted = config is not None and config.return_dict_in_generate and config.output_attentions
        # transformers 4.x's assisted loop indexes the verify's attentions, which a weightless attention (sdpa, flash)
        # returns as None: the loop runs without them and each new token gets plain's entry (None)
        self.weightless_4x = bool(wanted) and _loop_indexes_attentions() and not _computes_attention_weights(target)
        if self.weightless_4x:
            config.output_attentions = False
        self.handle = target.register_forward_hook(self._record) if wanted and not self.weightless_4x else None

    def _record(self, module: Any, inputs: Any, output: Any) -> None:
        if self.prefill is None:
            self.prefill = tuple(getattr(output, "attentions", None) or ())

    def apply(self, output: Any) -> Any:
        if self.weightless_4x and hasattr(output, "attentions"):
            output.attentions = tuple(None for _ in range(output.sequences.shape[1] - self.prompt_length))
            return output
        steps = getattr(output, "attentions", None)
        if self.prefill is None or steps is None:
            return output
        if steps == ():  # no weights computed: plain repeats the forward's own (empty or None) attentions
            output.attentions = tuple(self.prefill for _ in range(output.sequences.shape[1] - self.prompt_length))
            return output
        first = next((w for w in self.prefill if w is not None), None)
        width = first.shape[-1] if first is not None and first.shape[-1] > first.shape[-2] else None  # a static cache
        if width is not None:
            output.attentions = tuple(
                tuple(w if w is None or w.shape[-1] >= width else torch.nn.functional.pad(w, (0, width - w.shape[-1]))
                      for w in step) for step in steps)
        return output

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _computes_attention_weights(target: Any) -> bool:
    return getattr(target.config, "_attn_implementation", None) in ("eager", "eager_paged", "flex_attention")


# --- one call: opened once, carried through transformers' steps ----------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """What the hooks consult for every call with an hf_retrace drafter: ``resolver`` picks the round policy of a call
    whose drafter view names none (None: the drafter's shipped policy), ``observer`` hears each drafted call's policy
    and stats (None: nobody). Passed in, never looked up: ``import hf_retrace`` installs the global hooks with the
    policies tuned for this machine (:func:`install`), ``attach(model, resolver=...)`` binds one to a model.

    Example: ``install(resolver=lambda drafter, target, config, **_: RoundPolicy(lookup=True))``.
    """

    resolver: PolicyResolver | None = None
    observer: CallObserver | None = None

    def open_call(self, target: Any, drafter: Any, generation_mode: Any, generation_config: Any) -> DrafterCall:
        """Check the call's mode and the drafter/target pair (before the target runs), then open the call."""
        check_generation_mode(generation_mode, generation_config)
        check_target(drafter, target)
        return DrafterCall(self, target, drafter, generation_config)


@dataclass(eq=False)
class DrafterCall:
    """One ``generate`` call with an hf_retrace drafter, from the first hook that sees it to its end, so that each rule
    runs once: opening checked the mode and the pair (:meth:`Dispatch.open_call`); :meth:`admit` checks the prompt,
    then resolves the round policy (first-use tuning measures for seconds: no refusal waits on it); the generators
    built for the call take that policy from here and are closed with the call."""

    dispatch: Dispatch
    target: Any
    drafter: Any
    generation_config: Any
    policy: RoundPolicy | None = None
    generators: list[ReTraceCandidateGenerator] = field(default_factory=list)
    attentions: AttentionsAsPlain | None = None
    looping: bool = False  # our assisted-loop hook runs the call: it admits, observes and closes it

    def check_prompt(self, input_ids: Any, model_kwargs: dict | None = None) -> None:
        """The input rules for one prompt of this call (:func:`check_inputs`; a batch checks each row)."""
        check_inputs(self.target, input_ids, model_kwargs)

    def resolve(self, rows: int = 1) -> RoundPolicy:
        """The call's round policy, resolved on the first ask with the dispatch's resolver (``rows``: the batch)."""
        if self.policy is None:
            self.policy = resolve_policy(self.drafter, self.target, self.generation_config, rows,
                                         resolver=self.dispatch.resolver)
        return self.policy

    def admit(self, input_ids: Any, model_kwargs: dict | None = None) -> RoundPolicy:
        """Check a prompt of one row, then resolve the policy (both once: a later ask returns the policy)."""
        if self.policy is None:
            self.check_prompt(input_ids, model_kwargs)
        return self.resolve()

    def build_generator(self, input_ids: Any, logits_processor: Any = None,
                        model_kwargs: dict | None = None) -> ReTraceCandidateGenerator:
        """The call's candidate generator (transformers asks once per call), with the call's policy."""
        policy = self.admit(input_ids, model_kwargs)
        generator = ReTraceCandidateGenerator(self.drafter, self.target, self.generation_config, logits_processor,
                                              prompt_length=input_ids.shape[1], policy=policy)
        self.generators.append(generator)
        return generator

    def decode(self, original: Any, args: tuple, kwargs: dict) -> Any:
        """Run the call in place of transformers' ``_assisted_decoding`` (``original``): a batch in our batch loop,
        a plain policy as plain decoding, else transformers' loop stopping where plain stops."""
        from .batched import batch_size_of, batched_assisted_decoding  # batch > 1: our own loop (issue 39)

        if batch_size_of(original, self.target, args, kwargs) > 1:
            return batched_assisted_decoding(self, original, args, kwargs)
        arguments = inspect.signature(original).bind(self.target, *args, **kwargs).arguments
        if not self.admit(arguments["input_ids"], arguments.get("model_kwargs")).speculate:
            return self.decode_plainly(original, args, kwargs)
        args, kwargs, stopping = _stop_per_token(original, self.target, args, kwargs, self.generators)
        self.attentions = AttentionsAsPlain(self.target, original, args, kwargs)
        with self.kernels():
            output = original(self.target, *args, **kwargs)
        output = output if stopping is None else stopping.trim(output)
        if self.dispatch.observer is not None and self.generators:  # a tuned prediction meets the call's timings
            self.dispatch.observer(self.policy, [generator.stats for generator in self.generators])
        return self.attentions.apply(output)

    def decode_plainly(self, original: Any, args: tuple, kwargs: dict) -> Any:
        """The call as plain ``generate`` runs it (``_sample``: greedy or sampling), no drafter forward; the drafter's
        ``last_stats`` says which policy decided so, and why."""
        arguments = dict(inspect.signature(original).bind(self.target, *args, **kwargs).arguments)
        for name in ("self", "assistant_model", "inputs_tensor", "assistant_tokenizer", "tokenizer"):
            arguments.pop(name, None)
        model_kwargs = arguments.pop("model_kwargs", {})
        last_stats_slot(self.drafter).set(GenerationStats(policy=self.policy.describe()))
        with self.kernels():
            return type(self.target)._sample(self.target, **arguments, **model_kwargs)

    def kernels(self) -> Any:
        """A context in which the target's forwards run the kernels the call's policy was priced with: the narrow ones
        without torch's oneDNN where the tuner measured that faster (:func:`~hf_retrace.machine.onednn_from_width`;
        the drafter's are switched by its round, :class:`~.round.Round`)."""
        return onednn_from_width(self.target, self.policy.onednn_from)

    def close(self) -> None:
        """Remove every hook the call put on the target's layers (every exit path of the call)."""
        if self.attentions is not None:
            self.attentions.close()
        for generator in self.generators:
            generator.close()


# transformers runs the mode check, the generator builder and the assisted loop one after another and hands them no
# object of ours in common: the call the first opens is found here by the next ones (per thread, as generate runs).
# It holds the open call and nothing else; everything the call needs travels on the call.
_OPEN = threading.local()


def _open_call(dispatch: Dispatch, target: Any, drafter: Any, generation_mode: Any, config: Any) -> DrafterCall:
    _OPEN.call = call = dispatch.open_call(target, drafter, generation_mode, config)
    return call


def _call_of(dispatch: Dispatch, target: Any, drafter: Any, config: Any) -> DrafterCall | None:
    """The call the mode hook opened for this target, drafter and generation config; else one opened here (a hook
    reached without ours on the mode check: another library's wrapper replaced it, or a direct call). None when the
    assistant is not an hf_retrace drafter."""
    if not is_drafter(drafter):
        return None
    call = getattr(_OPEN, "call", None)
    if call is None or call.target is not target or call.drafter is not drafter or call.generation_config is not config:
        call = _open_call(dispatch, target, drafter, GenerationMode.ASSISTED_GENERATION, config)
    return call


def _release(call: DrafterCall) -> None:
    if getattr(_OPEN, "call", None) is call:
        _OPEN.call = None


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _ours(wrapper: Any, original: Any, dispatch: Dispatch) -> Any:
    """Mark ``wrapper`` as our hook around ``original``, consulting ``dispatch``."""
    setattr(wrapper, _WRAPPED, original)
    setattr(wrapper, _DISPATCH, dispatch)
    _OURS.add(id(wrapper))
    return wrapper


def _wrap_validate(original: Any, dispatch: Dispatch) -> Any:
    def _validate_generation_mode(self, *args, **kwargs):
        drafter = (_arg(args, kwargs, 2, "generation_mode_kwargs") or {}).get("assistant_model")
        _OPEN.call = None  # every generate passes here first: a call that failed before its loop is never found
        if is_drafter(drafter):  # the one entry: the mode refusal (beam search) comes before the target runs
            _open_call(dispatch, self, drafter, _arg(args, kwargs, 0, "generation_mode"),
                       _arg(args, kwargs, 1, "generation_config"))
        return original(self, *args, **kwargs)

    return _ours(_validate_generation_mode, original, dispatch)


def _wrap_get_candidate_generator(original: Any, dispatch: Dispatch) -> Any:
    def _get_candidate_generator(self, *args, **kwargs):
        call = _call_of(dispatch, self, kwargs.get("assistant_model"), kwargs.get("generation_config"))
        if call is None:
            return original(self, *args, **kwargs)
        generator = call.build_generator(kwargs["input_ids"], kwargs.get("logits_processor"), kwargs.get("model_kwargs"))
        if not call.looping:  # no loop hook of ours ends this call (attach(): transformers takes the loop from the
            _release(call)  # class), so the generator's finalizer closes its hooks once transformers drops it
        return generator

    return _ours(_get_candidate_generator, original, dispatch)


def _wrap_assisted_decoding(original: Any, dispatch: Dispatch) -> Any:
    def _assisted_decoding(self, *args, **kwargs):
        call = _call_of(dispatch, self, kwargs.get("assistant_model"), _arg(args, kwargs, 3, "generation_config"))
        if call is None:
            return original(self, *args, **kwargs)
        call.looping = True
        try:
            return call.decode(original, args, kwargs)
        finally:  # every exit path: the target's layers never keep our hooks after the call
            _release(call)
            call.close()

    return _ours(_assisted_decoding, original, dispatch)


_HOOKED = {
    "_validate_generation_mode": _wrap_validate,
    "_get_candidate_generator": _wrap_get_candidate_generator,
    "_assisted_decoding": _wrap_assisted_decoding,
}


def install(resolver: PolicyResolver | None = None, observer: CallObserver | None = None) -> bool:
    """Install the global, idempotent dispatch consulting ``resolver`` and ``observer`` (:class:`Dispatch`); a second
    call replaces them where our hooks are the outermost. Returns False when disabled by
    ``HF_RETRACE_NO_GLOBAL_PATCH=1``. ``import hf_retrace`` calls it with the machine's tuned policies."""
    if os.environ.get("HF_RETRACE_NO_GLOBAL_PATCH", "") not in ("", "0"):
        return False
    dispatch = Dispatch(resolver, observer)
    for name, wrap in _HOOKED.items():
        current = getattr(GenerationMixin, name, None)
        if current is None:
            raise RuntimeError(
                f"This transformers version has no GenerationMixin.{name}; hf_retrace cannot hook into generate. "
                "Supported: transformers 4.57.x and 5.x."
            )
        if id(current) in _OURS:  # ours on top: wrapped again around the same original, with these dependencies
            _OURS.discard(id(current))
            current = getattr(current, _WRAPPED)
        elif hasattr(current, _WRAPPED):  # ours under another library's wrapper (which copied our marker): kept
            continue
        setattr(GenerationMixin, name, wrap(current, dispatch))
    return True


def installed() -> Dispatch | None:
    """The :class:`Dispatch` the global hooks consult (None when none is installed)."""
    return getattr(GenerationMixin.__dict__.get("_validate_generation_mode"), _DISPATCH, None)


def uninstall() -> bool:
    """Undo ``install()``: remove our own wrapper where it is the outermost layer; returns True when all were removed.

    A wrapper another library put on top of ours (even one made with ``functools.wraps``, which copies our marker)
    stays in place, and ours inside it with it: removing ours would remove theirs. A warning says so.
    """
    removed = True
    for name in _HOOKED:
        current = GenerationMixin.__dict__.get(name)
        if current is None or not hasattr(current, _WRAPPED):
            continue
        if id(current) in _OURS:
            setattr(GenerationMixin, name, getattr(current, _WRAPPED))
        else:
            import warnings

            warnings.warn(
                f"GenerationMixin.{name} is wrapped by another library on top of hf_retrace's hook; both stay in "
                "place. Remove that library's wrapper first, then call uninstall() again.",
                stacklevel=2,
            )
            removed = False
    return removed


def attach(model: Any, resolver: PolicyResolver | None = None, observer: CallObserver | None = None) -> Any:
    """The opt-in, per-model path: only this target instance dispatches hf_retrace drafters, consulting ``resolver``
    and ``observer`` (:class:`Dispatch`; ``hf_retrace.attach`` passes the machine's tuned policies). Returns ``model``.

    transformers takes the assisted loop from the model's class, so an attached call runs transformers' loop as it
    is (batch 1 only), with the mode check and our generator."""
    dispatch = Dispatch(resolver, observer)
    for name, wrap in _HOOKED.items():
        if not hasattr(model.__dict__.get(name), _WRAPPED):
            original = getattr(type(model), name, None)
            while id(original) in _OURS:  # under the global hooks: this model's replace them, never run twice
                original = getattr(original, _WRAPPED)
            if original is not None:
                setattr(model, name, types.MethodType(wrap(original, dispatch), model))
    return model


def detach(model: Any) -> Any:
    """Remove ``attach``'s per-model hooks."""
    for name in _HOOKED:
        if hasattr(model.__dict__.get(name), _WRAPPED):
            delattr(model, name)
    return model
