"""The sparse cache's parallel op as two passes: the evictions first, then every group at once.

Which keys a query reads exactly and which it reads through the linear state depends on the
evictions, and they are chosen without gradients (``close_block`` scores under ``no_grad``). Once
they are known, the op is fixed masks and sums: a key is exact for every query before the group
that follows its fold, and linear from there on. So:

1. ``plan_evictions``: the block loop of ``sparse_cache`` with nothing but the closes in it, without
   autograd. It records, per group, the cached positions, and per close, the w positions it folds.
2. One batched pass over the groups, differentiable: each group's exact keys ``[sinks | cache |
   slab]`` are gathered into one tensor (the slab is the 2w - 1 positions from block J's start,
   under a fixed causal band), scores and products run as one batched matmul for all groups, and
   the state each group reads is an exclusive prefix sum of the folds' increments.

The queries before the first group (positions < sinks + w - 1) read every earlier key exactly:
causal softmax, SDPA's. The loop in ``sparse_cache`` attends one group per iteration with about 40
tensor ops; under autograd each is a node of the backward too, and their number, not the arithmetic,
is what made the cache-active distillation slower than the plain one (docs/performance.md). Same
semantics, same evictions (the same ``close_block`` calls on the same values). Covered: no padding
mask, the ``sre`` and ``random`` scores; the ``attention`` score needs every query's weights before
each close, so it keeps the loop, as padding and the normalizer's shares do.

A decaying linear state (``log_decay``): the closes are w apart, so the state group J reads, as of
its first position (close J - 1's), is a prefix sum with gamma^(w (J - 1 - J')) on close J''s
increment, whose keys enter at gamma^(their age at the close); a query reads it at gamma^(its
offset in the group).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..gqa import expand_kv
from ..hybrid.reference import mixing_weights
from ..state import HybridState, aged_sums, init_state
from .eviction import close_block, fold_weights, folded_candidates, gather_slots
from .state import sparse_final_state

GROUPS_PER_SLAB = 32  # groups attended per batched product: bounds the scores' memory at long prompts


def covers(cache, key_padding_mask: Tensor | None, return_shares: bool) -> bool:
    """Whether :func:`hybrid_attention_sparse_batched` takes these options."""
    return key_padding_mask is None and cache.score != "attention" and not return_shares


@dataclass
class Evictions:
    """What ``plan_evictions`` decided for a prompt of T tokens, G uniform groups (see the module doc).

    ``cache_pos``/``cache_ok`` ``[B, Hk, G, λ]``: the cached positions each group reads; ``fold_pos``/
    ``fold_ok`` ``[B, Hk, G - 1, w]``: the positions close J folds into the state (after group J);
    ``S, z`` and ``final_pos``/``final_ok`` ``[B, Hk, λ]``: the sums and the cache after the last close
    (what the decode state continues from)."""

    cache_pos: Tensor
    cache_ok: Tensor
    fold_pos: Tensor
    fold_ok: Tensor
    S: Tensor
    z: Tensor
    final_pos: Tensor
    final_ok: Tensor


def first_group_start(window: int, sinks: int) -> int:
    """Where the first group of w queries starts (its last query is the last before block 0 closes,
    at sinks + 2w - 1, as in ``group_bounds``); queries before it read every earlier key exactly."""
    return sinks + window - 1


def close_position(J: int, window: int, sinks: int) -> int:
    """The position at which block J closes (its last key leaves the window; ``group_bounds``)."""
    return sinks + (J + 2) * window - 1


@torch.no_grad()
def plan_evictions(k: Tensor, v: Tensor, T: int, window: int, cache, phi_k,
                   log_decay: Tensor | None = None) -> Evictions:
    """The closes of ``sparse_cache``'s block loop (same calls, same values), recorded per group.
    k/v ``[B, Hk, T, D]`` fp32. With ``log_decay``, ``S, z`` are as of the last close's position."""
    B, Hk, _, D = k.shape
    w, lam, ns = window, cache.size, cache.sinks
    G = -(-(T - first_group_start(w, ns)) // w)
    Fd = phi_k(k[:, :, :1]).shape[-1]
    S, z = k.new_zeros(B, Hk, Fd, D), k.new_zeros(B, Hk, Fd)
    idx = torch.zeros(B, Hk, lam, dtype=torch.long, device=k.device)
    ok = torch.zeros(B, Hk, lam, dtype=torch.bool, device=k.device)
    cache_pos, cache_ok, fold_pos, fold_ok = [idx], [ok], [], []
    every_head = torch.ones(B, Hk, w, dtype=torch.bool, device=k.device)
    for J in range(G - 1):  # close J runs between group J and group J + 1
        blk = torch.arange(ns + J * w, ns + (J + 1) * w, device=k.device).view(1, 1, w).expand(B, Hk, w)
        cand_pos = torch.cat([idx, blk], -1)
        cand_ok = torch.cat([ok, every_head], -1)
        cand_k, cand_v = gather_slots(k, cand_pos), gather_slots(v, cand_pos)
        if J:  # as of this close, w positions after the last
            S, z = aged_sums(S, z, log_decay, w)
        keep, ok, S, z = close_block(cache.score, cand_k, cand_v, cand_ok, cand_pos, None, S, z, lam, phi_k,
                                     fold_weights(log_decay, close_position(J, w, ns), w, cand_pos))
        folded = folded_candidates(cand_ok, keep)
        # At most w of the λ + w candidates fold (λ stay); in position order, padded with invalid slots.
        order = (~folded).to(torch.int8).argsort(dim=-1, stable=True)[..., :w]
        fold_pos.append(cand_pos.gather(-1, order))
        fold_ok.append(folded.gather(-1, order))
        idx = cand_pos.gather(-1, keep)
        cache_pos.append(idx)
        cache_ok.append(ok)
    empty = torch.zeros(B, Hk, 0, w, dtype=torch.long, device=k.device)
    return Evictions(
        torch.stack(cache_pos, 2), torch.stack(cache_ok, 2),
        torch.stack(fold_pos, 2) if fold_pos else empty, torch.stack(fold_ok, 2) if fold_ok else empty.bool(),
        S, z, idx, ok,
    )


def _gather_groups(x: Tensor, pos: Tensor) -> Tensor:
    """``x`` ``[B, Hk, T, D]`` at ``pos`` ``[B, Hk, G, N]`` -> ``[B, Hk, G, N, D]``."""
    B, Hk, G, N = pos.shape
    flat = pos.reshape(B, Hk, G * N, 1).expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, flat).view(B, Hk, G, N, x.shape[-1])


