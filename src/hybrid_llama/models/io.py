"""Models on disk: load a resolved model directory, save and load hybrid models as safetensors +
config.json (no custom code, no pickle)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from hybrid_llama.files import load_safetensors, save_safetensors, unreadable
from hybrid_llama.layers import HybridConfig
from hybrid_llama.runtime import resolve_dtype

from .convert import convert_to_hybrid, hybrid_config_of, hybrid_parameter_names

WEIGHTS_NAME = "model.safetensors"


def _tied_names(model: nn.Module) -> set[str]:
    # With tied embeddings lm_head.weight is the embedding matrix: store it once.
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def save_hybrid(model: nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Write ``config.json`` (with the "hybrid" block), ``model.safetensors`` and the tokenizer if given."""
    if hybrid_config_of(model) is None:
        raise ValueError("save_hybrid: model.config.hybrid is not set; call convert_to_hybrid first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    skip = _tied_names(model)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in skip}
    save_safetensors(path / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _stored_dtype(file: Path) -> torch.dtype:
    try:
        return _first_float_dtype(file)
    except Exception as exc:  # a truncated export fails here first: name it
        raise unreadable(file, None, exc) from exc


def _first_float_dtype(file: Path) -> torch.dtype:
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(t.get_dtype())
            if dt is not None:
                return dt
    return torch.float32


def load_hybrid(path: str | Path, *, dtype: torch.dtype | None = None, device=None) -> LlamaForCausalLM:
    """Rebuild a saved hybrid model: ``LlamaForCausalLM`` from config.json, convert, load strictly."""
    path = Path(path)
    config = LlamaConfig.from_pretrained(path)
    hybrid = getattr(config, "hybrid", None)
    if hybrid is None:
        raise ValueError(f"{path}/config.json has no 'hybrid' block: not a hybrid checkpoint")
    cfg = HybridConfig.from_dict(dict(hybrid))
    del config.hybrid  # convert_to_hybrid records it again
    file = path / WEIGHTS_NAME
    dtype = dtype or _stored_dtype(file)
    model = _empty_llama(config, dtype)
    convert_to_hybrid(model, **asdict(cfg))
    _load_strict(model, load_safetensors(file, rule=None), what=str(file),
                 allowed_missing=_tied_names(model))
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.to(device=device).eval()


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: Any = None
) -> tuple[LlamaForCausalLM, Any]:
    """``(model, tokenizer)`` of a model directory (``hybrid_llama.weights.resolve_model``'s output, or
    a checkpoint of ``save_hybrid``: a config.json with a "hybrid" block loads via ``load_hybrid``)."""
    path = Path(path)
    dtype = resolve_dtype(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(LlamaConfig.from_pretrained(path), "hybrid", None) is not None:
        model = load_hybrid(path, dtype=dtype, device=device)
    else:
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype if dtype is not None else "auto")
        model = model.to(device=device).eval()
    return model, tokenizer


def _empty_llama(config: LlamaConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    # Every weight is overwritten right after: skip the (slow, for 1B params) random init.
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = LlamaForCausalLM(config)
    model.tie_weights()  # no_init_weights also skips the tying done at init
    return model.to(dtype=dtype)


def _load_strict(model: nn.Module, state: dict, *, what: str, allowed_missing: set[str] = frozenset()) -> None:
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k not in allowed_missing]
    if missing or result.unexpected_keys:
        raise ValueError(f"{what}: missing keys {missing[:10]}, unexpected keys {result.unexpected_keys[:10]}")


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
