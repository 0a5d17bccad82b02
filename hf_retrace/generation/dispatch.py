"""The narrow hook into transformers' ``generate``: hf_retrace drafters get our candidate generator.

``install()`` (run at ``import hf_retrace``) wraps two ``GenerationMixin`` methods once, chaining to whatever was
there; both divert only when ``assistant_model`` is an hf_retrace drafter, so every other assistant keeps stock
behaviour. Users who refuse a global patch set ``HF_RETRACE_NO_GLOBAL_PATCH=1`` and call ``attach(target)``.
"""

from __future__ import annotations

import inspect
import os
import threading
import types
from typing import Any

from transformers import GenerationMixin
from transformers.generation import SynthIDTextWatermarkingConfig
from transformers.generation.configuration_utils import GenerationMode

from ..configuration import drafter_target_mismatches
from ..stats import GenerationStats, last_stats_slot
from .candidate_generator import ReTraceCandidateGenerator
from .placement import place_drafter
from .policy import RoundPolicy, resolve_policy
from .stopping import PerTokenStopping, StopAwareStreamer

_WRAPPED = "_hf_retrace_wrapped"
_OURS: set[int] = set()
_CALLS = threading.local()  # per thread: a stack of the generators built inside each running assisted loop  # ids of our own wrapper functions (functools.wraps copies the marker, never the identity)


def is_drafter(assistant_model: Any) -> bool:
    return getattr(type(assistant_model), "_hf_retrace_drafter", False) is True


def check_target(drafter: Any, target: Any) -> None:
    """Raise a ValueError saying what to do when ``drafter`` cannot draft for ``target``; put the drafter on the device
    of the target's input embeddings (:func:`~.placement.place_drafter`)."""
    name = getattr(target.config, "_name_or_path", "") or type(target).__name__
    if target.get_input_embeddings() is None or target.get_output_embeddings() is None:
        raise ValueError(f"The target {name} must expose input embeddings and an lm_head for the drafter to borrow.")
    problems = drafter_target_mismatches(drafter.config, target.config)
    if problems:
        raise ValueError(
            f"The drafter does not fit the target {name}: " + "; ".join(problems) + ". A DFlash drafter borrows the "
            "target's embeddings, lm_head and hidden states, so it only works with the target (family) it was "
            "trained for: load the drafter trained for this target."
        )
    place_drafter(drafter, target)


# generate settings that choose another drafting method; with an hf_retrace drafter they would be silently ignored
_OTHER_SPECULATION = ("prompt_lookup_num_tokens", "assistant_early_exit", "speculation_type", "use_mtp")


def _refusals(generation_config: Any) -> list[str]:
    """What in this call's settings would make the output differ from plain ``generate``, one sentence each.

    transformers runs the logits processors on every drafted prefix (the target's verification, and our argmax or
    sampled proposals): a processor is lossless only when it is a function of the prefix it is given. The audit of
    every processor ``generate`` builds from its settings, with a test of each verdict, is
    ``tests/test_processor_audit.py``; the two stateful ones are refused here.
    """
    config, problems = generation_config, []
    guidance = getattr(config, "guidance_scale", None)
    if guidance is not None and guidance != 1:
        problems.append(
            f"guidance_scale={guidance}: classifier-free guidance runs its own unconditional forward, with a cache "
            "that advances each time its logits processor runs; on drafted tokens it would advance for tokens the "
            "target then rejects, and the output would differ from plain generate. Drop guidance_scale"
        )
    watermark = getattr(config, "watermarking_config", None)
    if isinstance(watermark, SynthIDTextWatermarkingConfig):
        problems.append(
            "watermarking_config is a SynthIDTextWatermarkingConfig: its logits processor keeps a state (the last "
            "n-gram context and the contexts already watermarked) that advances each time it runs; on drafted tokens "
            "it would advance for tokens the target then rejects, and the output would differ from plain generate. "
            "Drop the SynthID watermark (WatermarkingConfig, which reseeds from the context on every call, is "
            "supported)"
        )
    if getattr(config, "use_cache", True) is False:
        problems.append(
            "use_cache=False: speculative decoding verifies each drafted block against the target's KV cache and "
            "rolls it back to the accepted prefix. Drop use_cache=False (the output is the same with the cache)"
        )
    if getattr(config, "dola_layers", None) is not None:
        problems.append(
            f"dola_layers={config.dola_layers!r}: DoLa decoding contrasts the target's layers in its own loop, which "
            "transformers skips when an assistant is given, so the setting would be silently ignored. Drop dola_layers"
        )
    ensemble = getattr(config, "assistant_ensemble_weight", None)
    if ensemble is not None:
        problems.append(
            f"assistant_ensemble_weight={ensemble}: ensemble verification accepts drafts from a mix of the target's "
            "and the drafter's laws, so the output no longer follows the target (and with argmax proposals it is "
            "ignored). hf_retrace is lossless; drop assistant_ensemble_weight"
        )
    return problems


