"""`reference` backend: a direct transcription of the hybrid attention math.

It builds the full ``[T, T]`` window and linear masks, so it is O(T^2) in time and memory; it exists
to be read and to check the fast backends, not to be fast. See docs/design.md ("ops") for the
semantics. The helpers ``check_inputs`` and ``combine`` are shared with the other torch backends so
that every backend applies the same normalisation rules.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps

# hybrid: the published recreation's two normalizers; lolcats: one shared normalizer; window: the
# softmax window alone (the linear part switched off: the window-only control).
FORMULATIONS = ("hybrid", "lolcats", "window")


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    window: int,
    formulation: str,
    key_padding_mask: Tensor | None,
) -> None:
    if (q.dim() != 4 or k.dim() != 4 or (k.shape[0], *k.shape[2:]) != (q.shape[0], *q.shape[2:])
            or q.shape[1] % k.shape[1] or v.shape[:3] != k.shape[:3]):
        raise ValueError(
            f"q, k, v must be [B, H, T, D], [B, H_kv, T, D], [B, H_kv, T, Dv] with H % H_kv == 0 (GQA; "
            f"H_kv = H for expanded k/v); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads = q.shape[1]
    for name, logit in (("window_logit", window_logit), ("linear_logit", linear_logit)):
        if logit.shape != (heads,):
            raise ValueError(f"{name} must be [H]=[{heads}], got {tuple(logit.shape)}")
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (q.shape[0], q.shape[2]) or key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be bool [B, T]=[{q.shape[0]}, {q.shape[2]}], got "
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )


def mixing_weights(window_logit: Tensor, linear_logit: Tensor) -> tuple[Tensor, Tensor]:
    """``a = sigmoid(window_logit)``, ``b = sigmoid(linear_logit)`` shaped ``[1, H, 1, 1]`` (fp32)."""
    a = torch.sigmoid(window_logit.float()).view(1, -1, 1, 1)
    b = torch.sigmoid(linear_logit.float()).view(1, -1, 1, 1)
    return a, b


def combine(
    formulation: str,
    a: Tensor,
    b: Tensor,
    win_avg: Tensor,
    win_sum: Tensor,
    lin_num: Tensor,
    lin_den: Tensor,
) -> Tensor:
    """Mix the two parts into the output.

    ``win_avg = sum_win softmax_j v_j`` (any finite value when the window is empty) and
    ``win_sum = sum_win exp(s_j - m)`` with m the window's max score (so >= 1, or exactly 0 when
    the window holds no real key); ``lin_num = phi(q) S``, ``lin_den = phi(q) z``. Shapes
    ``[..., D]`` and ``[..., 1]``; ``a`` and ``b`` broadcast against them.
    """
    has_win = (win_sum > 0).to(win_sum.dtype)
    if formulation == "window":
        # The linear part is not there: the window's softmax average, zeros with no real key.
        return win_avg * has_win
    if formulation == "hybrid":
        # The softmax average enters with weight a; a query whose window holds no real key drops
        # the term from both numerator and denominator.
        num = a * has_win * win_avg + b * lin_num
        den = a * has_win + b * lin_den
    else:  # lolcats: one shared normaliser, exp-scores (relative to the window max) + linear scores
        num = a * win_sum * win_avg + b * lin_num
        den = a * win_sum + b * lin_den
    has_any = den > 0
    # A query that sees no real key at all returns zeros (and zero gradients, not NaN).
    return torch.where(has_any, num / torch.where(has_any, den, torch.ones_like(den)), torch.zeros_like(num))


def hybrid_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int = 64,
    formulation: str = "hybrid",
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask)
    out_dtype = q.dtype
    phi_q, phi_k = resolve_qk_maps(feature_map)
    groups = q.shape[1] // k.shape[1]  # GQA: query head h reads KV head h // groups
    q, k_kv, v = q.float(), k.float(), v.float().repeat_interleave(groups, 1)
    k = k_kv.repeat_interleave(groups, 1)
    # A key map of a (query_map, key_map) pair works at the KV heads; one per-head map at the query heads.
    k_features = phi_k(k) if keys_need_query_heads(feature_map) else phi_k(k_kv).repeat_interleave(groups, 1)
    T, D = q.shape[2], q.shape[3]

    pos = torch.arange(T, device=q.device)
    t, j = pos[:, None], pos[None, :]
    win_mask = (j <= t) & (j > t - window)  # [T, T]: keys t-w+1 .. t
    lin_mask = j <= t - window  # [T, T]: keys 0 .. t-w
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, None, :]  # [B, 1, 1, T]
        win_mask, lin_mask = win_mask & real, lin_mask & real
    else:
        win_mask, lin_mask = win_mask[None, None], lin_mask[None, None]

    # Window part: softmax over the window keys, stabilised by the max score in the window.
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~win_mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)  # exactly 0 on masked keys
    win_sum = p.sum(dim=-1, keepdim=True)
    win_avg = torch.matmul(p, v) / torch.where(win_sum > 0, win_sum, torch.ones_like(win_sum))

    # Linear part: phi(q_t) . phi(k_j) over keys that left the window.
    lin_scores = torch.matmul(phi_q(q), k_features.transpose(-1, -2)) * lin_mask
    lin_num = torch.matmul(lin_scores, v)
    lin_den = lin_scores.sum(dim=-1, keepdim=True)

    a, b = mixing_weights(window_logit, linear_logit)
    return combine(formulation, a, b, win_avg, win_sum, lin_num, lin_den).to(out_dtype)
