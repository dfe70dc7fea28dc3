"""Integration with transformers: conversion, hybrid-aware cache, loading and saving models (docs/design.md)."""

from hybrid_llama.layers import HybridCacheLayer, HybridConfig, HybridLlamaAttention, MixingLogits

from .cache import cache_nbytes_by_layer, hybrid_cache_nbytes
from .card import model_card
from .configuration import MODEL_TYPE, HybridLlamaConfig
from .convert import (
    convert_to_hybrid,
    decoder_layers,
    hybrid_config_of,
    hybrid_parameter_names,
    make_hybrid_attention,
    swap_in_hybrid_attention,
)
from .io import hybrid_llama_config, is_hybrid_checkpoint, load_hybrid, load_hybrid_layers, load_model, save_hybrid
from .modeling import HybridLlamaForCausalLM

__all__ = [
    "MODEL_TYPE",
    "HybridCacheLayer",
    "HybridConfig",
    "HybridLlamaAttention",
    "HybridLlamaConfig",
    "HybridLlamaForCausalLM",
    "MixingLogits",
    "cache_nbytes_by_layer",
    "convert_to_hybrid",
    "decoder_layers",
    "hybrid_cache_nbytes",
    "hybrid_config_of",
    "hybrid_llama_config",
    "hybrid_parameter_names",
    "is_hybrid_checkpoint",
    "load_hybrid",
    "load_hybrid_layers",
    "load_model",
    "make_hybrid_attention",
    "model_card",
    "save_hybrid",
    "swap_in_hybrid_attention",
]