def check_generation_mode(generation_mode: Any, generation_config: Any) -> None:
    """Raise a ValueError, before the target runs, for a call whose output with the drafter would differ from plain
    ``generate`` or that would silently ignore the drafter."""
    if generation_mode != GenerationMode.ASSISTED_GENERATION:
        raise ValueError(
            f"hf_retrace drafters speed up greedy decoding and sampling only, but this call asks for {generation_mode} "
            f"(num_beams={generation_config.num_beams}); transformers would silently ignore the drafter. Use "
            "num_beams=1, or drop `assistant_model` for beam search."
        )
    others = {name: getattr(generation_config, name, None) for name in _OTHER_SPECULATION}
    others = {name: value for name, value in others.items() if value not in (None, False)}
    if others:
        settings = ", ".join(f"{name}={value!r}" for name, value in others.items())
        raise ValueError(
            f"This call passes an hf_retrace drafter together with another speculation setting ({settings}); only one "
            "can draft. Drop that setting to use the drafter, or drop `assistant_model` to use it. (For the drafter "
            "plus context lookup in one generator, pass `drafter.with_policy(lookup=True)`.)"
        )
    problems = _refusals(generation_config)
    if problems:
        raise ValueError("; ".join(problems) + ", or drop `assistant_model`.")
    if generation_config.num_return_sequences > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences}: speculative decoding produces one "
            "sequence per call. Call generate once per sample (with do_sample=True), or drop `assistant_model`."
        )


def check_context(target: Any, prompt_length: int, max_new_tokens: int = 0) -> None:
    """Raise a ValueError, before the target runs, when a prompt of ``prompt_length`` tokens (plus ``max_new_tokens``,
    for a caller that also limits the answer) does not fit the target's context, its ``max_position_embeddings``.

    The one rule for the library (every call with a drafter checks the prompt), ``hf-retrace generate`` and the demo
    (which also counts the new tokens). Targets that declare no context length are not checked.
    Example: ``check_context(target, input_ids.shape[1])``.
    """
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    if not context or prompt_length + max_new_tokens <= context:
        return
    name = getattr(target.config, "_name_or_path", "") or type(target).__name__
    if max_new_tokens:
        asked = f"prompt ({prompt_length} tokens) + {max_new_tokens} new tokens = {prompt_length + max_new_tokens}"
        fix = f"shorten the prompt to at most {max(context - max_new_tokens, 0)} tokens or ask for fewer new tokens"
    else:
        asked, fix = f"prompt of {prompt_length} tokens", f"shorten it to at most {context} tokens"
    raise ValueError(
        f"The {asked} exceeds the context of the target {name}: {context} positions (max_position_embeddings), "
        f"{prompt_length + max_new_tokens - context} too many. Past its context a target's output is not meaningful "
        f"(and the prompt alone would take long to run): {fix}."
    )


