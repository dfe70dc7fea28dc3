"""`reference` backend: a direct transcription of the hybrid attention math.

It builds the full ``[T, T]`` window and linear masks, so it is O(T^2) in time and memory; it exists
to be read and to check the fast backends, not to be fast. See docs/design.md ("ops") for the
semantics. The helpers ``check_inputs`` and ``combine`` are shared with the other torch backends so
that every backend applies the same normalisation rules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps

if TYPE_CHECKING:
    from ..state import HybridState

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
    log_decay: Tensor | None = None,
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
    if log_decay is not None and log_decay.shape != (k.shape[1],):
        raise ValueError(f"log_decay must be [H_kv]=[{k.shape[1]}] (one per KV head), got {tuple(log_decay.shape)}")
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


def normalizer_weights(formulation: str, a: Tensor, b: Tensor, win_sum: Tensor) -> tuple[Tensor, Tensor | float]:
    """(weight of the window's average, weight of the linear readout) in the shared normalizer.

    The output is ``(w_win * win_avg + w_lin * phi(q) S) / (w_win + w_lin * phi(q) z)``:
    - hybrid: ``w_win = a`` (the softmax average enters with weight a), ``w_lin = b``;
    - lolcats: ``w_win = a * sum_win exp(s_j - m)`` (unnormalised exp-scores), ``w_lin = b``;
    - window: ``w_win = 1``, ``w_lin = 0`` (no linear part).
    A query whose window holds no real key drops the window term (``win_sum == 0``).
    """
    has_win = (win_sum > 0).to(win_sum.dtype)
    if formulation == "window":
        return has_win, 0.0
    if formulation == "hybrid":
        return a * has_win, b
    return a * win_sum, b


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
    w_win, w_lin = normalizer_weights(formulation, a, b, win_sum)
    num = w_win * win_avg + w_lin * lin_num
    den = w_win + w_lin * lin_den
    has_any = den > 0
    # A query that sees no real key at all returns zeros (and zero gradients, not NaN).
    return torch.where(has_any, num / torch.where(has_any, den, torch.ones_like(den)), torch.zeros_like(num))


def reference_parts(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    *,
    window: int,
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
    query_positions: Tensor | None = None,
    log_decay: Tensor | None = None,
) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor]:
    """(win_avg, win_sum, lin_num, lin_den) of ``combine`` for the queries at ``query_positions``
    (default: all T), in fp32, from full masks over all T keys. Without ``v`` only the normalizer
    terms (win_sum, lin_den) are computed; win_avg and lin_num are None. ``log_decay`` ``[H_kv]``
    (log gamma <= 0 per KV head): key j enters query t's linear part with weight gamma^(t - w - j)."""
    phi_q, phi_k = resolve_qk_maps(feature_map)
    groups = q.shape[1] // k.shape[1]  # GQA: query head h reads KV head h // groups
    T, D = q.shape[2], q.shape[3]
    pos = torch.arange(T, device=q.device) if query_positions is None else query_positions.to(q.device)
    q, k_kv = q.float()[:, :, pos], k.float()
    k = k_kv.repeat_interleave(groups, 1)
    # A key map of a (query_map, key_map) pair works at the KV heads; one per-head map at the query heads.
    k_features = phi_k(k) if keys_need_query_heads(feature_map) else phi_k(k_kv).repeat_interleave(groups, 1)

    t, j = pos[:, None], torch.arange(T, device=q.device)[None, :]
    win_mask = (j <= t) & (j > t - window)  # [Q, T]: keys t-w+1 .. t
    lin_mask = j <= t - window  # [Q, T]: keys 0 .. t-w
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

    # Linear part: phi(q_t) . phi(k_j) over keys that left the window.
    lin_scores = torch.matmul(phi_q(q), k_features.transpose(-1, -2)) * lin_mask
    if log_decay is not None:
        age = (t - window - j).clamp(min=0).float()  # steps since the key left the window
        lin_scores = lin_scores * torch.exp(log_decay.float().repeat_interleave(groups)[:, None, None] * age)
    lin_den = lin_scores.sum(dim=-1, keepdim=True)
    if v is None:
        return None, win_sum, None, lin_den
    v = v.float().repeat_interleave(groups, 1)
    win_avg = torch.matmul(p, v) / torch.where(win_sum > 0, win_sum, torch.ones_like(win_sum))
    return win_avg, win_sum, torch.matmul(lin_scores, v), lin_den


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
    output_final_state: bool = False,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState | None]:
    """Returns ``(o, final_state)``: the decode state after the T tokens when ``output_final_state``
    (by its definition, ``prefill_state``), else None. ``log_decay``: see ``reference_parts``."""
    check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask, log_decay)
    parts = reference_parts(q, k, v, window=window, feature_map=feature_map, key_padding_mask=key_padding_mask,
                            log_decay=log_decay)
    a, b = mixing_weights(window_logit, linear_logit)
    o = combine(formulation, a, b, *parts).to(q.dtype)
    if not output_final_state:
        return o, None
    from ..state import prefill_state  # (lazy: ops' modules import this one first)

    return o, prefill_state(k, v, window=window, feature_map=feature_map, key_padding_mask=key_padding_mask,
                            log_decay=log_decay)


def window_share(
    q: Tensor,
    k: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int = 64,
    formulation: str = "hybrid",
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
    query_positions: Tensor | None = None,
    log_decay: Tensor | None = None,
) -> Tensor:
    """Share of each query's output normalizer held by the softmax window, ``[B, H, Q]`` (fp32).

    With ``w_win``, ``w_lin`` from ``normalizer_weights`` it is ``w_win / (w_win + w_lin phi(q) z)``:
    the weight the window's average gets in the output, the rest going to the linear readout. It is
    the diagnostic that tells a hybrid that uses its linear part from one that drowns the window
    (share near 0) or bypasses the linear part (share near 1). Queries that see no key give NaN.
    An O(Q * T) computation: pass the few ``query_positions`` of interest for long sequences.
    """
    check_inputs(q, k, k, window_logit, linear_logit, window, formulation, key_padding_mask, log_decay)
    _, win_sum, _, lin_den = reference_parts(
        q, k, None, window=window, feature_map=feature_map, key_padding_mask=key_padding_mask,
        query_positions=query_positions, log_decay=log_decay,
    )
    a, b = mixing_weights(window_logit, linear_logit)
    w_win, w_lin = normalizer_weights(formulation, a, b, win_sum)
    den = w_win + w_lin * lin_den
    return torch.where(den > 0, w_win / den, torch.full_like(den, float("nan"))).squeeze(-1)
