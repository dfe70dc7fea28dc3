"""Models on disk: load a resolved model directory, save and load hybrid models as safetensors +
config.json (model type ``hybrid_llama``; no custom code, no pickle) + a model card."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hybrid_llama.files import atomic_write, load_safetensors, safetensors_float_dtype, save_safetensors
from hybrid_llama.layers import HybridConfig
from hybrid_llama.runtime import resolve_dtype

from .card import model_card
from .configuration import MODEL_TYPE, HybridLlamaConfig
from .convert import convert_to_hybrid, hybrid_config_of, hybrid_parameter_names
from .modeling import WEIGHTS_NAME, HybridLlamaForCausalLM

CARD_NAME = "README.md"


def _tied_names(model: nn.Module) -> set[str]:
    # With tied embeddings lm_head.weight is the embedding matrix: store it once.
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def save_hybrid(model: nn.Module, path: str | Path, tokenizer=None, *, card: str | None = None) -> Path:
    """Write ``config.json`` (model type ``hybrid_llama`` with the "hybrid" block),
    ``model.safetensors``, the tokenizer if given and ``README.md``: ``card``, or by default a card
    from the model's own settings (``models.card.model_card``; results "not measured")."""
    hybrid = hybrid_config_of(model)
    if hybrid is None:
        raise ValueError("save_hybrid: model.config.hybrid is not set; call convert_to_hybrid first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    skip = _tied_names(model)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in skip}
    save_safetensors(path / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
    config = HybridLlamaConfig.from_llama(model.config)
    config.architectures = [HybridLlamaForCausalLM.__name__]
    config.dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())  # what dtype="auto" loads
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    atomic_write(path / CARD_NAME, card if card is not None else model_card(hybrid))
    return path


def _checkpoint_format(path: Path) -> str | None:
    """'hybrid_llama' (this model type), 'llama+hybrid' (the format before it: model type llama with
    a "hybrid" block) or None (not a saved hybrid), from ``path/config.json``."""
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") == MODEL_TYPE:
        return MODEL_TYPE
    return "llama+hybrid" if config.get("hybrid") is not None else None


def is_hybrid_checkpoint(path: str | Path) -> bool:
    """Whether ``path/config.json`` describes a saved hybrid, in either format."""
    return _checkpoint_format(Path(path)) is not None


def hybrid_llama_config(path: str | Path) -> HybridLlamaConfig:
    """The ``HybridLlamaConfig`` of a saved hybrid, from either format (see ``is_hybrid_checkpoint``)."""
    path = Path(path)
    fmt = _checkpoint_format(path)
    if fmt is None:
        raise ValueError(f"{path}/config.json has no 'hybrid' block: not a hybrid checkpoint")
    if fmt == MODEL_TYPE:
        return HybridLlamaConfig.from_pretrained(path)
    return HybridLlamaConfig.from_llama(LlamaConfig.from_pretrained(path))


def load_hybrid(path: str | Path, *, dtype: torch.dtype | None = None, device=None) -> HybridLlamaForCausalLM:
    """Rebuild a saved hybrid model (either format) through ``HybridLlamaForCausalLM.from_pretrained``:
    the Auto classes' code path, strict about missing keys; ``dtype`` defaults to the stored one."""
    path = Path(path)
    config = hybrid_llama_config(path)
    dtype = dtype or safetensors_float_dtype(path / WEIGHTS_NAME, rule=None)
    model = HybridLlamaForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    return model.to(device=device).eval()


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: Any = None
) -> tuple[LlamaForCausalLM, Any]:
    """``(model, tokenizer)`` of a model directory (``hybrid_llama.weights.resolve_model``'s output, or
    a checkpoint of ``save_hybrid``, which loads via ``load_hybrid``)."""
    path = Path(path)
    dtype = resolve_dtype(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if is_hybrid_checkpoint(path):
        model = load_hybrid(path, dtype=dtype, device=device)
    else:
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else "auto")
        model = model.to(device=device).eval()
    return model, tokenizer


def load_hybrid_layers(base_model: nn.Module, safetensors_path: str | Path, cfg: HybridConfig) -> nn.Module:
    """Load transferred hybrid-layer attention weights (full model names) into ``base_model``.

    ``base_model`` is converted with ``cfg`` first unless it already is (then its config must equal
    ``cfg``). Every parameter of every hybrid attention module must be in the file; keys outside
    them are an error too, so a file for other layers or another model cannot load silently.
    """
    if isinstance(cfg, dict):
        cfg = HybridConfig.from_dict(cfg)
    have = hybrid_config_of(base_model)
    if have is None:
        convert_to_hybrid(base_model, **asdict(cfg))
    elif have != cfg:
        raise ValueError(f"base model is already hybrid with {have}, not {cfg}")
    state = load_safetensors(safetensors_path, rule="transfer")
    expected = set(hybrid_parameter_names(base_model))
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{safetensors_path}: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
    base_model.load_state_dict(state, strict=False)
    return base_model
