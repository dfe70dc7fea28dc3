"""The sparse cache's evictions on the GPU: ``sparse.batched.plan_evictions`` as one triton kernel.

The batched sparse op attends every group at once, but the closes that decide what each group reads
run one after another: close J scores its candidates against the state that closes 0 .. J - 1
left. In torch each close is a hundred-odd small device ops, so a long prompt's plan is bound by
launching them (docs/triton.md has the numbers). Here one program per (batch row, KV head) runs
every close of the prompt in a loop, its state ``S, z`` in registers:

1. the λ + w candidates (the cache, then block J) are loaded by position, 64 at a time: their key
   features (``phi_k`` of every key, computed once in torch beforehand, so learned maps keep their
   own code) and values;
2. each gets its score, ``sre`` (``|v - phi(k) S / (phi(k) z + eps)|``) or ``random`` (the same
   integer hash as ``eviction.random_scores``), -inf where the slot is empty;
3. a candidate's rank is the number that beat it (higher score, or an equal score at an earlier
   slot, as the stable sort of ``close_block``), counted a block of columns at a time; the λ best
   stay, in position order, the empty ones last;
4. the others fold into ``S, z`` at their weight (gamma^(age) with a decay), and their positions are
   recorded in position order for the batched pass.

Same decisions as ``close_block``: same candidates, same order, same ties. The scores agree to fp32
rounding (the products are exact fp32, ``ieee``), so only a near-tie could keep another key, as for
the native CPU close. Covered: the ``sre`` and ``random`` scores, feature and head widths that are
powers of two with an ``[F, D]`` state up to 128 x 128; anything else raises NotImplementedError
and the caller plans in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..sparse.batched import Evictions, first_group_start
from ..sparse.eviction import SRE_EPS
from .common import MAX_STATE_ELEMENTS, check_device

SCORES = ("sre", "random")


@triton.jit
def _random_score(pos, head):
    """``eviction.random_scores`` for int64 positions: the same hash, the same float."""
    h = (pos * 0x9E3779B1 + (head + 1) * 0x85EBCA77) & 0xFFFFFFFF
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    h = h ^ (h >> 12)
    return (h.to(tl.float64) / 4294967296.0).to(tl.float32)


@triton.jit
def _candidates(cpos_ptr, cok_ptr, cache_row, cc, block_start, W: tl.constexpr, LAM: tl.constexpr):
    """Candidate slots ``cc`` of a close: (position, holds a key, is a slot at all). Slots below λ are
    the cache group J reads (``cache_row`` its offset), the next w the block from ``block_start``,
    the rest padding (position 0, empty)."""
    in_cache = cc < LAM
    real = cc < LAM + W
    cached = tl.load(cpos_ptr + cache_row + cc, mask=in_cache, other=0)
    cached_ok = tl.load(cok_ptr + cache_row + cc, mask=in_cache, other=0) != 0
    pos = tl.where(in_cache, cached, block_start + (cc - LAM))
    return tl.where(real, pos, 0), tl.where(in_cache, cached_ok, real), real


@triton.jit
def _plan_kernel(
    fk_ptr, v_ptr, lam_ptr,
    cpos_ptr, cok_ptr, fpos_ptr, fok_ptr, s_ptr, z_ptr, scratch_ptr,
    HKV, n_keys, n_closes, sinks, eps,
    W: tl.constexpr, LAM: tl.constexpr, C: tl.constexpr, F: tl.constexpr, D: tl.constexpr,
    ROWS: tl.constexpr, RANK_BLOCK: tl.constexpr, SRE: tl.constexpr, DECAY: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    hk = bh % HKV
    c = tl.arange(0, C)  # candidate slots: the cache's λ, then the block's w, then padding
    f = tl.arange(0, F)
    d = tl.arange(0, D)
    fk_base = fk_ptr + bh * n_keys * F
    v_base = v_ptr + bh * n_keys * D
    scores = scratch_ptr + bh * 2 * C  # per close: the candidates' scores, then their fold weights
    weights = scores + C
    cache_base = bh * (n_closes + 1) * LAM  # [G, λ] of this (row, head); group 0 reads an empty cache
    fold_base = bh * n_closes * W
    S = tl.zeros([F, D], dtype=tl.float32)
    z = tl.zeros([F], dtype=tl.float32)
    if DECAY:
        log_gamma = tl.load(lam_ptr + hk)
    for J in range(0, n_closes):
        cache_row = cache_base + J * LAM
        block_start = sinks + J * W
        if DECAY:
            if J > 0:  # S, z as of this close, w positions after the last
                age = tl.exp(log_gamma * W)
                S = S * age
                z = z * age
        # Scores, ROWS candidates at a time (the [ROWS, F] features and their product with S are the
        # kernel's largest tiles).
        for c0 in tl.static_range(0, C, ROWS):
            cc = c0 + tl.arange(0, ROWS)
            pos, valid, real = _candidates(cpos_ptr, cok_ptr, cache_row, cc, block_start, W, LAM)
            if SRE:
                fk = tl.load(fk_base + pos[:, None] * F + f[None, :], mask=real[:, None], other=0.0)
                vv = tl.load(v_base + pos[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
                num = tl.dot(fk, S, input_precision="ieee")
                den = tl.sum(fk * z[None, :], axis=1) + eps
                err = vv - num / den[:, None]
                score = tl.sqrt(tl.sum(err * err, axis=1))
            else:
                score = _random_score(pos, hk)
            tl.store(scores + cc, tl.where(valid, score, float("-inf")))
        tl.debug_barrier()
        pos, valid, real = _candidates(cpos_ptr, cok_ptr, cache_row, c, block_start, W, LAM)
        score = tl.load(scores + c)
        # Rank = how many beat it: a higher score, or the same score at an earlier slot (stable sort),
        # RANK_BLOCK columns at a time, so that no C x C flags sit in registers.
        rank = tl.zeros([C], dtype=tl.int32)
        for j0 in tl.static_range(0, C, RANK_BLOCK):
            cj = j0 + tl.arange(0, RANK_BLOCK)
            s_j = tl.load(scores + cj)[None, :]
            beaten = (s_j > score[:, None]) | ((s_j == score[:, None]) & (cj[None, :] < c[:, None]))
            rank += tl.sum(beaten.to(tl.int32), axis=1)
        keep = (rank < LAM) & real
        # The new cache in position order (candidates already are), its empty slots last.
        kept_valid = keep & valid
        kept_empty = keep & ~valid
        n_kept_valid = tl.sum(kept_valid.to(tl.int32), axis=0)
        slot = tl.where(kept_valid, tl.cumsum(kept_valid.to(tl.int32), axis=0) - 1,
                        n_kept_valid + tl.cumsum(kept_empty.to(tl.int32), axis=0) - 1)
        next_cache = cache_base + (J + 1) * LAM + slot
        tl.store(cpos_ptr + next_cache, pos, mask=keep)
        tl.store(cok_ptr + next_cache, valid.to(tl.int8), mask=keep)
        # The folded ones, in position order, then the rest, the first w recorded.
        folded = valid & ~keep
        n_folded = tl.sum(folded.to(tl.int32), axis=0)
        rest = real & ~folded
        fslot = tl.where(folded, tl.cumsum(folded.to(tl.int32), axis=0) - 1,
                         n_folded + tl.cumsum(rest.to(tl.int32), axis=0) - 1)
        recorded = real & (fslot < W)
        tl.store(fpos_ptr + fold_base + J * W + fslot, pos, mask=recorded)
        tl.store(fok_ptr + fold_base + J * W + fslot, folded.to(tl.int8), mask=recorded)
        weight = folded.to(tl.float32)
        if DECAY:  # a folded key enters at gamma^(its age at this close)
            close_t = sinks + (J + 2) * W - 1
            weight = weight * tl.exp(log_gamma * tl.maximum(close_t - W - pos, 0).to(tl.float32))
        tl.store(weights + c, weight)
        tl.debug_barrier()
        # The folds into S, z, ROWS candidates at a time (group J's cache is read again: close J
        # wrote group J + 1's).
        for c0 in tl.static_range(0, C, ROWS):
            cc = c0 + tl.arange(0, ROWS)
            pos, _, real = _candidates(cpos_ptr, cok_ptr, cache_row, cc, block_start, W, LAM)
            fk = tl.load(fk_base + pos[:, None] * F + f[None, :], mask=real[:, None], other=0.0)
            fk = fk * tl.load(weights + cc)[:, None]
            vv = tl.load(v_base + pos[:, None] * D + d[None, :], mask=real[:, None], other=0.0)
            S += tl.dot(tl.trans(fk), vv, input_precision="ieee")
            z += tl.sum(fk, axis=0)
        tl.debug_barrier()  # the next close rewrites the scratch row
    tl.store(s_ptr + bh * F * D + f[:, None] * D + d[None, :], S)
    tl.store(z_ptr + bh * F + f, z)


def covers(score: str, feature_dim: int, head_dim: int) -> bool:
    """Whether :func:`plan_evictions_triton` takes these options."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731  (tl.arange and tl.dot)
    return (score in SCORES and pow2(feature_dim) and pow2(head_dim)
            and feature_dim * head_dim <= MAX_STATE_ELEMENTS)


