"""Every rule a ``generate`` call with an hf_retrace drafter must pass before the target runs, each in one place: the
drafting mode and settings (:func:`check_generation_mode`), the drafter/target pair (:func:`check_target`), and the
prompt (:func:`check_inputs`: its shape and batch row, ids, the target's context, caches, masks, embeddings).
:mod:`.dispatch` runs them once per call; the command line and the demo call them before loading anything expensive.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from packaging import version
from transformers.generation import SynthIDTextWatermarkingConfig
from transformers.generation.configuration_utils import GenerationMode

from ..configuration import drafter_target_mismatches
from .placement import place_drafter


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


def _loop_indexes_attentions() -> bool:
    """Whether transformers' assisted loop reads ``outputs.attentions[0]`` unguarded (4.x; 5.x checks it)."""
    return version.parse(transformers.__version__).release < (5,)
