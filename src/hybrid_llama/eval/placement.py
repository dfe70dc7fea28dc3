"""Where a model under evaluation runs, how long its inputs may be and how its forward takes a cache,
for the evaluations (perplexity, passkey, components, throughput): they score a model the caller
already built and placed."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hybrid_llama.runtime import resolve_dtype


def place_model(model: torch.nn.Module, device: Any = None, dtype: Any = None) -> torch.device:
    """Move the model only when asked; otherwise evaluate where it already lives. Returns its device."""
    dtype = resolve_dtype(dtype)
    if dtype is not None:
        model.to(dtype=dtype)
    if device is not None:
        model.to(device)
    return next(model.parameters()).device


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its cache by: 'cache' from transformers 5.2x, else
    'past_key_values' (deprecated there)."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_type: type) -> str:
    # per class, once: a decode step is timed around this call
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a forward returned: ``out.cache`` from transformers 5.2x (where reading
    ``past_key_values`` warns that it is deprecated), else ``out.past_key_values``."""
    return out["cache"] if "cache" in out else out.past_key_values


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest input the model's position embeddings cover (None if its config does not say)."""
    return getattr(model.config, "max_position_embeddings", None)


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model.eval()`` for the block, then the training flag it had (callers may be mid-training)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