def _per_group(x: Tensor, kv_heads: int, g: int, w: int) -> Tensor:
    """Query-head rows ``[B, H, G * w, X]`` -> ``[B, Hk, G, g * w, X]``: a group's g query heads stacked."""
    B, _, n, X = x.shape
    return x.reshape(B, kv_heads, g, n // w, w, X).transpose(2, 3).reshape(B, kv_heads, n // w, g * w, X)


def _from_groups(y: Tensor, g: int, w: int) -> Tensor:
    """The inverse of :func:`_per_group`: ``[B, Hk, G, g * w, X]`` -> ``[B, H, G * w, X]``."""
    B, Hk, G, _, X = y.shape
    return y.view(B, Hk, G, g, w, X).transpose(2, 3).reshape(B, Hk * g, G * w, X)


def hybrid_attention_sparse_batched(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int,
    cache,
    feature_map: FeatureMap = "elu1",
    output_final_state: bool = False,
    log_decay: Tensor | None = None,
    planner: Callable[..., Evictions] | None = None,
) -> tuple[Tensor, HybridState | None]:
    """``(o, final_state)`` of the sparse-cache op (``lolcats`` formulation, no padding, the ``sre`` or
    ``random`` score): q ``[B, H, T, D]``, k/v ``[B, H_kv, T, D]``; what ``hybrid_attention_sparse``
    returns, with autograd through the attention, the folds, the feature maps and ``log_decay``.
    ``planner``: what computes the evictions, :func:`plan_evictions` or its triton kernel
    (``ops.triton.sparse_plan``), which takes the same arguments."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
        if log_decay is not None:
            log_decay = log_decay.repeat_interleave(q.shape[1] // log_decay.shape[0])
    B, H, T, D = q.shape
    Hk, w, ns = k.shape[1], window, cache.sinks
    g = H // Hk
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    qf, kf, vf = q.float(), k.float(), v.float()
    p0 = min(first_group_start(w, ns), T)
    # Before the first group every earlier key is exact (no block has closed): causal softmax.
    head = F.scaled_dot_product_attention(qf[:, :, :p0], kf[:, :, :p0], vf[:, :, :p0], is_causal=True,
                                          enable_gqa=g > 1)
    plan = ((planner or plan_evictions)(kf.detach(), vf.detach(), T, w, cache, phi_k_map,
                                        None if log_decay is None else log_decay.detach())
            if T > p0 or output_final_state else None)
    lam = None if log_decay is None else log_decay.float()
    outs = [head]
    if T > p0:
        G = plan.cache_pos.shape[2]
        Tp = p0 + G * w
        qp, kp, vp = (F.pad(x, (0, 0, 0, Tp - T)) for x in (qf, kf, vf))
        # The linear state each group reads: the increments phi(k)^T [v, 1] of the folds before it.
        if G > 1:
            fk = phi_k_map(_gather_groups(kf, plan.fold_pos).flatten(2, 3)).unflatten(2, (G - 1, w))
            fk = fk * plan.fold_ok.unsqueeze(-1)
            fv = _gather_groups(vf, plan.fold_pos)
            if lam is not None:  # a folded key enters at gamma^(its age at its close)
                closes = torch.tensor([close_position(J, w, ns) for J in range(G - 1)], device=q.device)
                age = (closes.view(1, 1, -1, 1) - w - plan.fold_pos).clamp(min=0).float()
                fk = fk * torch.exp(lam.view(1, -1, 1, 1) * age).unsqueeze(-1)
            inc = torch.matmul(fk.transpose(-1, -2), torch.cat([fv, torch.ones_like(fv[..., :1])], -1))
            if lam is None:
                states = F.pad(inc.cumsum(dim=2), (0, 0, 0, 0, 1, 0))  # [B, Hk, G, F, D + 1], exclusive
            else:  # group J (J >= 1) reads close J' < J's increment at gamma^(w (J - 1 - J'))
                Jr = torch.arange(G, device=q.device, dtype=torch.float32)
                diff = Jr[:, None] - 1 - Jr[None, :-1]  # [G, G - 1]
                prefix = torch.exp(lam.view(-1, 1, 1) * w * diff.clamp(min=0)) * (diff >= 0)  # [Hk, G, G - 1]
                states = torch.matmul(prefix, inc.flatten(3)).unflatten(3, inc.shape[3:])
        else:  # no close yet: the state is empty
            states = kf.new_zeros(B, Hk, 1, plan.S.shape[-2], D + 1)
        a, b = mixing_weights(window_logit, linear_logit)
        a, b = a.view(1, Hk, 1, g, 1, 1), b.view(1, Hk, 1, g, 1, 1)
        scale = 1.0 / math.sqrt(D)
        # Slot c of group J's slab is position sinks + J w + c; query row i is sinks + (J + 1) w - 1 + i.
        band = torch.arange(2 * w - 1, device=q.device)[None] <= torch.arange(w, device=q.device)[:, None] + w - 1
        band_bias = torch.zeros(g * w, 2 * w - 1, device=q.device).masked_fill_(~band.repeat(g, 1), float("-inf"))
        sink_k, sink_v = kf[:, :, None, :ns], vf[:, :, None, :ns]
        # Slab J covers [sinks + J w, sinks + (J + 2) w - 1): overlapping windows of the keys from the sinks on.
        slab_k = kp[:, :, ns:].unfold(2, 2 * w - 1, w).transpose(-1, -2)  # [B, Hk, G, 2w - 1, D] (a view)
        slab_v = vp[:, :, ns:].unfold(2, 2 * w - 1, w).transpose(-1, -2)
        for s0 in range(0, G, GROUPS_PER_SLAB):
            s1 = min(G, s0 + GROUPS_PER_SLAB)
            n = s1 - s0
            pos = plan.cache_pos[:, :, s0:s1]
            keys = torch.cat([sink_k.expand(-1, -1, n, -1, -1), _gather_groups(kf, pos), slab_k[:, :, s0:s1]], 3)
            vals = torch.cat([sink_v.expand(-1, -1, n, -1, -1), _gather_groups(vf, pos), slab_v[:, :, s0:s1]], 3)
            # The mask as an additive bias, fused into the scores' product (no gradient flows to it).
            bias = torch.cat([
                band_bias.new_zeros(1, 1, 1, 1, ns).expand(B, Hk, n, g * w, ns),
                torch.where(plan.cache_ok[:, :, s0:s1, None], 0.0, float("-inf")).expand(-1, -1, -1, g * w, -1),
                band_bias.expand(B, Hk, n, -1, -1),
            ], -1)
            qs = qp[:, :, p0 + s0 * w : p0 + s1 * w]
            rows = B * Hk * n
            scores = torch.baddbmm(bias.view(rows, g * w, -1), _per_group(qs, Hk, g, w).reshape(rows, g * w, D),
                                   keys.reshape(rows, -1, D).transpose(1, 2), alpha=scale)
            # Every row keeps its own key, so none is empty. The shared normalizer weighs the sum
            # sum_j exp(s_j - max s) = 1 / max_j p_j (as in `chunked`): one fused softmax gives both.
            p = torch.softmax(scores, dim=-1)
            exact_sum = (1.0 / p.amax(dim=-1, keepdim=True)).view(B, Hk, n, g, w, 1)
            exact_avg = torch.bmm(p, vals.reshape(rows, -1, D)).view(B, Hk, n, g, w, D)
            phi_q = _per_group(phi_q_map(qs), Hk, g, w)  # [B, Hk, n, g w, F]
            if lam is not None:  # the state is as of the group's first position: row i reads it at gamma^i
                offsets = torch.arange(w, device=q.device, dtype=torch.float32).repeat(g)
                phi_q = phi_q * torch.exp(lam.view(1, -1, 1, 1, 1) * offsets.view(1, 1, 1, -1, 1))
            lin = torch.matmul(phi_q, states[:, :, s0:s1]).unflatten(3, (g, w))
            w_win = exact_sum * a
            out = torch.addcmul(exact_avg * w_win, lin[..., :D], b) / torch.addcmul(w_win, lin[..., D:], b)
            outs.append(_from_groups(out.flatten(3, 4), g, w))
    out = torch.cat(outs, dim=2)[:, :, :T].to(q.dtype)
    final = None
    if output_final_state:
        S, z = plan.S, plan.z
        n_closes = plan.fold_pos.shape[2]
        if lam is not None and n_closes:  # as of the last position, as the decode step keeps them
            S, z = aged_sums(S, z, lam.detach(), T - 1 - close_position(n_closes - 1, w, ns))
        final = init_state(B, Hk, D, w, feature_dim=plan.S.shape[-2], device=q.device, dtype=k.dtype)
        real = torch.ones(B, T, dtype=torch.bool, device=q.device)
        final = sparse_final_state(final, k, v, real, T, w, cache, S, z, plan.final_pos, plan.final_ok, None)
    return out, final