@torch.no_grad()
def plan_evictions_triton(k: Tensor, v: Tensor, T: int, window: int, cache, phi_k,
                          log_decay: Tensor | None = None) -> Evictions:
    """What ``sparse.batched.plan_evictions`` returns for the same arguments: k/v ``[B, Hk, T, D]``
    fp32 on CUDA (or on the CPU under TRITON_INTERPRET=1)."""
    check_device(k)
    B, Hk, _, D = k.shape
    w, lam, ns = window, cache.size, cache.sinks
    n_closes = max(-(-(T - first_group_start(w, ns)) // w) - 1, 0)  # one fewer than the groups
    G = n_closes + 1  # the cache each group reads; the first reads an empty one
    n_keys = ns + n_closes * w  # every key a close can see: the sinks' and the closed blocks'
    # fp32 features whatever dtype the map returns: the kernel's dots take one dtype.
    fk = phi_k(k[:, :, :max(n_keys, 1)].float()).float().contiguous()
    F = fk.shape[-1]
    if not covers(cache.score, F, D):
        raise NotImplementedError(f"the triton eviction plan covers the {SCORES} scores and power-of-two widths "
                                  f"with F * D <= {MAX_STATE_ELEMENTS}; got {cache.score!r}, F = {F}, D = {D}")
    dev = k.device
    cache_pos = torch.zeros(B, Hk, G, lam, dtype=torch.long, device=dev)
    cache_ok = torch.zeros(B, Hk, G, lam, dtype=torch.int8, device=dev)
    fold_pos = torch.zeros(B, Hk, n_closes, w, dtype=torch.long, device=dev)
    fold_ok = torch.zeros(B, Hk, n_closes, w, dtype=torch.int8, device=dev)
    S = torch.zeros(B, Hk, F, D, dtype=torch.float32, device=dev)
    z = torch.zeros(B, Hk, F, dtype=torch.float32, device=dev)
    if n_closes:
        C = max(16, triton.next_power_of_2(lam + w))
        scratch = torch.empty(B * Hk, 2 * C, dtype=torch.float32, device=dev)
        lam_kv = (log_decay.float() if log_decay is not None else torch.zeros(Hk, device=dev)).contiguous()
        _plan_kernel[(B * Hk,)](
            fk, v[:, :, :n_keys].float().contiguous(), lam_kv, cache_pos, cache_ok, fold_pos, fold_ok, S, z, scratch,
            Hk, n_keys, n_closes, ns, SRE_EPS,
            W=w, LAM=lam, C=C, F=F, D=D, ROWS=min(64, C), RANK_BLOCK=min(32, C),
            SRE=cache.score == "sre", DECAY=log_decay is not None, num_warps=4,
        )
    ok = cache_ok.bool()
    return Evictions(cache_pos, ok, fold_pos, fold_ok.bool(), S, z, cache_pos[:, :, -1], ok[:, :, -1])
