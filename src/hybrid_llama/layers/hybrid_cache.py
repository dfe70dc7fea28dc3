"""The cache slot of a hybrid layer: a constant-size ``HybridState`` where a softmax layer keeps a
growing KV cache. A layer swaps its slot in the cache object transformers created on first use."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from hybrid_llama.ops import DeferredState, HybridState

from .append_kv_cache import AppendKVCacheLayer


class HybridCacheLayer(CacheLayerMixin):
    """Cache slot of a hybrid layer: a constant-size ``HybridState`` instead of a growing KV cache.

    It reports the same sequence length and mask sizes as a full-attention layer, so the causal mask
    transformers builds (possibly from this layer, if it is layer 0) stays right for softmax layers.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self._state: HybridState | None = None
        # A prompt that is causal softmax, kept as its keys/values until a decode step needs the state
        # (ops.layer_prompt says why).
        self._prefix: DeferredState | None = None
        self.seen = 0  # tokens consumed, even when no state was kept (training mode)
        # The keys and values of the layer's exact heads (``softmax_heads``), when it has any.
        self.exact: AppendKVCacheLayer | None = None

    @property
    def state(self) -> HybridState | None:
        """The decode state after ``seen`` tokens; a deferred prompt (``defer_state``) is built into it here."""
        if self._prefix is not None:
            k, v, build = self._prefix
            self._prefix, self._state = None, build(k, v)
        return self._state

    @state.setter
    def state(self, state: HybridState | None) -> None:
        self._prefix, self._state = None, state

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        raise RuntimeError("a hybrid layer's cache holds a recurrent state, not keys/values; it has no update()")

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def set_state(self, state: HybridState | None, consumed: int) -> None:
        if state is not None and not self.is_initialized:
            self.lazy_initialization(state.k_window, state.v_window)
        self.state = state
        self.seen += consumed

    def defer_state(self, deferred: DeferredState) -> None:
        """Keep a first prompt's keys/values ``[B, H_kv, T, D]`` (a causal-softmax prompt) as they are; the
        state is ``deferred.build(k, v)``, made when first read."""
        if self.seen or self._state is not None:
            raise RuntimeError("only a cache's first prompt can be deferred")
        if not self.is_initialized:
            self.lazy_initialization(deferred.k, deferred.v)
        self._prefix, self._state = deferred, None
        self.seen = deferred.k.shape[2]

    def exact_store(self) -> AppendKVCacheLayer:
        """The KV cache of the layer's exact heads, made on first use."""
        if self.exact is None:
            self.exact = AppendKVCacheLayer()
        return self.exact

    def _exact(self, method: str, *args) -> None:
        if self.exact is not None and self.exact.is_initialized:
            getattr(self.exact, method)(*args)

    def nbytes(self) -> int:
        exact = 0 if self.exact is None else self.exact.nbytes()
        if self._prefix is not None:
            return exact + sum(t.numel() * t.element_size() for t in self._prefix[:2])
        return exact + (0 if self._state is None else self._state.nbytes())

    def offload(self) -> None:
        if self.state is not None:
            self.state = self.state.to("cpu")
        self._exact("offload")

    def prefetch(self) -> None:
        if self.state is not None and self.state.k_window.device != self.device:
            self.state = self.state.to(self.device)
        self._exact("prefetch")

    def reset(self) -> None:
        self.state = None  # drops a deferred prompt too
        self.seen = 0
        self.is_initialized = False
        self.exact = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("a hybrid layer's recurrent state cannot be cropped (no rollback)")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(beam_idx)
        self._exact("reorder_cache", beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.state is not None:
            idx = torch.as_tensor(indices, device=self.state.k_window.device)
            if idx.dtype == torch.bool:
                idx = idx.nonzero().flatten()
            self.state = self.state.index_select(idx)
        self._exact("batch_select_indices", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            b = self.state.k_window.shape[0]
            idx = torch.arange(b, device=self.state.k_window.device).repeat_interleave(repeats)
            self.state = self.state.index_select(idx)
        self._exact("batch_repeat_interleave", repeats)


def hybrid_cache_layer(cache: Cache, layer_idx: int) -> HybridCacheLayer:
    """The :class:`HybridCacheLayer` of ``layer_idx`` in ``cache``, installed on first use."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"hybrid layers need a transformers Cache with .layers, got {type(cache).__name__}")
    replicate = getattr(cache, "layer_class_to_replicate", None)
    while len(layers) <= layer_idx:
        if replicate is None:
            raise ValueError(f"cache has {len(layers)} layers, no slot for layer {layer_idx}")
        layers.append(replicate())
    current = layers[layer_idx]
    if isinstance(current, HybridCacheLayer):
        return current
    if current.get_seq_length() > 0:
        raise ValueError(
            f"cache layer {layer_idx} already holds {current.get_seq_length()} softmax keys; "
            "a hybrid layer cannot continue from a plain KV cache"
        )
    layers[layer_idx] = HybridCacheLayer()
    return layers[layer_idx]
