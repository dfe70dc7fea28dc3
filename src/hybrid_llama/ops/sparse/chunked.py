"""A third memory for hybrid attention: a sparse cache of the keys the linear state recalls worst.

After LoLA (arXiv 2505.23666). Semantics (docs/design.md, "sparse cache"), for window w, cache size
λ per KV head, ``sinks`` pinned first positions, and the shared-normalizer (``lolcats``) formulation:

- keys in the window (t-w, t] are attended exactly, as without the cache;
- older keys at positions < ``sinks`` are pinned: attended exactly, never folded;
- older keys form blocks of w positions from ``sinks`` on. While a block is still filling (some of
  its keys are inside the window) its old keys are *pending*: attended exactly. When its last key
  leaves the window, the block closes: the candidates are the cache plus the block; the λ with the
  highest score stay in the cache, the rest are folded into the linear state ``S, z``. Nothing is
  dropped;
- the output is ``(a sum_E e^(s-m) v + b phi(q) S) / (a sum_E e^(s-m) + b phi(q) z)`` over the exact
  set E (sinks, cache, pending, window) with m its max score: the cache and the window share one
  normalizer with the linear part.

Scores (``cache_score``): ``sre``, the self-recall error ``|v - phi(k) S / (phi(k) z + eps)|`` of each
candidate against the state before the block is folded; ``random``, a fixed hash of (position,
KV head); ``attention``, the softmax weight each key has received from the queries so far
(summed over the query heads that read it), as in H2O.

This module holds the general torch path: one loop over the blocks, each step attending one group of
queries and then closing one block, with every tensor batched over (batch, KV heads); it covers
padding, the ``attention`` score and the normalizer's shares. Without those, ``batched``
computes the same op with every group in one product (training takes it), and ``native.sparse_prefill``
natively (CPU inference). The literal per-token simulation they are tested against lives in
``reference``; the recurrent step in ``step``.

A decaying linear state (``log_decay``) keeps every key p at gamma^(t - w - p) for query t, as
without the cache: the loop holds S, z as of its group's first position, a query reads them at
gamma^(its offset), a close ages them to its position and folds each loser at gamma^(its age).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..gqa import expand_kv
from ..hybrid.reference import combine, mixing_weights
from ..state import aged_sums, init_state
from .config import SparseCacheConfig
from .eviction import close_block, fold_weights, gather_slots, group_bounds
from .state import sparse_final_state


def hybrid_attention_sparse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int,
    cache: SparseCacheConfig,
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
    output_final_state: bool = False,
    return_shares: bool = False,
    log_decay: Tensor | None = None,
):
    """Hybrid attention with the sparse cache (``lolcats`` formulation): q ``[B, H, T, D]``, k/v
    ``[B, H_kv, T, D]``. Returns ``(o, final_state)`` (a ``HybridState`` with its ``sparse`` part, or
    None), plus, with ``return_shares``, the normalizer's shares ``[B, H, T, 3]`` of (window,
    sinks + cache + pending, linear state)."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
        if log_decay is not None:
            log_decay = log_decay.repeat_interleave(q.shape[1] // log_decay.shape[0])
    B, H, T, D = q.shape
    Hk, g, w, lam, ns = k.shape[1], H // k.shape[1], window, cache.size, cache.sinks
    lam_h = None if log_decay is None else log_decay.float().view(1, -1, 1, 1)  # log gamma, [1, Hk, 1, 1]
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    real = key_padding_mask if key_padding_mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    scale = 1.0 / math.sqrt(D)
    a, b = mixing_weights(window_logit, linear_logit)
    qf, kf, vf = q.float(), k.float(), v.float()
    F = phi_k_map(kf[:, :, :1]).shape[-1]
    S = kf.new_zeros(B, Hk, F, D)
    z = kf.new_zeros(B, Hk, F)
    acc = kf.new_zeros(B, Hk, T) if cache.score == "attention" else None
    cache_idx = torch.zeros(B, Hk, lam, dtype=torch.long, device=q.device)  # positions of the cached keys
    cache_ok = torch.zeros(B, Hk, lam, dtype=torch.bool, device=q.device)
    positions = torch.arange(T, device=q.device)
    sink_pos = positions[: min(ns, T)]
    outs, shares = [], []
    bounds = group_bounds(T, w, ns)
    # One split, and one gather of keys and of values per group: under autograd each slice or gather
    # of a whole [B, H, T, D] tensor gives back a zero-filled gradient of its full size, and a dozen per
    # group were most of the backward's time at 2048 tokens.
    q_groups = qf.split([t1 - t0 for t0, t1 in bounds], dim=2)
    every_head = lambda pos: pos.view(1, 1, -1).expand(B, Hk, -1)  # noqa: E731
    for J, ((t0, t1), q_group) in enumerate(zip(bounds, q_groups)):
        tq = positions[t0:t1]
        lo = max(0, t0 - w + 1)
        blk = positions[ns + J * w : min(T, ns + (J + 1) * w)]  # block J: pending while it fills
        slab = positions[lo:t1]
        # The exact keys of this group: [window slab | sinks | cache | block J], with a mask per query;
        # the last two parts are the candidates when block J closes.
        n_fixed = len(slab) + len(sink_pos)
        key_pos = torch.cat([every_head(slab), every_head(sink_pos), cache_idx, every_head(blk)], -1)
        keys, vals = gather_slots(kf, key_pos), gather_slots(vf, key_pos)
        m_win = (slab[None] <= tq[:, None]) & (slab[None] > tq[:, None] - w)
        m_sink = sink_pos[None] <= tq[:, None] - w
        m_blk = blk[None] <= tq[:, None] - w
        allowed = torch.cat([
            (m_win[None] & real[:, None, lo:t1]).unsqueeze(1).expand(B, Hk, -1, -1),
            (m_sink[None] & real[:, None, sink_pos]).unsqueeze(1).expand(B, Hk, -1, -1),
            cache_ok.unsqueeze(2).expand(B, Hk, t1 - t0, lam),
            (m_blk[None] & real[:, None, blk]).unsqueeze(1).expand(B, Hk, -1, -1),
        ], dim=-1)  # [B, Hk, nq, n_keys]
        qg = q_group.reshape(B, Hk, g, t1 - t0, D)
        scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hk, g, nq, n_keys]
        scores = scores.masked_fill(~allowed.unsqueeze(2), float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        exact_sum = p.sum(dim=-1, keepdim=True)
        safe_sum = torch.where(exact_sum > 0, exact_sum, torch.ones_like(exact_sum))
        exact_avg = torch.matmul(p, vals.unsqueeze(2)) / safe_sum
        phi_q = phi_q_map(q_group).reshape(B, Hk, g, t1 - t0, -1)
        if lam_h is not None:  # S, z are as of t0: a query reads them aged by its offset
            phi_q = phi_q * torch.exp(lam_h.unsqueeze(-1) * (tq - t0).float().view(1, 1, 1, -1, 1))
        lin_num = torch.matmul(phi_q, S.unsqueeze(2))
        lin_den = torch.matmul(phi_q, z.unsqueeze(2).unsqueeze(-1))
        per_head = [x.reshape(B, H, t1 - t0, -1) for x in (exact_avg, exact_sum, lin_num, lin_den)]
        outs.append(combine("lolcats", a, b, *per_head))
        if return_shares:
            n_win = t1 - lo
            parts = torch.stack([p[..., :n_win].sum(-1), p[..., n_win:].sum(-1)], -1).reshape(B, H, t1 - t0, 2)
            lin = b * per_head[3]
            den = a * parts.sum(-1, keepdim=True) + lin
            shares.append(torch.cat([a * parts, lin], -1) / torch.where(den > 0, den, torch.ones_like(den)))
        if acc is not None:
            with torch.no_grad():  # attention each key received: summed over the group's query heads
                weight = (p / safe_sum).sum(dim=(2, 3))
                acc.index_add_(2, slab, weight[..., : len(slab)])
                acc.scatter_add_(2, cache_idx, weight[..., n_fixed : n_fixed + lam])
                acc.index_add_(2, blk, weight[..., n_fixed + lam :])
        if t1 < T:
            # Block J closes where the next group starts: the cache and the block compete, the rest folds.
            cand_pos = key_pos[..., n_fixed:]
            cand_ok = torch.cat([cache_ok, real[:, None, blk].expand(B, Hk, -1)], -1)
            cand_acc = acc.gather(-1, cand_pos) if acc is not None else None
            S, z = aged_sums(S, z, log_decay, t1 - t0)  # as of t1, the close's position
            keep, cache_ok, S, z = close_block(
                cache.score, keys[:, :, n_fixed:], vals[:, :, n_fixed:], cand_ok, cand_pos, cand_acc,
                S, z, lam, phi_k_map, fold_weights(log_decay, t1, w, cand_pos),
            )
            cache_idx = cand_pos.gather(-1, keep)
    out = torch.cat(outs, dim=2).to(q.dtype)
    final = None
    if output_final_state:
        if bounds:  # as of the last position, as the decode step keeps them
            S, z = aged_sums(S, z, log_decay, T - 1 - bounds[-1][0])
        final = init_state(B, Hk, D, w, feature_dim=F, device=q.device, dtype=k.dtype)
        final = sparse_final_state(final, k, v, real, T, w, cache, S, z, cache_idx, cache_ok, acc)
    return (out, final, torch.cat(shares, dim=2)) if return_shares else (out, final)
