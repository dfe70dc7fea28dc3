"""nn.Modules of hybrid attention (see docs/design.md, "layers / models")."""

from .append_kv_cache import AppendKVCacheLayer, append_kv_cache_layer
from .hybrid_attention import (
    Elu1FeatureMap,
    HybridConfig,
    HybridLlamaAttention,
    MixingLogits,
    QKFeatureMaps,
    keys_valid_from_mask,
    make_feature_map,
)
from .hybrid_cache import HybridCacheLayer, hybrid_cache_layer
from .softmax_attention import SoftmaxLlamaAttention, as_softmax_layers, rotary_qkv

__all__ = [
    "AppendKVCacheLayer",
    "append_kv_cache_layer",
    "as_softmax_layers",
    "Elu1FeatureMap",
    "HybridCacheLayer",
    "HybridConfig",
    "HybridLlamaAttention",
    "MixingLogits",
    "QKFeatureMaps",
    "SoftmaxLlamaAttention",
    "hybrid_cache_layer",
    "keys_valid_from_mask",
    "make_feature_map",
    "rotary_qkv",
]
