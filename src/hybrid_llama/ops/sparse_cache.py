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
padding, the ``attention`` score and the normalizer's shares. Without those, ``sparse_batched``
computes the same op with every group in one product (training takes it), and ``cpu_sparse``
natively (CPU inference). The literal per-token simulation they are tested against lives in
``sparse_reference``; the recurrent step in ``sparse_decode``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from .gqa import expand_kv
from .reference import combine, mixing_weights
from .state import HybridState, empty_sparse_state, init_state, key_feature_dim, window_prompt_state

CACHE_SCORES = ("sre", "random", "attention")
SRE_EPS = 1e-6


@dataclass(frozen=True)
class SparseCacheConfig:
    """The sparse cache's settings; ``size`` 0 and ``sinks`` 0 switch it off (the plain hybrid op)."""

    size: int = 0
    sinks: int = 0
    score: str = "sre"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"sparse cache size must be an integer >= 0, got {self.size!r}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if self.score not in CACHE_SCORES:
            raise ValueError(f"cache_score must be one of {CACHE_SCORES}, got {self.score!r}")

    @property
    def active(self) -> bool:
        return self.size > 0 or self.sinks > 0

    def softmax_prompt_len(self, window: int) -> int:
        """The longest prompt (without padding) in which no query sees a folded key, so the op is causal
        softmax over it: ``window`` without the cache. With it, block J closes at t = sinks + (J + 2) w
        - 1 among (J + 1) w candidates, and the first close with more than ``size`` of them folds."""
        if not self.active:
            return window
        return self.sinks + (self.size // window + 2) * window - 1

    @property
    def state_needs_queries(self) -> bool:
        """The ``attention`` score's state holds what each key received from the queries, so it cannot
        be built from the keys alone (``window_prompt_state``)."""
        return self.active and self.score == "attention"


def random_scores(pos: Tensor, kv_heads: int) -> Tensor:
    """A fixed pseudo-random score in [0, 1) per (position, KV head): ``pos`` ``[B, Hk, N]`` int64.
    Integer hashing, so the prefill and the decode step draw the same value for a key."""
    head = torch.arange(kv_heads, device=pos.device).view(1, -1, 1)
    h = (pos * 0x9E3779B1 + (head + 1) * 0x85EBCA77) & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    h = h ^ (h >> 12)
    return h.to(torch.float64).div(2.0**32).float()


def candidate_scores(
    rule: str, k: Tensor, v: Tensor, pos: Tensor, acc: Tensor | None, S: Tensor, z: Tensor, phi_k,
    fk: Tensor | None = None,
) -> Tensor:
    """Scores ``[B, Hk, N]`` of candidates k/v ``[B, Hk, N, D]`` at positions ``pos``: higher stays.
    ``fk``: ``phi_k(k)`` where the caller has it."""
    if rule == "sre":
        fk = phi_k(k.float()) if fk is None else fk  # [B, Hk, N, F]
        recall = torch.matmul(fk, S) / (torch.matmul(fk, z.unsqueeze(-1)) + SRE_EPS)
        return (v.float() - recall).norm(dim=-1)
    if rule == "random":
        return random_scores(pos, k.shape[1])
    return acc


def close_block(
    rule: str,
    cand_k: Tensor,
    cand_v: Tensor,
    cand_valid: Tensor,
    cand_pos: Tensor,
    cand_acc: Tensor | None,
    S: Tensor,
    z: Tensor,
    size: int,
    phi_k,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One eviction: keep the ``size`` best candidates (ties: the earlier position), fold the others.

    Candidates ``[B, Hk, N, ...]`` come in position order with empty/padding slots invalid. Returns
    (index of the kept candidates in position order ``[B, Hk, size]``, their validity, S', z')."""
    fk = phi_k(cand_k.float())  # the score's (sre) and the fold's: one feature map per candidate
    with torch.no_grad():
        score = candidate_scores(rule, cand_k, cand_v, cand_pos, cand_acc, S, z, phi_k, fk.detach())
        score = score.masked_fill(~cand_valid, float("-inf"))
        best = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :size]
        kept_pos = cand_pos.gather(-1, best).masked_fill(~cand_valid.gather(-1, best), torch.iinfo(torch.long).max)
        keep = best.gather(-1, kept_pos.argsort(dim=-1, stable=True))
    fold = folded_candidates(cand_valid, keep).unsqueeze(-1)
    fk = fk * fold
    S = S + torch.matmul(fk.transpose(-1, -2), cand_v.float())
    z = z + fk.sum(dim=2)
    return keep, cand_valid.gather(-1, keep), S, z


def folded_candidates(cand_valid: Tensor, keep: Tensor) -> Tensor:
    """The candidates a close folds into ``S, z``: the valid ones ``keep`` (``close_block``'s) leaves out."""
    return cand_valid & ~torch.zeros_like(cand_valid).scatter_(-1, keep, True)


def gather_slots(x: Tensor, index: Tensor) -> Tensor:
    """``x`` ``[B, Hk, N, D]`` at ``index`` ``[B, Hk, M]`` -> ``[B, Hk, M, D]``."""
    return x.gather(2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def group_bounds(T: int, window: int, sinks: int) -> list[tuple[int, int]]:
    """Query ranges [t0, t1) that see the same number J of closed blocks: group J ends where block J
    closes, at t = sinks + (J + 2) w - 1 (its last key leaves the window)."""
    bounds, t0, J = [], 0, 0
    while t0 < T:
        t1 = min(T, sinks + (J + 2) * window - 1)
        if t1 > t0:
            bounds.append((t0, t1))
        t0, J = max(t0, t1), J + 1
    return bounds


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
):
    """Hybrid attention with the sparse cache (``lolcats`` formulation): q ``[B, H, T, D]``, k/v
    ``[B, H_kv, T, D]``. Returns ``(o, final_state)`` (a ``HybridState`` with its ``sparse`` part, or
    None), plus, with ``return_shares``, the normalizer's shares ``[B, H, T, 3]`` of (window,
    sinks + cache + pending, linear state)."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
    B, H, T, D = q.shape
    Hk, g, w, lam, ns = k.shape[1], H // k.shape[1], window, cache.size, cache.sinks
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
            keep, cache_ok, S, z = close_block(
                cache.score, keys[:, :, n_fixed:], vals[:, :, n_fixed:], cand_ok, cand_pos, cand_acc,
                S, z, lam, phi_k_map,
            )
            cache_idx = cand_pos.gather(-1, keep)
    out = torch.cat(outs, dim=2).to(q.dtype)
    final = None
    if output_final_state:
        final = init_state(B, Hk, D, w, feature_dim=F, device=q.device, dtype=k.dtype)
        final = sparse_final_state(final, k, v, real, T, w, cache, S, z, cache_idx, cache_ok, acc)
    return (out, final, torch.cat(shares, dim=2)) if return_shares else (out, final)


def sparse_final_state(state, k, v, real, T, w, cache, S, z, cache_idx, cache_ok, acc):
    """The decode state after T tokens: ring, sinks, pending block, cache and the folded sums."""
    B, Hk, _, D = k.shape
    ns = cache.sinks
    sp = empty_sparse_state(B, Hk, D, w, cache.size, cache.sinks, device=k.device, dtype=k.dtype)
    ring_pos = torch.arange(max(T - w, 0), T, device=k.device)
    # Under autocast k and v can differ in dtype (RoPE widens k), the buffers hold k's: cast v.
    v = v.to(k.dtype)
    k_window, v_window, valid = state.k_window.clone(), state.v_window.clone(), state.window_valid.clone()
    k_window[:, :, ring_pos % w] = k[:, :, ring_pos]
    v_window[:, :, ring_pos % w] = v[:, :, ring_pos]
    valid[:, ring_pos % w] = real[:, ring_pos]
    old_sinks = torch.arange(min(ns, max(T - w, 0)), device=k.device)
    sp.sink_k[:, :, old_sinks], sp.sink_v[:, :, old_sinks] = k[:, :, old_sinks], v[:, :, old_sinks]
    sp.sink_valid[:, old_sinks] = real[:, old_sinks]
    n_old = max(T - w - ns, 0)  # non-sink keys that left the window
    pend = torch.arange(ns + (n_old // w) * w, ns + n_old, device=k.device)
    slots = (pend - ns) % w
    sp.pend_k[:, :, slots], sp.pend_v[:, :, slots] = k[:, :, pend], v[:, :, pend]
    sp.pend_valid[:, slots] = real[:, pend]
    sp.cache_k, sp.cache_v = gather_slots(k, cache_idx), gather_slots(v, cache_idx)
    sp.cache_valid, sp.cache_pos = cache_ok, cache_idx.masked_fill(~cache_ok, -1)
    if acc is not None:
        sp.pend_acc[:, :, slots] = acc[:, :, pend]
        sp.cache_acc = acc.gather(-1, cache_idx) * cache_ok
        sp.win_acc[:, :, ring_pos % w] = acc[:, :, ring_pos]
    sp = sp.map(lambda name, t: t.detach())
    return HybridState(k_window, v_window, valid, S.detach(), z.detach(), T, sparse=sp)




def softmax_prompt_state(k: Tensor, v: Tensor, *, window: int, cache: SparseCacheConfig,
                         feature_map: FeatureMap = "elu1") -> HybridState:
    """The state after a prompt of real keys ``[B, H_kv, T, D]`` that is causal softmax (T <=
    ``cache.softmax_prompt_len(window)``, a score other than ``attention``): what the op's final state
    would be, built from the keys alone. Inside the window that is ``window_prompt_state``; beyond it
    the closed blocks' keys all sit in the cache, in position order (no close had more candidates than
    slots), and the linear sums are zero."""
    B, Hk, T, D = k.shape
    if T <= window:
        return window_prompt_state(k, v, window=window, feature_map=feature_map, sparse_cache=cache.size,
                                   sinks=cache.sinks)
    if T > cache.softmax_prompt_len(window) or cache.state_needs_queries:
        raise ValueError(f"a prompt of {T} tokens folds keys (window {window}, {cache}): it is not causal softmax")
    closed = (len(group_bounds(T, window, cache.sinks)) - 1) * window  # keys of the blocks closed by T
    cache_idx = torch.zeros(B, Hk, cache.size, dtype=torch.long, device=k.device)
    cache_idx[..., :closed] = torch.arange(cache.sinks, cache.sinks + closed, device=k.device)
    cache_ok = torch.zeros(B, Hk, cache.size, dtype=torch.bool, device=k.device)
    cache_ok[..., :closed] = True
    state = init_state(B, Hk, D, window, feature_dim=key_feature_dim(feature_map, k), device=k.device, dtype=k.dtype)
    real = torch.ones(B, T, dtype=torch.bool, device=k.device)
    return sparse_final_state(state, k, v, real, T, window, cache, state.S, state.z, cache_idx, cache_ok, None)
