"""Pieces shared by the triton prefill and decode kernels.

Feature maps: the kernels either compute elu1 themselves (``FEATURES=False``, F = D) or read
features the caller computed in torch (``FEATURES=True``: phi(q) ``[B, H, T, F]``, phi(k)
``[B, H_kv, T, F]``), which is how learned maps (Hedgehog) keep their parameters under autograd.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..hybrid.reference import FORMULATIONS

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
# Feature widths of maps computed outside the kernels: powers of two (tl.arange) >= 16 (tl.dot),
# with an [F, D] state no larger than elu1's at D = 128. Offline sm_90 compiles: F = 256 at D = 128
# (Hedgehog's 2 * D) needs 272 KiB of shared memory in the backward, over the H100's 227 KiB.
SUPPORTED_FEATURE_DIMS = (16, 32, 64, 128, 256)
MAX_STATE_ELEMENTS = 128 * 128


@triton.jit
def phi(x):
    """elu(x) + 1; for x <= 0 that is exp(x). The min() keeps exp off the (discarded) large branch."""
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def dphi(x):
    """Derivative of elu(x) + 1."""
    return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))


def check_feature_dim(f: int, d: int) -> None:
    """Width F of features computed outside the kernels, for head dim d; others make the dispatcher
    fall back to the torch backends."""
    if f not in SUPPORTED_FEATURE_DIMS or f * d > MAX_STATE_ELEMENTS:
        raise NotImplementedError(
            f"triton backend supports feature widths in {SUPPORTED_FEATURE_DIMS} with F * D <= "
            f"{MAX_STATE_ELEMENTS}, got F = {f}, D = {d}"
        )


def formulation_flags(formulation: str) -> tuple[bool, bool]:
    """(lolcats, linear): lolcats selects the shared normaliser; linear is False for "window", which
    the kernels run as the hybrid formulation with the linear part compiled out (weight b = 0)."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    return formulation == "lolcats", formulation != "window"


def check_head_dim(d: int) -> None:
    if d not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"triton backend supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}")


def check_device(x: Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        raise NotImplementedError("triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")


def last_dim_contiguous(x: Tensor) -> Tensor:
    """Kernels take strides for every dim but the last, which must be 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tests compare them tightly); fp16/bf16 use tensor cores
    anyway, and the fp32 linear-state products run as tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
