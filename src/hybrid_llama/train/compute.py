"""Where a stage computes and how reproducibly: the device, bf16 autocast, the seeds."""

from __future__ import annotations

import contextlib
import functools
import random
from pathlib import Path
from typing import Any

import torch

__all__ = ["pick_device", "autocast", "autocast_active", "cpu_has_native_bf16", "seed_everything"]

# CPU flags (Linux /proc/cpuinfo names) of instructions that multiply bf16 natively. Without them
# oneDNN emulates bf16 on wider units: no reason to expect a gain, and precision is lost.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def pick_device(name: str = "auto") -> torch.device:
    """The torch device of a settings' ``device`` ("auto" = CUDA when there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX); False where the flags
    cannot be read (not Linux), so such machines keep fp32."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return not NATIVE_BF16_FLAGS.isdisjoint(flags)


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
