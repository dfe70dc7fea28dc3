"""Integration with transformers: conversion, hybrid-aware cache, loading and saving models (docs/design.md)."""

from hybrid_llama.layers import HybridCacheLayer, HybridConfig, HybridLlamaAttention, MixingLogits

from .cache import cache_nbytes_by_layer, hybrid_cache_nbytes
from .convert import (
    convert_to_hybrid,
    decoder_layers,
    hybrid_config_of,
    hybrid_parameter_names,
    make_hybrid_attention,
)
from .io import load_hybrid, load_hybrid_layers, load_model, save_hybrid

__all__ = [
    "HybridCacheLayer",
    "HybridConfig",
    "HybridLlamaAttention",
    "MixingLogits",
    "cache_nbytes_by_layer",
    "convert_to_hybrid",
    "decoder_layers",
    "hybrid_cache_nbytes",
    "hybrid_config_of",
    "hybrid_parameter_names",
    "load_hybrid",
    "load_hybrid_layers",
    "load_model",
    "make_hybrid_attention",
    "save_hybrid",
]
