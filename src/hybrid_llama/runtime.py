"""Devices and dtypes as the config names them, turned into torch objects (torch is imported lazily:
the workflow imports this package's tables at parse time)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# CPU flags (Linux /proc/cpuinfo names) of instructions that multiply bf16 natively. Without them
# oneDNN emulates bf16 on wider units: no reason to expect a gain, and precision is lost.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# The dtype name that means bf16 where the device multiplies it natively and fp32 elsewhere: the
# rule training's autocast follows, for evaluations (config quality/mmlu/zeroshot ``dtype``).
BF16_IF_NATIVE = "bfloat16_if_native"


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


def multiplies_bf16_natively(device: Any = None) -> bool:
    """CUDA devices do; a CPU (``device`` None or 'cpu') does where ``cpu_has_native_bf16``."""
    kind = str(device or "cpu").split(":", 1)[0]
    return kind == "cuda" or (kind == "cpu" and cpu_has_native_bf16())


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and keep what is freed there.

    By default glibc maps each allocation above a few MB freshly and unmaps it on free, so on CPU
    every large PyTorch temporary (a [2048, vocab] logits tensor, a slab of attention scores) is
    zero-filled by the kernel page by page again on every step. Keeping freed memory in the heap
    turns that into plain reuse (measured gains: docs/results.md). The price is that a process's
    memory stays at its peak until it exits, which suits short pipeline jobs.
    A no-op (False) off glibc (macOS, musl) or with HYBRID_LLAMA_KEEP_FREED_MEMORY=0.
    """
    if os.environ.get("HYBRID_LLAMA_KEEP_FREED_MEMORY", "1") == "0":
        return False
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":  # the option numbers below are glibc's
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    # Never give the heap's top back to the kernel, and never use mmap for a single allocation.
    return bool(mallopt(m_trim_threshold, 2**31 - 1)) and bool(mallopt(m_mmap_max, 0))


def resolve_dtype(dtype: Any, device: Any = None) -> torch.dtype | None:
    """A torch dtype from a name ('float32', 'bf16', 'torch.float16', ...), a dtype, or None/'auto'
    (None). ``'bfloat16_if_native'`` is bf16 where ``device`` multiplies it natively, else fp32."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == BF16_IF_NATIVE:
        return torch.bfloat16 if multiplies_bf16_natively(device) else torch.float32
    name = str(dtype).removeprefix("torch.")
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": None}.get(name, name)
    if name is None:
        return None
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return dt


def for_eval(model, device: str, dtype: Any):
    """``model`` on ``device`` in ``dtype`` (None / 'auto': as it is), in eval mode, for scoring."""
    torch_dtype = resolve_dtype(dtype, device)
    model = model.to(device=device, dtype=torch_dtype) if torch_dtype else model.to(device)
    return model.eval()


def require_device(device: str) -> str:
    """The torch device of a config/wildcard device; raise if it names CUDA and there is none.

    Devices may carry a label for the cluster profile ('cuda-h100', 'cuda:1-a100'): the torch
    device is the part before '-'. Inside a SLURM job only the allocated GPU is visible (as
    cuda:0), so there any 'cuda:N' runs on the one GPU torch sees.
    """
    device = str(device).split("-", 1)[0]
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device '{device}' was requested (config 'devices' or a 'device' key) but "
                f"torch.cuda.is_available() is False on this host; run on a GPU node or use 'cpu'"
            )
        index = int(device.split(":")[1]) if ":" in device else 0
        count = torch.cuda.device_count()
        if os.environ.get("SLURM_JOB_ID") and count == 1:
            return "cuda:0"
        if index >= count:
            raise RuntimeError(f"device '{device}' was requested but only {count} CUDA device(s) exist")
    return device


def device_name(device: Any) -> str:
    """Human-readable device: ``cpu`` or the CUDA device's product name."""
    import torch

    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
