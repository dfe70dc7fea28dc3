"""nn.Modules of hybrid attention (see docs/design.md, "layers / models")."""

from .append_kv_cache import AppendKVCacheLayer, append_kv_cache_layer, append_kv_in_place
from .hybrid_attention import (
    Elu1FeatureMap,
    HybridCacheLayer,
    HybridConfig,
    HybridLlamaAttention,
    MixingLogits,
    QKFeatureMaps,
    hybrid_cache_layer,
    keys_valid_from_mask,
    make_feature_map,
)

__all__ = [
    "AppendKVCacheLayer",
    "append_kv_cache_layer",
    "append_kv_in_place",
    "Elu1FeatureMap",
    "HybridCacheLayer",
    "HybridConfig",
    "HybridLlamaAttention",
    "MixingLogits",
    "QKFeatureMaps",
    "hybrid_cache_layer",
    "keys_valid_from_mask",
    "make_feature_map",
]
