"""Where a model under evaluation runs and how long its inputs may be, for the quality evaluations
(perplexity, passkey, components): they score a model the caller already built and placed."""

from __future__ import annotations

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
