"""Turn chosen layers of a transformers Llama into hybrid attention, in place."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention

from hybrid_llama.layers import HybridConfig, HybridLlamaAttention, as_softmax_layers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a ``LlamaForCausalLM`` (``model.model.layers``) or a ``LlamaModel``."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder layers at .model.layers or .layers")
    return layers


def make_hybrid_attention(attn: LlamaAttention, cfg: HybridConfig) -> HybridLlamaAttention:
    """A ``HybridLlamaAttention`` with copies (not views) of ``attn``'s projections, same device/dtype."""
    if isinstance(attn, HybridLlamaAttention):
        raise ValueError(f"layer {attn.layer_idx} is already hybrid")
    ref = attn.q_proj.weight
    with torch.device(ref.device):
        new = HybridLlamaAttention(attn.config, attn.layer_idx, cfg)
    new.to(dtype=ref.dtype)
    # load_state_dict copies into the new module's own tensors: the source can stay frozen forever.
    result = new.load_state_dict(attn.state_dict(), strict=False)
    if result.unexpected_keys or any(not k.startswith(("mixing.", "feature_map.")) for k in result.missing_keys):
        raise RuntimeError(f"weights of layer {attn.layer_idx} do not fit HybridLlamaAttention: {result}")
    new.train(attn.training)
    return new


def convert_to_hybrid(
    model: nn.Module,
    layers: list[int],
    window: int = 64,
    formulation: str = "hybrid",
    feature_map: str = "elu1",
    backend: str = "auto",
    sparse_cache: int = 0,
    sinks: int = 0,
    cache_score: str = "sre",
    softmax_heads: list[list[int]] | None = None,
    decay: float | None = None,
) -> nn.Module:
    """Replace the attention of ``layers`` by hybrid attention, in place; returns ``model``.

    The new modules own cloned q/k/v/o weights, so a teacher sharing tensors with ``model`` never
    drifts when the student trains. The settings go to ``model.config.hybrid`` (saved in config.json).
    """
    cfg = HybridConfig(layers=list(layers), window=window, formulation=formulation, feature_map=feature_map,
                       backend=backend, sparse_cache=sparse_cache, sinks=sinks, cache_score=cache_score,
                       softmax_heads=list(softmax_heads or []), decay=decay)
    swap_in_hybrid_attention(model, cfg, check_config=True)
    model.config.hybrid = cfg.to_dict()
    return model


def swap_in_hybrid_attention(model: nn.Module, cfg: HybridConfig, *, check_config: bool = False) -> nn.Module:
    """Replace the attention of ``cfg.layers`` by ``make_hybrid_attention`` copies, in place.

    The one conversion step: ``convert_to_hybrid`` calls it on a plain model (``check_config``: refuse a
    model whose config already records a conversion), ``HybridLlamaForCausalLM`` on itself at
    construction, where ``config.hybrid`` is the saved settings and the weights come from the checkpoint.
    The layers left softmax become ``SoftmaxLlamaAttention`` (KV cache appended in place, native decode step).
    """
    blocks = decoder_layers(model)
    bad = [i for i in cfg.layers if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(f"hybrid layers {bad} out of range: the model has {len(blocks)} layers")
    if check_config and hybrid_config_of(model) is not None:
        raise ValueError("model is already converted (model.config.hybrid is set)")
    for i in cfg.layers:
        blocks[i].self_attn = make_hybrid_attention(blocks[i].self_attn, cfg)
    as_softmax_layers([b.self_attn for i, b in enumerate(blocks) if i not in cfg.layers])
    return model


def hybrid_config_of(model: nn.Module) -> HybridConfig | None:
    """The ``HybridConfig`` recorded in ``model.config.hybrid``, or None for a plain model."""
    d = getattr(getattr(model, "config", None), "hybrid", None)
    return None if d is None else HybridConfig.from_dict(dict(d))


def hybrid_parameter_names(model: nn.Module) -> list[str]:
    """Full names of every parameter inside the hybrid layers' attention modules."""
    names = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, HybridLlamaAttention):
            names += [f"{mod_name}.{p}" for p, _ in mod.named_parameters()]
    return names
