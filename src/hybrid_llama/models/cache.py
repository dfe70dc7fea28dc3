"""Memory accounting for generation caches holding hybrid and softmax layers."""

from __future__ import annotations

from transformers.cache_utils import Cache

from hybrid_llama.layers import AppendKVCacheLayer, HybridCacheLayer


def cache_nbytes_by_layer(cache: Cache) -> list[int]:
    """Bytes held per cache layer: the ``HybridState`` of hybrid layers, keys+values of softmax ones
    (with an ``AppendKVCacheLayer``'s spare capacity)."""
    sizes = []
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, (HybridCacheLayer, AppendKVCacheLayer)):
            sizes.append(layer.nbytes())
        else:
            sizes.append(sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None),
                                                                      getattr(layer, "values", None))
                             if t is not None))
    return sizes


def hybrid_cache_nbytes(cache: Cache) -> int:
    """Total bytes held by a generation cache (e.g. ``generate(..., return_dict_in_generate=True).past_key_values``)."""
    return sum(cache_nbytes_by_layer(cache))
