"""One decode step of hybrid attention with the sparse cache (semantics in ``sparse_cache``).

At the step of position t: the key at t - w leaves the window ring. A sink goes to its pinned slot;
any other key goes to the pending block, and when that block is full it closes (the cache and the
block compete, the losers fold into S, z). The new key takes the ring slot, and the query attends
the exact set (sinks, cache, pending, ring) and the linear state under one normalizer. Every buffer
has a fixed size, so the state does not grow with the context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, resolve_qk_maps
from ..hybrid.reference import combine, mixing_weights
from ..hybrid.step import check_step_shapes
from ..state import HybridState, SparseState, aged_sums, empty_sparse_state, init_state
from .config import SparseCacheConfig
from .eviction import close_block, fold_weights, gather_slots


def _put(buf: Tensor, slot: int, x: Tensor) -> Tensor:
    """``buf`` with time slot ``slot`` (dim 2, or dim 1 for [B, n] masks) replaced, out of place."""
    out = buf.clone()
    if buf.dim() == 2:
        out[:, slot] = x
    else:
        out[:, :, slot] = x
    return out


def init_sparse_state(
    batch: int, kv_heads: int, head_dim: int, window: int, cache: SparseCacheConfig, *, feature_dim: int | None = None,
    device=None, dtype=None,
) -> HybridState:
    state = init_state(batch, kv_heads, head_dim, window, feature_dim=feature_dim, device=device, dtype=dtype)
    state.sparse = empty_sparse_state(batch, kv_heads, head_dim, window, cache, device=device,
                                      dtype=dtype)
    return state


def hybrid_attention_step_sparse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: HybridState,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    cache: SparseCacheConfig,
    feature_map: FeatureMap = "elu1",
    key_valid: Tensor | None = None,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """q ``[B, H, 1, D]``, k/v ``[B, H_kv, 1, D]``; returns (out, new state). Functional: the old
    state is left as it was. ``log_decay`` ``[H_kv]``: the sums age by gamma first, then a close
    folds each loser at gamma^(its age), as the prefill paths do."""
    check_step_shapes(q, k, v, state)
    if state.sparse is None:
        B, Hk, w, D = state.k_window.shape
        if state.seen:
            raise ValueError("a state without a sparse part cannot continue with the sparse cache")
        state = init_sparse_state(B, Hk, D, w, cache, feature_dim=state.S.shape[-2], device=q.device,
                                  dtype=state.k_window.dtype)
    B, H, _, D = q.shape
    Hk, w, t = k.shape[1], state.window, state.seen
    lam, ns = cache.size, cache.sinks
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    new_valid = torch.ones(B, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.reshape(B).bool()
    # One shallow copy: the step replaces its fields, never writes into the old state's tensors.
    sp, S, z = state.sparse.map(lambda _, x: x), state.S, state.z
    S, z = aged_sums(S, z, log_decay, 1)
    ring = t % w
    if t >= w:  # position s = t - w leaves the ring
        s = t - w
        lk, lv = state.k_window[:, :, ring], state.v_window[:, :, ring]
        lvalid, lacc = state.window_valid[:, ring], sp.win_acc[:, :, ring]
        if s < ns:
            sp.sink_k, sp.sink_v = _put(sp.sink_k, s, lk), _put(sp.sink_v, s, lv)
            sp.sink_valid = _put(sp.sink_valid, s, lvalid)
        else:
            slot = (s - ns) % w
            sp.pend_k, sp.pend_v = _put(sp.pend_k, slot, lk), _put(sp.pend_v, slot, lv)
            sp.pend_valid, sp.pend_acc = _put(sp.pend_valid, slot, lvalid), _put(sp.pend_acc, slot, lacc)
            if slot == w - 1:  # the block is complete: close it
                S, z = close_pending_block(sp, S, z, t, w, cache, phi_k_map, log_decay)
    k_window = _put(state.k_window, ring, k[:, :, 0].to(state.k_window.dtype))
    v_window = _put(state.v_window, ring, v[:, :, 0].to(state.v_window.dtype))
    window_valid = _put(state.window_valid, ring, new_valid)
    win_acc = _put(sp.win_acc, ring, torch.zeros_like(sp.win_acc[:, :, 0]))

    # The exact set, one row per KV head: [ring | sinks | cache | pending].
    keys = torch.cat([k_window, sp.sink_k, sp.cache_k, sp.pend_k], 2).float()
    vals = torch.cat([v_window, sp.sink_v, sp.cache_v, sp.pend_v], 2).float()
    ok = torch.cat([
        window_valid[:, None].expand(B, Hk, w), sp.sink_valid[:, None].expand(B, Hk, ns), sp.cache_valid,
        sp.pend_valid[:, None].expand(B, Hk, w),
    ], -1)
    qg = q.float().reshape(B, Hk, H // Hk, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) / math.sqrt(D)  # [B, Hk, g, n]
    scores = scores.masked_fill(~ok[:, :, None], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    exact_sum = p.sum(dim=-1, keepdim=True)
    exact_avg = torch.matmul(p, vals) / torch.where(exact_sum > 0, exact_sum, torch.ones_like(exact_sum))
    phi_q = phi_q_map(q.float()).reshape(B, Hk, H // Hk, -1)
    lin_num, lin_den = torch.matmul(phi_q, S), torch.matmul(phi_q, z.unsqueeze(-1))
    a, b = mixing_weights(window_logit, linear_logit)
    per_head = [x.reshape(B, H, 1, -1) for x in (exact_avg, exact_sum, lin_num, lin_den)]
    out = combine("lolcats", a, b, *per_head)

    if cache.score == "attention":  # every exact key accumulates the weight it just received
        weight = (p / torch.where(exact_sum > 0, exact_sum, torch.ones_like(exact_sum))).sum(2).detach()
        win_acc = win_acc + weight[..., :w]
        sp.cache_acc = sp.cache_acc + weight[..., w + ns : w + ns + lam]
        sp.pend_acc = sp.pend_acc + weight[..., w + ns + lam :]
    sp.win_acc = win_acc
    return out.to(q.dtype), HybridState(k_window, v_window, window_valid, S, z, t + 1, sparse=sp)


def close_pending_block(sp: SparseState, S: Tensor, z: Tensor, t: int, window: int, cache: SparseCacheConfig,
                        phi_k_map, log_decay: Tensor | None) -> tuple[Tensor, Tensor]:
    """Close the full pending block at the step of position ``t`` (its last key, t - w, has just
    left the ring): the cache and the block compete, ``sp``'s cache and pending fields are replaced
    (never written into) and the losers fold into the returned S, z."""
    B, Hk, w = sp.pend_k.shape[0], sp.pend_k.shape[1], window
    s = t - w
    blk_pos = torch.arange(s - (w - 1), s + 1, device=S.device).view(1, 1, -1).expand(B, Hk, -1)
    cand_k = torch.cat([sp.cache_k, sp.pend_k], 2)
    cand_v = torch.cat([sp.cache_v, sp.pend_v], 2)
    cand_ok = torch.cat([sp.cache_valid, sp.pend_valid[:, None].expand(B, Hk, w)], -1)
    cand_pos = torch.cat([sp.cache_pos.clamp(min=0), blk_pos], -1)
    cand_acc = torch.cat([sp.cache_acc, sp.pend_acc], -1)
    keep, ok, S, z = close_block(cache.score, cand_k, cand_v, cand_ok, cand_pos, cand_acc, S, z, cache.size,
                                 phi_k_map, fold_weights(log_decay, t, w, cand_pos))
    sp.cache_k, sp.cache_v = gather_slots(cand_k, keep), gather_slots(cand_v, keep)
    sp.cache_valid, sp.cache_acc = ok, cand_acc.gather(-1, keep)
    sp.cache_pos = cand_pos.gather(-1, keep).masked_fill(~ok, -1)
    sp.pend_valid = torch.zeros_like(sp.pend_valid)
    sp.pend_acc = torch.zeros_like(sp.pend_acc)
    return S, z
