"""A decode state with the sparse cache continued by several tokens at once.

The exact set only grows between two block closes: a key that leaves the window becomes pending (or
a sink) and stays exact until its block closes. So the new tokens split at the steps that close a
block (t = sinks + (J + 2) w - 1, as ``eviction.group_bounds``), and each segment [a, b) is:

1. the bookkeeping of its L steps at once: the step of a moves the key a - w out of the ring and,
   when that completes the pending block, closes it (``step.close_pending_block``, the one close of
   the segment); the keys a - w + 1 .. b - 1 - w then go to their sink or pending slots, and the ring
   ends holding b - w .. b - 1;
2. one masked product: query t reads exactly every key of the exact set after b - 1 at a position
   <= t, and linearly the sums as the close at a left them, aged by gamma^(t - a).

That is what ``hybrid_attention_step_sparse`` computes step by step (up to the order of fp32 sums),
for the ``sre`` and ``random`` scores and real keys; the ``attention`` score adds each query's
weights to the keys before the next close, which the layer leaves to the step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, resolve_qk_maps
from ..hybrid.continuation import check_continuation, ring_from_ordered, ring_in_order
from ..hybrid.reference import combine, mixing_weights
from ..state import HybridState, aged_sums
from .config import SparseCacheConfig
from .step import close_pending_block


def closes_block(t: int, window: int, sinks: int) -> bool:
    """Whether the step of position ``t`` closes a block (its key t - w is a block's last)."""
    s = t - window
    return s >= sinks and (s - sinks) % window == window - 1


def covers(cache: SparseCacheConfig, state: HybridState) -> bool:
    """Whether this continuation computes the step's result for ``cache`` and ``state``."""
    return cache.score != "attention" and state.sparse is not None


def hybrid_attention_continue_sparse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: HybridState,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    cache: SparseCacheConfig,
    feature_map: FeatureMap = "elu1",
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """q ``[B, H, L, D]``, k/v ``[B, H_kv, L, D]`` (every new key real) continuing a sparse-cache
    ``state``; returns (out, the state after them) as L calls of ``hybrid_attention_step_sparse``.
    The given state is left as it was."""
    if not covers(cache, state):
        raise ValueError("the continuation covers the sre and random scores of a state with a sparse part")
    check_continuation(q, k, v, state, feature_map)
    t0, L, w = state.seen, q.shape[2], state.window
    starts = [t0] + [t for t in range(t0 + 1, t0 + L) if closes_block(t, w, cache.sinks)]
    outs = []
    for a, b in zip(starts, [*starts[1:], t0 + L]):
        part = slice(a - t0, b - t0)
        o, state = _segment(q[:, :, part], k[:, :, part], v[:, :, part], state, window_logit, linear_logit, cache,
                            feature_map, log_decay)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), state


