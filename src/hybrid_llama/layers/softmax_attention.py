"""``SoftmaxLlamaAttention``: the attention of a hybrid model's layers that stay softmax.

It is ``LlamaAttention`` with the same weights and parameter names and three changes for inference:

- from its first one-token step on, its KV cache slot is an ``AppendKVCacheLayer`` (keys written into a
  buffer with headroom instead of concatenated each step);
- an unmasked one-token step makes the one SDPA call ``LlamaAttention`` would make, without the
  attention-interface dispatch around it;
- such a step over a long cache runs the native ``softmax_decode`` kernel instead, whose threads share
  each KV head's keys (such a cache streams from memory faster than through SDPA's CPU kernel).

Everything else (prompts, training, masks, another attention implementation, output_attentions,
tensors the kernel does not cover) is ``LlamaAttention.forward`` itself. :func:`as_softmax_layers`
converts modules in place by swapping their class (as ``torch.nn.utils.parametrize`` does), so the
model's parameters, hooks and adapters stay where they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from hybrid_llama.ops.native import build as native
from hybrid_llama.ops.native.softmax_decode import MAX_GROUP, softmax_decode

from .append_kv_cache import append_kv_cache_layer


def qkv_heads(attn: LlamaAttention, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[B, H, T, D]`` and k, v ``[B, H_kv, T, D]`` of a Llama attention layer's input, before RoPE;
    k and v stay at the KV heads."""
    hidden_shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = attn.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    return q, k, v


def rotary_qkv(attn: LlamaAttention, hidden_states: Tensor,
               position_embeddings: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`qkv_heads` with RoPE applied to q and k."""
    q, k, v = qkv_heads(attn, hidden_states)
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    return q, k, v


# Contexts from which a step runs natively. Below it the cache stays in the CPU's caches between steps
# and SDPA computes the step faster than the kernel (docs/performance.md); the kernel's gain is streaming
# a cache that memory has to deliver.
NATIVE_FROM_KEYS = 1024


class SoftmaxLlamaAttention(LlamaAttention):
    """``LlamaAttention`` whose KV cache is appended in place and whose one-token steps skip its generic
    dispatch (and run natively over a long cache)."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        # Inside a model this Python runs cold (the weights stream through the CPU's caches), so the
        # test that rules most calls out comes first. A prompt runs LlamaAttention's forward in the slot
        # it finds: the in-place slot first pays at a one-token step, and swapping it in for a prompt
        # cost more than it saved in a short prefill (docs/performance.md).
        if hidden_states.shape[-2] != 1:
            return super().forward(hidden_states, *args, **kwargs)
        # transformers >= 5.2x passes the cache as `cache`, earlier 5.x as `past_key_values`.
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        slot = None if cache is None else append_kv_cache_layer(cache, self.layer_idx)
        if slot is None or not self._steps_leanly(hidden_states, args, kwargs):
            return super().forward(hidden_states, *args, **kwargs)
        q, k, v = rotary_qkv(self, hidden_states, kwargs["position_embeddings"])
        keys, values = cache.update(k, v, self.layer_idx)
        out = None
        if keys.shape[2] >= NATIVE_FROM_KEYS and self._decodes_natively(hidden_states):
            out = softmax_decode(q, keys, values, self.scaling)
        if out is None:
            # The call LlamaAttention's SDPA path makes for one unmasked query, without the generic
            # dispatch around it (inside a model those lines cost about 1 % of a short-context step).
            out = F.scaled_dot_product_attention(q, keys, values, scale=self.scaling,
                                                 enable_gqa=self.num_key_value_groups > 1)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None

    def _steps_leanly(self, hidden_states: Tensor, args: tuple, kwargs: dict) -> bool:
        """A one-token inference step (checked by the caller) without a mask, under SDPA: LlamaAttention
        would make one plain SDPA call, which the lean step makes itself."""
        return (
            not args and hidden_states.dim() == 3
            and kwargs.get("attention_mask") is None and kwargs.get("position_embeddings") is not None
            and not kwargs.get("output_attentions") and not torch.is_grad_enabled() and not self.training
            and self.config._attn_implementation == "sdpa" and self.head_dim <= 256
        )

    def _decodes_natively(self, hidden_states: Tensor) -> bool:
        """The native kernel covers a lean step's CPU fp32 tensors and heads (the caller checked the rest)."""
        return (
            hidden_states.is_cpu and hidden_states.dtype == torch.float32
            and self.head_dim % 16 == 0 and self.head_dim <= native.MAX_D and self.num_key_value_groups <= MAX_GROUP
            and native.enabled() and native.load() is not None
        )


def as_softmax_layers(attention_modules: list[nn.Module]) -> None:
    """Make each plain ``LlamaAttention`` in ``attention_modules`` a :class:`SoftmaxLlamaAttention`, in
    place; modules of any other class (already converted, hybrid) are left as they are."""
    for module in attention_modules:
        if type(module) is LlamaAttention:
            module.__class__ = SoftmaxLlamaAttention
