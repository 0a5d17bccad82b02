"""The drafter's transformer layers: Qwen3-style attention whose keys and values are ``[context ; block]`` (the
target's fused hidden states, then the block's own slots; non-causal over the block), the gated MLP, RMS norms and the
rotary embedding. :class:`~hf_retrace.modeling.ReTraceDrafter` stacks them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .configuration import ReTraceConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Plain (neox-layout) RoPE at absolute positions, shared by context keys and block queries/keys."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # no buffer: loading on the meta device would leave a non-persistent buffer uninitialised
        self.head_dim, self.theta = head_dim, theta
        self._inv_freq: torch.Tensor | None = None

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        work = torch.promote_types(dtype, torch.float32)
        if self._inv_freq is None or self._inv_freq.device != position_ids.device or self._inv_freq.dtype != work:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=position_ids.device) / self.head_dim
            self._inv_freq = (1.0 / self.theta**exponent).to(work)
        freqs = position_ids[..., None].to(work) * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class DrafterAttention(nn.Module):
    """Block queries attend to ``[context ; block]`` keys/values; context K/V come from the same projections."""

    def __init__(self, config: ReTraceConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Any | None,
    ) -> torch.Tensor:
        bsz, q_len, _ = hidden_states.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_input = torch.cat([context, hidden_states], dim=1)
        k = self.k_norm(self.k_proj(kv_input).view(bsz, ctx_len + q_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_input).view(bsz, ctx_len + q_len, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        # cos/sin cover [new context ; block]; the queries take the block part
        q = q * cos[:, None, -q_len:] + rotate_half(q) * sin[:, None, -q_len:]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.sliding_window is not None and attention_mask is None:
            attention_mask = sliding_window_mask(q_len, k.shape[2], self.sliding_window, q.device)
        # grouped K/V heads are shared inside SDPA (no repeat_interleave copy of the cache every round)
        gqa = self.num_kv_heads != self.num_heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


def sliding_window_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal windowed mask for sliding layers (queries are the last ``q_len`` of the ``kv_len`` positions)."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return (k_pos <= q_pos) & (q_pos - k_pos < window)


class DrafterMLP(nn.Module):
    def __init__(self, config: ReTraceConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm block; the context enters each layer's attention un-normed (no input_layernorm on it)."""

    def __init__(self, config: ReTraceConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        self.mlp = DrafterMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, cos, sin, attention_mask, past_key_values) -> torch.Tensor:
        attn_out = self.self_attn(
            self.input_layernorm(hidden_states), context, cos, sin, attention_mask, past_key_values
        )
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
