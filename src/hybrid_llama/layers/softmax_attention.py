"""``SoftmaxLlamaAttention``: the attention of a hybrid model's layers that stay softmax.

It is ``LlamaAttention`` with the same weights and parameter names and two changes for inference:

- its KV cache slot is an ``AppendKVCacheLayer`` (keys written into a buffer with headroom instead of
  concatenated each step);
- a one-token step over a long cache runs the native ``softmax_decode`` kernel, whose threads share
  each KV head's keys (such a cache streams from memory faster than through SDPA's CPU kernel).

Everything else (prompts, training, masks, another attention implementation, output_attentions,
tensors the kernel does not cover) is ``LlamaAttention.forward`` itself. :func:`as_softmax_layers`
converts modules in place by swapping their class (as ``torch.nn.utils.parametrize`` does), so the
model's parameters, hooks and adapters stay where they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from hybrid_llama.ops import native
from hybrid_llama.ops.softmax_decode import MAX_GROUP, softmax_decode

from .append_kv_cache import AppendKVCacheLayer, append_kv_cache_layer


def rotary_qkv(attn: LlamaAttention, hidden_states: Tensor,
               position_embeddings: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[B, H, T, D]`` and k, v ``[B, H_kv, T, D]`` of a Llama attention layer's input, RoPE applied to
    q and k; k and v stay at the KV heads."""
    hidden_shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = attn.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


# Contexts from which a step runs natively. Below it the cache stays in the CPU's caches between steps
# and SDPA computes the step faster than the kernel (docs/performance.md); the kernel's gain is streaming
# a cache that memory has to deliver.
NATIVE_FROM_KEYS = 1024


class SoftmaxLlamaAttention(LlamaAttention):
    """``LlamaAttention`` whose KV cache is appended in place and whose one-token steps run natively."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        # transformers >= 5.2x passes the cache as `cache`, earlier 5.x as `past_key_values`.
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        if cache is not None:
            append_kv_cache_layer(cache, self.layer_idx)
        if not self._decodes_natively(hidden_states, cache, args, kwargs):
            return super().forward(hidden_states, *args, **kwargs)
        q, k, v = rotary_qkv(self, hidden_states, kwargs["position_embeddings"])
        keys, values = cache.update(k, v, self.layer_idx)
        out = softmax_decode(q, keys, values, self.scaling)
        if out is None:  # a cache the kernel does not read: SDPA, as LlamaAttention would call it
            out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](self, q, keys, values, None, dropout=0.0, scaling=self.scaling)
        else:
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    def _decodes_natively(self, hidden_states: Tensor, cache: Cache | None, args: tuple, kwargs: dict) -> bool:
        """A one-token inference step without a mask, under SDPA, over this layer's in-place cache of at
        least NATIVE_FROM_KEYS keys, on CPU fp32 tensors whose heads the kernel covers."""
        return (
            not args and cache is not None and hidden_states.dim() == 3 and hidden_states.shape[1] == 1
            and kwargs.get("attention_mask") is None and kwargs.get("position_embeddings") is not None
            and not kwargs.get("output_attentions") and not torch.is_grad_enabled()
            and self.config._attn_implementation == "sdpa"
            and hidden_states.is_cpu and hidden_states.dtype == torch.float32
            and self.head_dim % 16 == 0 and self.head_dim <= native.MAX_D and self.num_key_value_groups <= MAX_GROUP
            and _cached_keys(cache, self.layer_idx) + 1 >= NATIVE_FROM_KEYS
            and native.enabled() and native.load() is not None
        )


def _cached_keys(cache: Cache, layer_idx: int) -> int:
    """Keys in the layer's in-place cache slot; 0 where the slot is another kind."""
    layers = getattr(cache, "layers", None)
    slot = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    return slot.get_seq_length() if isinstance(slot, AppendKVCacheLayer) else 0


def as_softmax_layers(attention_modules: list[nn.Module]) -> None:
    """Make each plain ``LlamaAttention`` in ``attention_modules`` a :class:`SoftmaxLlamaAttention`, in
    place; modules of any other class (already converted, hybrid) are left as they are."""
    for module in attention_modules:
        if type(module) is LlamaAttention:
            module.__class__ = SoftmaxLlamaAttention