def build_candidate_generator(
    target: Any,
    *,
    assistant_model: Any,
    generation_config: Any,
    input_ids: Any,
    logits_processor: Any = None,
    model_kwargs: dict | None = None,
    **unused: Any,
) -> ReTraceCandidateGenerator:
    """Check the call, then build a fresh generator (one per ``generate`` call)."""
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"hf_retrace speculative decoding runs one sequence at a time, got a batch of {input_ids.shape[0]}. "
            "Call generate once per prompt (transformers' assisted loop supports batch size 1 only)."
        )
    check_context(target, input_ids.shape[1])
    model_kwargs = model_kwargs or {}
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError(
            "generate was given a pre-filled cache: the drafter has no target hidden states for the cached prefix. "
            "Pass the full prompt without `past_key_values`."
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("The prompt's attention_mask has padding; pass the unpadded prompt (batch size 1).")
    check_target(assistant_model, target)
    policy = _CALLS.__dict__.pop("policy", None) or resolve_policy(assistant_model, target, generation_config)
    generator = ReTraceCandidateGenerator(
        assistant_model,
        target,
        generation_config,
        logits_processor,
        prompt_length=input_ids.shape[1],
        policy=policy,
    )
    stack = getattr(_CALLS, "stack", None)
    if stack:
        stack[-1].append(generator)  # closed when the assisted loop returns or raises
    else:  # transformers versions that build the generator before entering the assisted loop: adopted there
        _CALLS.__dict__.setdefault("pending", []).append(generator)
    return generator


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _wrap_validate(original):
    def _validate_generation_mode(self, *args, **kwargs):
        mode_kwargs = _arg(args, kwargs, 2, "generation_mode_kwargs") or {}
        drafter = mode_kwargs.get("assistant_model")
        if is_drafter(drafter):
            check_generation_mode(_arg(args, kwargs, 0, "generation_mode"), _arg(args, kwargs, 1, "generation_config"))
            check_target(drafter, self)
        return original(self, *args, **kwargs)

    setattr(_validate_generation_mode, _WRAPPED, original)
    _OURS.add(id(_validate_generation_mode))
    return _validate_generation_mode


def _wrap_get_candidate_generator(original):
    def _get_candidate_generator(self, *args, **kwargs):
        if is_drafter(kwargs.get("assistant_model")):
            return build_candidate_generator(self, **kwargs)
        return original(self, *args, **kwargs)

    setattr(_get_candidate_generator, _WRAPPED, original)
    _OURS.add(id(_get_candidate_generator))
    return _get_candidate_generator


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


def _call_policy(original, self, args: tuple, kwargs: dict, pending: list) -> RoundPolicy | None:
    """The round policy of this assisted call (None when the assistant is not an hf_retrace drafter)."""
    if pending:  # built before the loop (transformers 4.57): the generator resolved it
        return pending[0].policy
    drafter = kwargs.get("assistant_model")
    if not is_drafter(drafter):
        return None
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    return resolve_policy(drafter, self, bound.arguments.get("generation_config"))


def _decode_plainly(self, original, args: tuple, kwargs: dict, policy: RoundPolicy):
    """The call as plain ``generate`` runs it (``_sample``: greedy or sampling), no drafter forward; the drafter's
    ``last_stats`` says which policy decided so, and why."""
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    drafter = arguments.pop("assistant_model", None)
    for name in ("inputs_tensor", "assistant_tokenizer", "tokenizer"):
        arguments.pop(name, None)
    model_kwargs = arguments.pop("model_kwargs", {})
    if drafter is not None:
        last_stats_slot(drafter).set(GenerationStats(policy=policy.describe()))
    return type(self)._sample(self, **arguments, **model_kwargs)


def _wrap_assisted_decoding(original):
    def _assisted_decoding(self, *args, **kwargs):
        stack = _CALLS.__dict__.setdefault("stack", [])
        pending = _CALLS.__dict__.pop("pending", [])
        stack.append(pending)
        stopping = None
        try:
            policy = _call_policy(original, self, args, kwargs, pending)
            if policy is not None and not policy.speculate:
                return _decode_plainly(self, original, args, kwargs, policy)
            if policy is not None:  # our call: stop where plain decoding stops
                _CALLS.policy = policy  # the generator built inside the loop (5.x) takes it
                args, kwargs, stopping = _stop_per_token(original, self, args, kwargs, pending)
            output = original(self, *args, **kwargs)
            return output if stopping is None else stopping.trim(output)
        finally:  # every exit path: the target's layers never keep our hooks after the call
            _CALLS.__dict__.pop("policy", None)
            for generator in stack.pop():
                generator.close()

    setattr(_assisted_decoding, _WRAPPED, original)
    _OURS.add(id(_assisted_decoding))
    return _assisted_decoding


_HOOKED = {
    "_validate_generation_mode": _wrap_validate,
    "_get_candidate_generator": _wrap_get_candidate_generator,
    "_assisted_decoding": _wrap_assisted_decoding,
}


def install() -> bool:
    """Install the global, idempotent dispatch; returns False when disabled by ``HF_RETRACE_NO_GLOBAL_PATCH=1``."""
    if os.environ.get("HF_RETRACE_NO_GLOBAL_PATCH", "") not in ("", "0"):
        return False
    for name, wrap in _HOOKED.items():
        current = getattr(GenerationMixin, name, None)
        if current is None and name == "_assisted_decoding":
            continue  # optional: only closes hooks early; the generator's finalizer still removes them
        if current is None:
            raise RuntimeError(
                f"This transformers version has no GenerationMixin.{name}; hf_retrace cannot hook into generate. "
                "Supported: transformers 4.57.x and 5.x."
            )
        if not hasattr(current, _WRAPPED):
            setattr(GenerationMixin, name, wrap(current))
    return True


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


def attach(model: Any) -> Any:
    """The opt-in, per-model path: only this target instance dispatches hf_retrace drafters. Returns ``model``."""
    for name, wrap in _HOOKED.items():
        if not hasattr(model.__dict__.get(name), _WRAPPED):
            original = getattr(type(model), name, None)
            if original is not None:
                setattr(model, name, types.MethodType(wrap(original), model))
    return model


def detach(model: Any) -> Any:
    """Remove ``attach``'s per-model hooks."""
    for name in _HOOKED:
        if hasattr(model.__dict__.get(name), _WRAPPED):
            delattr(model, name)
    return model
