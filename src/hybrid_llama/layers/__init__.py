"""nn.Modules of hybrid attention (see docs/design.md, "layers / models")."""

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