def _segment(q, k, v, state: HybridState, window_logit, linear_logit, cache: SparseCacheConfig, feature_map,
             log_decay):
    B, H, n, D = q.shape
    Hk, w, a = k.shape[1], state.window, state.seen
    b, ns, g = a + n, cache.sinks, H // Hk
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    sp = state.sparse.map(lambda _, x: x)  # fields are replaced, never written into
    ring_k, ring_v, ring_ok = ring_in_order(state)
    keys = torch.cat([ring_k, k.to(ring_k.dtype)], 2)  # E: positions a - w .. b - 1
    vals = torch.cat([ring_v, v.to(ring_v.dtype)], 2)
    ok = torch.cat([ring_ok, torch.ones(B, n, dtype=torch.bool, device=q.device)], 1)

    # 1. The steps' bookkeeping: the key of each position s = t - w leaves the ring at step t.
    S, z = aged_sums(state.S, state.z, log_decay, 1)
    leaving = range(max(a - w, 0), b - w)  # E index s - (a - w)
    for s in leaving[:1]:
        if s >= ns and closes_block(a, w, ns):  # the block's last key, then its close
            sp.pend_k, sp.pend_v, sp.pend_valid = _placed(sp.pend_k, sp.pend_v, sp.pend_valid, [w - 1],
                                                          keys, vals, ok, [s - (a - w)])
            S, z = close_pending_block(sp, S, z, a, w, cache, phi_k_map, log_decay)
            leaving = leaving[1:]
    sinks = [s for s in leaving if s < ns]
    blocks = [s for s in leaving if s >= ns]
    if sinks:
        sp.sink_k, sp.sink_v, sp.sink_valid = _placed(sp.sink_k, sp.sink_v, sp.sink_valid, sinks, keys, vals, ok,
                                                      [s - (a - w) for s in sinks])
    if blocks:
        sp.pend_k, sp.pend_v, sp.pend_valid = _placed(sp.pend_k, sp.pend_v, sp.pend_valid,
                                                      [(s - ns) % w for s in blocks], keys, vals, ok,
                                                      [s - (a - w) for s in blocks])

    # 2. The queries against the exact set after b - 1: [ring | sinks | cache | pending], by position.
    last_left = b - 1 - w
    block_start = ns + ((last_left - ns) // w) * w if last_left >= ns else ns
    arange = lambda lo, m: torch.arange(lo, lo + m, device=q.device).view(1, 1, m).expand(B, Hk, m)  # noqa: E731
    pos = torch.cat([arange(b - w, w), arange(0, ns), sp.cache_pos, arange(block_start, w)], -1)
    exact_ok = torch.cat([ok[:, None, n:].expand(B, Hk, w), sp.sink_valid[:, None].expand(B, Hk, ns), sp.cache_valid,
                          sp.pend_valid[:, None].expand(B, Hk, w)], -1)
    ex_k = torch.cat([keys[:, :, n:], sp.sink_k, sp.cache_k, sp.pend_k], 2).float()
    ex_v = torch.cat([vals[:, :, n:], sp.sink_v, sp.cache_v, sp.pend_v], 2).float()
    t = torch.arange(a, b, device=q.device).view(1, 1, 1, n, 1)
    visible = exact_ok[:, :, None, None, :] & (pos[:, :, None, None, :] <= t)  # [B, Hk, 1, n, N]
    qg = q.float().reshape(B, Hk, g * n, D)
    scores = (torch.matmul(qg, ex_k.transpose(-1, -2)) / math.sqrt(D)).view(B, Hk, g, n, -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    exact_sum = p.sum(dim=-1, keepdim=True)
    exact_avg = torch.matmul(p, ex_v[:, :, None]) / torch.where(exact_sum > 0, exact_sum, torch.ones_like(exact_sum))
    phi_q = phi_q_map(q.float()).reshape(B, Hk, g, n, -1)
    lin_num, lin_den = torch.matmul(phi_q, S[:, :, None]), torch.matmul(phi_q, z[:, :, None, :, None])
    if log_decay is not None:  # query t reads the sums of step a aged by the t - a steps since
        age = torch.exp(log_decay.float().view(1, Hk, 1, 1, 1) * (t - a).float())
        lin_num, lin_den = lin_num * age, lin_den * age
    a_mix, b_mix = mixing_weights(window_logit, linear_logit)
    per_head = [x.reshape(B, H, n, -1) for x in (exact_avg, exact_sum, lin_num, lin_den)]
    out = combine("lolcats", a_mix, b_mix, *per_head)

    S, z = aged_sums(S, z, log_decay, n - 1)
    k_ring, v_ring, ring_valid = ring_from_ordered(keys[:, :, n:], vals[:, :, n:], ok[:, n:], b)
    new_state = HybridState(k_ring.contiguous(), v_ring.contiguous(), ring_valid.contiguous(), S.contiguous(),
                            z.contiguous(), b, sparse=sp, all_real=state.all_real)
    return out.to(q.dtype), new_state


def _placed(buf_k: Tensor, buf_v: Tensor, buf_ok: Tensor, slots: list[int], keys: Tensor, vals: Tensor,
            ok: Tensor, rows: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Copies of the buffers ``[B, Hk, n, D]`` / ``[B, n]`` with ``slots`` holding E's ``rows``."""
    dev = keys.device
    slot_idx, row_idx = torch.tensor(slots, device=dev), torch.tensor(rows, device=dev)
    return (buf_k.index_copy(2, slot_idx, keys.index_select(2, row_idx)),
            buf_v.index_copy(2, slot_idx, vals.index_select(2, row_idx)),
            buf_ok.index_copy(1, slot_idx, ok.index_select(1, row_idx)))
