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
import transformers
from packaging import version
from transformers import GenerationMixin
from transformers.generation import SynthIDTextWatermarkingConfig
from transformers.generation.configuration_utils import GenerationMode

from ..configuration import drafter_target_mismatches
from ..stats import GenerationStats, last_stats_slot
from .candidate_generator import ReTraceCandidateGenerator
from .placement import place_drafter
from .policy import CallObserver, PolicyResolver, RoundPolicy, resolve_policy
from .stopping import PerTokenStopping, StopAwareStreamer

_WRAPPED = "_hf_retrace_wrapped"  # on our hooks: the method each wraps
_DISPATCH = "_hf_retrace_dispatch"  # on our hooks: the Dispatch each consults
_OURS: set[int] = set()  # ids of our own hooks (functools.wraps copies the marker, never the identity)


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


def check_inputs(target: Any, input_ids: Any, model_kwargs: dict | None = None) -> None:
    """Raise a ValueError saying what to do for a prompt a drafter cannot take: before the target runs a forward and
    before first-use tuning (no check here needs the machine's costs). The one place for every input rule of a call
    with a drafter: its shape and batch, prompts given as embeddings, empty prompts, ids outside the vocabulary, the
    target's context, pre-filled caches and padded masks.

    Example: ``check_inputs(target, input_ids, {"attention_mask": mask})``.
    """
    model_kwargs = model_kwargs or {}
    _check_prompt_tensor(input_ids, model_kwargs.get("inputs_embeds"))
    _check_token_ids(target, input_ids)
    check_context(target, input_ids.shape[1])
    _check_prompt_kwargs(input_ids, model_kwargs)


def _check_prompt_tensor(input_ids: Any, embeds: Any) -> None:
    """The prompt's shape, batch and dtype, and embeddings that describe it (:func:`check_inputs`)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [1, prompt tokens], got shape {list(input_ids.shape)}. "
                         "Pass input_ids[None] for a 1-D prompt.")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"hf_retrace speculative decoding runs one sequence at a time, got a batch of {input_ids.shape[0]}. "
            "Call generate once per prompt (transformers' assisted loop supports batch size 1 only)."
        )
    if embeds is not None and input_ids.shape[1] == 0 and embeds.shape[1] > 0:
        raise ValueError(
            f"inputs_embeds without input_ids ({embeds.shape[1]} embedded positions): the drafter drafts from the "
            "committed token ids and their positions, which generate does not have for a prompt given as embeddings "
            "only. Pass the prompt's token ids as input_ids instead (for embeddings of token ids, input_ids alone "
            "gives the same output), or input_ids together with inputs_embeds, one id per embedded position (the "
            "target reads the embeddings), or drop `assistant_model`."
        )
    if embeds is not None and embeds.shape[1] != input_ids.shape[1]:
        raise ValueError(
            f"inputs_embeds covers {embeds.shape[1]} positions but input_ids {input_ids.shape[1]}: with a drafter both "
            "describe the same prompt, one token id per embedded position. Pass input_ids of the embeddings' length, "
            "or input_ids alone."
        )
    if input_ids.shape[1] == 0:
        raise ValueError(
            "The prompt is empty (input_ids of shape [1, 0]): the target needs at least one token to continue from. "
            "Pass at least one token, e.g. the tokenizer's BOS token or the chat template rendered with "
            "add_generation_prompt=True."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold token ids (an integer tensor), got {input_ids.dtype}. Pass the "
                         "tokenizer's ids (e.g. .long()), or the embeddings as inputs_embeds with their ids.")


def _check_token_ids(target: Any, input_ids: Any) -> None:
    """Every id inside the target's vocabulary (:func:`check_inputs`)."""
    embeddings = target.get_input_embeddings()
    vocab = getattr(getattr(embeddings, "weight", None), "shape", (None,))[0]
    if vocab:
        low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read of the prompt for both ends
        if low < 0 or high >= vocab:
            raise ValueError(
                f"input_ids holds token id {low if low < 0 else high}, outside the target's vocabulary (ids "
                f"0..{vocab - 1}): the prompt was tokenized for another model, or is not token ids. Tokenize it with "
                "the target's tokenizer."
            )


def _check_prompt_kwargs(input_ids: Any, model_kwargs: dict) -> None:
    """The cache, mask, positions and embeddings given with the prompt (:func:`check_inputs`)."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise ValueError(
            "generate was given a pre-filled cache: the drafter has no target hidden states for the cached prefix. "
            "Pass the full prompt without `past_key_values`."
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)} but input_ids "
                         f"{list(input_ids.shape)}: pass this prompt's mask, or none (a prompt of one sequence needs "
                         "no mask).")
    positions = model_kwargs.get("position_ids")  # 5.x builds them from the mask, then drops a mask of ones
    if positions is not None and positions.shape[-1] != input_ids.shape[1]:
        raise ValueError(f"position_ids cover {positions.shape[-1]} positions but the prompt has {input_ids.shape[1]} "
                         "tokens: they (or the attention_mask generate builds them from) belong to another prompt. "
                         "Pass this prompt's attention_mask and position_ids, or neither.")
    for name in ("inputs_embeds", "position_ids"):
        if model_kwargs.get(name) is not None and _loop_indexes_attentions():
            raise ValueError(
                f"{name} with a drafter needs transformers 5 or newer (this is {transformers.__version__}, whose "
                f"assisted loop does not continue from a prompt given with {name} as plain generate does). Pass "
                "input_ids (and its attention_mask) alone, upgrade transformers, or drop `assistant_model`."
            )
    if attention_mask is not None and not bool(attention_mask.all()):
        masked = int((attention_mask == 0).sum())
        raise ValueError(
            f"The prompt's attention_mask has padding ({masked} of {input_ids.shape[1]} positions masked): the "
            "drafter's positions follow the unpadded prompt. Pass the unpadded prompt (batch size 1 needs no "
            "padding): input_ids[:, attention_mask[0].bool()], without the mask."
        )


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


def _loop_indexes_attentions() -> bool:
    """Whether transformers' assisted loop reads ``outputs.attentions[0]`` unguarded (4.x; 5.x checks it)."""
    return version.parse(transformers.__version__).release < (5,)


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
        return type(self.target)._sample(self.target, **arguments, **model_kwargs)

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
