"""Pieces shared by the triton prefill and decode kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .feature_maps import is_elu1
from .reference import FORMULATIONS

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def phi(x):
    """elu(x) + 1; for x <= 0 that is exp(x). The min() keeps exp off the (discarded) large branch."""
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def dphi(x):
    """Derivative of elu(x) + 1."""
    return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))


def check_feature_map(feature_map) -> None:
    """Only elu1 is fused; anything else makes the dispatcher fall back to the torch backends."""
    if not is_elu1(feature_map):
        raise NotImplementedError(f"triton backend supports feature_map='elu1' only, got {feature_map!r}")


def check_formulation(formulation: str) -> bool:
    """Return True for lolcats."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if formulation == "window":
        raise NotImplementedError("triton backend: formulation='window' runs on the chunked backend")
    return formulation == "lolcats"


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
