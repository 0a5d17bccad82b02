"""The target's tapped hidden states: the one tap (:func:`extract_context_feature`, which training uses too) and the
decoder lookup; inside ``generate``, taken from the verification pass itself (never an extra target forward).

Two sources give the same tensors: transformers' ``requires_model_outputs`` protocol (the loop hands the last
verification's outputs to ``get_candidates``), where the installed transformers has it, and forward hooks on the
target's decoder layers where it does not (transformers 4.57).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transformers
from packaging import version
from torch import nn
from transformers import GenerationMixin


def _unwrapped(method: Any) -> Any:
    """``method`` under the wrappers put on it: hf_retrace's own dispatch wrapper (it keeps the original in
    ``_hf_retrace_wrapped``) and ``functools.wraps`` ones (``__wrapped__``)."""
    while True:
        inner = getattr(method, "_hf_retrace_wrapped", None) or getattr(method, "__wrapped__", None)
        if inner is None or inner is method:
            return method
        method = inner


@functools.lru_cache(maxsize=None)
def loop_hands_model_outputs() -> bool:
    """Whether this transformers' assisted loop passes ``model_outputs`` to generators that ask for them."""
    try:  # transformers' own loop, not the wrapper ``import hf_retrace`` put around it
        return "requires_model_outputs" in inspect.getsource(_unwrapped(GenerationMixin._assisted_decoding))
    except (OSError, TypeError):  # source unavailable: fall back to hooks, which always work
        return False


@functools.lru_cache(maxsize=None)
def loop_selects_hidden_state_indices() -> bool:
    """Whether ``output_hidden_states=[i, ...]`` keeps only those layers (5.23+); older versions return every layer."""
    return version.parse(transformers.__version__).release >= (5, 23)


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for a direct call of ``model``: ``cache`` where its ``forward`` takes it (transformers 5.24
    renamed ``past_key_values``, which warns there and goes in 5.40), ``past_key_values`` otherwise (4.57). A wrapper
    that hands attribute access to a model is asked about that model."""
    model_class = type(model) if hasattr(type(model), "forward") else type(model.forward.__self__)
    return {_cache_argument(model_class): cache}


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    parameters = inspect.signature(_unwrapped(model_class.forward)).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def decoder_of(target: nn.Module) -> nn.Module:
    """The target's decoder stack: the module holding ``layers`` and the final ``norm``, whose forward skips the
    ``lm_head`` (the one lookup, for the generation tap, the training features and the ReTrace stage)."""
    return target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    layers = getattr(decoder_of(target), "layers", None)
    if layers is None:
        raise ValueError(
            f"Cannot find the decoder layers of {type(target).__name__} (expected `target.get_decoder().layers`)."
        )
    return layers


def extract_context_feature(hidden_states: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
                            target_layer_ids: Sequence[int]) -> torch.Tensor:
    """``[..., n * H]``: what the drafter reads, ``concat(hidden_states[i + 1] for i in target_layer_ids)``.

    ``hidden_states`` is indexed like transformers' ``output_hidden_states`` (index 0 is the embeddings, ``i + 1`` the
    output of decoder layer ``i``, the last one after the final norm). The reference DFlash's function of the same
    name; the one tap, used by ``generate`` (:class:`TargetTap`), the training features and the ReTrace stage.
    """
    parts = [hidden_states[i + 1] for i in target_layer_ids]
    device = parts[0].device  # a target split over devices: the drafter reads them together
    return torch.cat([part.to(device) for part in parts], dim=-1)


class TargetTap:
    """:func:`extract_context_feature` of the rows of the latest target forward: of its ``hidden_states``, or of
    what forward hooks captured (the last layer after the final norm, as transformers' own ``hidden_states``)."""

    def __init__(self, target: nn.Module, target_layer_ids: list[int], user_wants_hidden_states: bool):
        self.target_layer_ids = list(target_layer_ids)
        self.uses_model_outputs = loop_hands_model_outputs()
        self._hooks: list[Any] = []
        self._captured: dict[int, torch.Tensor] = {}
        if self.uses_model_outputs:
            wanted: Any = [i + 1 for i in self.target_layer_ids]
            if user_wants_hidden_states or not loop_selects_hidden_state_indices():
                wanted = True  # a user's own output_hidden_states=True must still get every layer
            self.model_kwargs_overrides = {"output_hidden_states": wanted}
        else:
            self.model_kwargs_overrides = {}
            self._attach_hooks(target)

    def _attach_hooks(self, target: nn.Module) -> None:
        layers = decoder_layers(target)
        last = len(layers) - 1
        final_norm = getattr(decoder_of(target), "norm", None)
        captured = self._captured
        owner = threading.get_ident()  # the generate call's thread: another thread's forwards are not ours

        def make_hook(layer_id: int):
            def hook(module, args, output):
                if threading.get_ident() != owner:
                    return
                hidden = output[0] if isinstance(output, tuple) else output
                if layer_id == last and final_norm is not None:
                    hidden = final_norm(hidden)
                captured[layer_id + 1] = hidden.detach().clone()  # indexed as hidden_states

            return hook

        for layer_id in self.target_layer_ids:
            self._hooks.append(layers[layer_id].register_forward_hook(make_hook(layer_id)))
        weakref.finalize(self, TargetTap._remove, list(self._hooks))

    @staticmethod
    def _remove(hooks: list[Any]) -> None:
        for handle in hooks:
            handle.remove()

    def close(self) -> None:
        TargetTap._remove(self._hooks)
        self._hooks.clear()

    def has_window(self, model_outputs: Any) -> bool:
        if self.uses_model_outputs:
            return model_outputs is not None and getattr(model_outputs, "hidden_states", None) is not None
        return len(self._captured) == len(set(self.target_layer_ids))  # a layer may be tapped twice

    def window(self, model_outputs: Any) -> torch.Tensor:
        """``[1, W, n * H]``: the tapped states of every row the latest target forward computed."""
        states = model_outputs.hidden_states if self.uses_model_outputs else self._captured
        return extract_context_feature(states, self.target_layer_ids)
