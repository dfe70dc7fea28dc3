"""Where a stage computes and how reproducibly: the device, bf16 autocast, the seeds."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch

from hybrid_llama.runtime import cpu_has_native_bf16

__all__ = ["pick_device", "autocast", "autocast_active", "cpu_has_native_bf16", "seed_everything"]


def pick_device(name: str = "auto") -> torch.device:
    """The torch device of a settings' ``device`` ("auto" = CUDA when there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_active(device: torch.device, enabled: bool = True) -> bool:
    """Whether ``autocast(device, enabled)`` changes anything: on CUDA, and on a CPU with native
    bf16 matrix instructions."""
    if not enabled:
        return False
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def autocast(device: torch.device, enabled: bool = True) -> Any:
    """bf16 autocast where ``autocast_active``; elsewhere a no-op, so the stage runs in its dtype."""
    if autocast_active(device, enabled):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    """Seed Python, torch and numpy (when installed): a stage calls it before building its models."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
