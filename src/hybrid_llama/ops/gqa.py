"""Grouped-query attention: k/v at the KV heads, repeated to the query heads where a path needs it."""

from __future__ import annotations

from torch import Tensor


def expand_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """GQA k/v ``[B, H_kv, T, D]`` repeated to q's H heads (query head h reads KV head h // (H / H_kv)),
    as transformers' ``repeat_kv`` does; k/v that already have H heads are returned as they are."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == heads:
        return k, v
    if k.dim() != 4 or v.shape[:3] != k.shape[:3] or heads % kv_heads:
        raise ValueError(f"k/v {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)} (need H % H_kv == 0)")
    groups = heads // kv_heads
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
