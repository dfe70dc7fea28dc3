"""The KV cache slot of a hybrid model's softmax layers: keys and values appended in place.

transformers' ``DynamicLayer`` concatenates its whole key and value tensors with the new token's on
every step, so a decode step at context L copies 2·L·H_kv·D numbers per softmax layer. At 8192 tokens
that copy costs more than the attention that reads the cache. :class:`AppendKVCacheLayer` keeps them
in a buffer with headroom and writes each step's keys into it; ``keys``/``values`` are views of the
filled part, so everything that reads a ``DynamicLayer`` reads this one unchanged.

The slot is swapped in at the first one-token step, by the softmax layers' own forward
(``SoftmaxLlamaAttention``); it takes the prompt's keys over without a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

# Growth beyond what a step needs: a quarter of the length (amortized O(1) copies per token), at
# least 16 and at most 256 tokens (so the spare memory stays under 256 tokens per layer at long contexts).
MIN_HEADROOM, MAX_HEADROOM = 16, 256


class AppendKVCacheLayer(DynamicLayer):
    """A ``DynamicLayer`` whose update writes into a buffer ``[B, H_kv, capacity, D]`` in place.

    A first update (the prompt) allocates exactly its length, so the cache after prefill holds no
    spare bytes; later updates grow it by :data:`MIN_HEADROOM`-:data:`MAX_HEADROOM` tokens when full.
    Updates that autograd must see (grad enabled, keys requiring grad) concatenate as ``DynamicLayer``
    does, because writing into a buffer that an earlier step's graph saved would corrupt its backward.
    """

    def __init__(self) -> None:
        super().__init__()
        self._k_buffer: Tensor | None = None
        self._v_buffer: Tensor | None = None

    @classmethod
    def taking_over(cls, layer: DynamicLayer) -> AppendKVCacheLayer:
        """This layer with ``layer``'s contents (its tensors become the buffer, nothing is copied)."""
        new = cls()
        new.__dict__.update(layer.__dict__)
        new._adopt_views()
        return new

    def _adopt_views(self) -> None:
        # Whatever replaced keys/values since the last update (crop keeps a prefix view; reordering,
        # batch selection, offloading and reset make new tensors; some transformers versions assign
        # them from the Cache), the buffer follows unless keys is still its prefix.
        k, buffer = self.keys, self._k_buffer
        if k is None or not self.is_initialized:
            self._k_buffer = self._v_buffer = None
        elif buffer is None or k.data_ptr() != buffer.data_ptr() or k.stride() != buffer.stride():
            self._k_buffer, self._v_buffer = k, self.values

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._adopt_views()
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            out = super().update(key_states, value_states, *args, **kwargs)
            self._adopt_views()
            return out
        n, t = self.get_seq_length(), key_states.shape[-2]
        if n == 0 or n + t > self._k_buffer.shape[-2]:  # _adopt_views left a buffer wherever n > 0
            self._grow(n, n + t, key_states, value_states)
        self._k_buffer[..., n : n + t, :].copy_(key_states)
        self._v_buffer[..., n : n + t, :].copy_(value_states)
        self.keys, self.values = self._k_buffer[..., : n + t, :], self._v_buffer[..., : n + t, :]
        return self.keys, self.values

    def _grow(self, n: int, needed: int, key_states: Tensor, value_states: Tensor) -> None:
        # A prompt (n = 0) gets exactly its length; a full buffer grows by its headroom.
        capacity = needed if n == 0 else needed + min(MAX_HEADROOM, max(MIN_HEADROOM, needed // 4))
        old = (self._k_buffer, self._v_buffer)
        self._k_buffer, self._v_buffer = (
            new.new_empty((*new.shape[:-2], capacity, new.shape[-1])) for new in (key_states, value_states)
        )
        if n:
            self._k_buffer[..., :n, :].copy_(old[0][..., :n, :])
            self._v_buffer[..., :n, :].copy_(old[1][..., :n, :])

    def nbytes(self) -> int:
        """Bytes held, spare capacity included."""
        self._adopt_views()
        return sum(t.numel() * t.element_size() for t in (self._k_buffer, self._v_buffer) if t is not None)


def append_kv_cache_layer(cache: Cache, layer_idx: int) -> AppendKVCacheLayer | None:
    """Swap ``cache``'s plain ``DynamicLayer`` at ``layer_idx`` (created there if missing) for an
    :class:`AppendKVCacheLayer` holding the same keys, and return it (also when it was swapped in
    before). Other kinds of slot (static, sliding, quantized, hybrid) and offloading caches are left as
    they are: None."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False):
        return None
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while len(layers) <= layer_idx and replicate is not None:
        layers.append(replicate())
    if layer_idx >= len(layers):
        return None
    slot = layers[layer_idx]
    if type(slot) is DynamicLayer:
        slot = layers[layer_idx] = AppendKVCacheLayer.taking_over(slot)
    return slot if isinstance(slot, AppendKVCacheLayer) else None
