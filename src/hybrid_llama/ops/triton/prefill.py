"""`triton` backend, prefill: fused hybrid attention forward and backward.

Layout (all kernels use one block size ``BLOCK`` for query blocks, key blocks and linear chunks):

forward
  1. ``_kv_state_kernel``, one program per (batch, KV head, chunk c): ``phi(K_c)^T V_c`` [F, D] and
     ``sum phi(K_c)`` [F]. A torch cumsum over the chunk axis turns them into exclusive prefix states
     ``S_c = sum over keys < c*BLOCK`` ([B*Hkv, T/BLOCK + 1, F, D] fp32; the only O(T/C * F*D) tensor).
  2. ``_fwd_kernel``, one program per (batch, head, query block [s, s+BLOCK)):
     - window: online softmax over the key blocks covering [s-w+1, s+BLOCK-1] (two blocks when
       BLOCK = w), masked to j in [t-w+1, t];
     - linear: prefix state of chunk c0 = floor((s-w)/BLOCK) (keys every row of the block sees), plus
       the keys [c0*BLOCK, s+BLOCK-1-w] under the exact mask j <= t-w (quadratic within <= 2 blocks);
     - combine with a = sigmoid(window_logit), b = sigmoid(linear_logit) as in reference.combine.
     It stores the output, and per row the window max m, the window sum l (relative to m) and the
     denominator, which is all the backward needs besides q, k, v, o (and the features, if given).

backward (everything fused except the chunk-axis cumsums and the [H] logit-gradient sums)
  3. ``_bwd_q_kernel`` per (batch, head, query block): recomputes the window probabilities from
     (m, l) and the linear readout from the (recomputed) prefix states; writes dq and per-row
     scalars for the key side (the window "delta", scale factors) and the per-row logit gradients.
  4. ``_q_state_kernel`` per (batch, KV head, chunk): ``sum_h phi(Q_c)^T dN`` and
     ``sum_h phi(Q_c)^T dZ`` over the heads sharing the KV head; a reverse cumsum over chunks gives
     the suffix states a key needs for the queries t >= j + w.
  5. ``_bwd_kv_kernel`` per (batch, KV head, key block): loops over the query heads of its group
     (GQA: dk, dv are summed without materialising repeated k/v) and over the query blocks within
     the window after the keys, plus the intra-chunk linear part and the suffix state.

Feature maps (constexpr ``FEATURES``): elu1 is computed inside the kernels from q and k (F = D),
and its derivative is applied there, so the kernels return dq, dk directly. Any other map is
applied in torch by ``hybrid_attention_triton`` (so autograd reaches its parameters); the kernels
then read phi(q) ``[B, H, T, F]`` and phi(k) ``[B, H_kv, T, F]`` for the linear part (the window
still uses the raw q, k) and return d phi(q), d phi(k) beside dq, dk, dv. The same kernels serve
both cases: only the loads of the features and the last step of their gradients differ. A
(query_map, key_map) pair maps the keys at the KV heads; a single map other than elu1 may be per
head, so k/v are expanded to the query heads before it (as the chunked backend does).

``formulation="window"`` (constexpr ``LINEAR`` False) is the hybrid formulation with b = 0: the
prefix states, the linear readout and the key-side linear gradients are compiled out, and the
feature maps are not evaluated at all.

GQA: k, v may have H_kv heads with H % H_kv == 0 (or be expanded, H_kv = H); query head h reads
KV head h // (H / H_kv). Key padding is supported (padded keys' features are masked to zero in
the kernels: a learned phi(k) of a padded row is not zero).

Decaying linear state (``log_decay`` [H_kv], constexpr ``DECAY``): key j enters query t's linear
part at gamma^(t - w - j). Chunk increments weight key row r by gamma^(BLOCK-1-r) and
``_decay_scan_kernel`` replaces the cumsum (``S_c = gamma^BLOCK S_(c-1) + inc_(c-1)``); a row reads
its prefix state at gamma^(t - w - c0*BLOCK + 1) and its explicit keys at gamma^(t-w-j). The
backward mirrors it (query rows at gamma^r, a reverse scan, keys at gamma^(c*BLOCK - w - j)), and
``_bwd_q_kernel`` writes d/d log gamma per row from local ages only: the explicit pairs' own, the
prefix read's age, and a read of age-weighted prefix sums (``AGED``). See docs/triton.md.

LoLCATs: its window term uses exp(s - m) with m the window max, and the reference lets the gradient
flow through that max (torch.amax). The kernels track the argmax key per row and route the
max-gradient there; on exact score ties torch would split it, we give it to the first one.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..feature_maps import FeatureMap, is_elu1, keys_need_query_heads, resolve_qk_maps
from ..gqa import expand_kv
from ..state import HybridState, prefill_state
from .common import (
    check_device,
    check_feature_dim,
    check_head_dim,
    dot_precision,
    dphi,
    formulation_flags,
    last_dim_contiguous,
    phi,
)

DEFAULT_BLOCK = 64


@triton.jit
def _load_rows(ptr, rows, stride_t, cols, ok):
    """[BLOCK, len(cols)] tile of rows ``rows`` (zeros where not ``ok``)."""
    return tl.load(ptr + rows[:, None] * stride_t + cols[None, :], mask=ok[:, None], other=0.0)


@triton.jit
def _key_ok(km_ptr, b, smb, rows, T, HAS_MASK: tl.constexpr):
    """In range and (with a padding mask) a real key."""
    ok = rows < T
    if HAS_MASK:
        ok = ok & (tl.load(km_ptr + b * smb + rows, mask=rows < T, other=0) != 0)
    return ok


@triton.jit
def _q_feature_rows(qbase, fqbase, rows, sqt, sfqt, d, f, ok, FEATURES: tl.constexpr):
    """phi(q) of the query rows ``rows`` in fp32, [BLOCK, F], zero where not ``ok``: read from the
    given features, or elu1 of q."""
    if FEATURES:
        pq = _load_rows(fqbase, rows, sfqt, f, ok).to(tl.float32)
    else:
        pq = tl.where(ok[:, None], phi(_load_rows(qbase, rows, sqt, d, ok).to(tl.float32)), 0.0)
    return pq


# --------------------------------------------------------------------------------------- forward


@triton.jit
def _window_block(q, kbase, vbase, km_ptr, b, smb, tq, n, r, d, skt, svt, T, W, sm_scale,
                  HAS_MASK: tl.constexpr, PREC: tl.constexpr):
    """Key block [n, n+BLOCK) against the query rows tq: keys, values, scaled scores q.k and the
    window mask (key real and in [t-w+1, t])."""
    tk = n + r
    k_ok = _key_ok(km_ptr, b, smb, tk, T, HAS_MASK)
    kk = _load_rows(kbase, tk, skt, d, k_ok)
    vv = _load_rows(vbase, tk, svt, d, k_ok)
    s = tl.dot(q, tl.trans(kk), input_precision=PREC) * sm_scale
    ok = (tk[None, :] <= tq[:, None]) & (tk[None, :] > tq[:, None] - W) & k_ok[None, :]
    return kk, vv, s, ok


@triton.jit
def _prefix_state(s_ptr, z_ptr, b, hk, HKV, NC1, s0, W, d, f, BLOCK: tl.constexpr, D: tl.constexpr,
                  F: tl.constexpr):
    """The chunk c0 and prefix state (S [F, D], z [F]) that every query row of block [s0, s0+BLOCK)
    sees whole."""
    c0 = tl.maximum(s0 - W, 0) // BLOCK
    sbase = (b * HKV + hk) * NC1 + c0
    s_pre = tl.load(s_ptr + sbase * F * D + f[:, None] * D + d[None, :])
    z_pre = tl.load(z_ptr + sbase * F + f)
    return c0, s_pre, z_pre


@triton.jit
def _decayed(lam, age):
    """gamma^age for log gamma ``lam`` (<= 0); ages below zero (masked entries) count as 0, so
    nothing overflows."""
    return tl.exp(lam * tl.maximum(age, 0).to(tl.float32))


@triton.jit
def _load_lam(lam_ptr, hk, DECAY: tl.constexpr):
    """log gamma of KV head ``hk`` (0.0 without a decay)."""
    if DECAY:
        lam = tl.load(lam_ptr + hk)
    else:
        lam = 0.0
    return lam


@triton.jit
def _decay_scan_kernel(x_ptr, y_ptr, lam_ptr, HKV, NC1, E, CHUNK,
                       REVERSE: tl.constexpr, AGED: tl.constexpr, BLOCK_E: tl.constexpr):
    """In place over the chunk axis of x ``[B*H_kv, NC1, E]`` (fp32), one program per (row, E tile):
    forward ``x[c] = gamma^CHUNK x[c-1] + x[c]`` for c = 1 .. NC1-1 (slot 0 holds zeros), reverse
    ``x[c] = x[c] + gamma^CHUNK x[c+1]`` for c = NC1-2 .. 0 (slot NC1-1 holds zeros). With ``AGED``
    (forward only) y holds the age-weighted increments and becomes
    ``y[c] = gamma^CHUNK (y[c-1] + CHUNK x[c-1]) + y[c]``: the same sums with each key weighted by its
    age times its decay."""
    bh = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = e < E
    gc = tl.exp(tl.load(lam_ptr + bh % HKV) * CHUNK)
    base = bh * NC1 * E + e
    prev = tl.zeros([BLOCK_E], tl.float32)
    prev_a = tl.zeros([BLOCK_E], tl.float32)
    for i in range(1, NC1):
        if REVERSE:
            c = NC1 - 1 - i
        else:
            c = i
        off = base + c * E
        if AGED:
            prev_a = gc * (prev_a + CHUNK * prev) + tl.load(y_ptr + off, mask=ok, other=0.0)
            tl.store(y_ptr + off, prev_a, mask=ok)
        prev = gc * prev + tl.load(x_ptr + off, mask=ok, other=0.0)
        tl.store(x_ptr + off, prev, mask=ok)


@triton.jit
def _phi_key_block(kbase, vbase, fkbase, km_ptr, b, smb, tk, d, f, skt, svt, sfkt, T,
                   HAS_MASK: tl.constexpr, FEATURES: tl.constexpr):
    """phi(k) [BLOCK, F] and v [BLOCK, D] of the key rows tk in fp32, both zero for padded or
    out-of-range keys (phi(0) = 1 for elu1, and learned features of a padded row are not zero)."""
    k_ok = _key_ok(km_ptr, b, smb, tk, T, HAS_MASK)
    if FEATURES:
        pk = _load_rows(fkbase, tk, sfkt, f, k_ok).to(tl.float32)
    else:
        pk = tl.where(k_ok[:, None], phi(_load_rows(kbase, tk, skt, d, k_ok).to(tl.float32)), 0.0)
    vf = _load_rows(vbase, tk, svt, d, k_ok).to(tl.float32)
    return pk, vf


@triton.jit
def _kv_state_kernel(
    k_ptr, v_ptr, fk_ptr, km_ptr, s_ptr, z_ptr, lam_ptr, sa_ptr, za_ptr,
    skb, skh, skt, svb, svh, svt, sfkb, sfkh, sfkt, smb,
    HKV, T, NC1,
    BLOCK: tl.constexpr, D: tl.constexpr, F: tl.constexpr, HAS_MASK: tl.constexpr,
    FEATURES: tl.constexpr, PREC: tl.constexpr, DECAY: tl.constexpr, AGED: tl.constexpr,
):
    """Chunk c's increment ``phi(K_c)^T V_c``, ``sum phi(K_c)``; with a decay each key weighted by
    gamma^(BLOCK-1-r) (its weight at the chunk's last position), and with ``AGED`` also the same
    sums weighted by (BLOCK-1-r) gamma^(BLOCK-1-r) (for the decay's own gradient)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets for large B*H*T*D
    b = bh // HKV
    hk = bh % HKV
    rows = c * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    pk, vf = _phi_key_block(k_ptr + b * skb + hk * skh, v_ptr + b * svb + hk * svh, fk_ptr + b * sfkb + hk * sfkh,
                            km_ptr, b, smb, rows, d, f, skt, svt, sfkt, T, HAS_MASK, FEATURES)
    # Chunk c goes to slot c + 1: a cumsum (a decayed scan) over slots then gives the exclusive
    # prefix in slot c.
    slot = bh * NC1 + c + 1
    if DECAY:
        age = BLOCK - 1 - tl.arange(0, BLOCK)
        ks = _decayed(tl.load(lam_ptr + hk), age)
        if AGED:
            pa = pk * (age.to(tl.float32) * ks)[:, None]
            sta = tl.dot(tl.trans(pa), vf, input_precision=PREC)
            tl.store(sa_ptr + slot * F * D + f[:, None] * D + d[None, :], sta)
            tl.store(za_ptr + slot * F + f, tl.sum(pa, 0))
        pk = pk * ks[:, None]
    st = tl.dot(tl.trans(pk), vf, input_precision=PREC)
    tl.store(s_ptr + slot * F * D + f[:, None] * D + d[None, :], st)
    tl.store(z_ptr + slot * F + f, tl.sum(pk, 0))


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, fq_ptr, fk_ptr, o_ptr, km_ptr, s_ptr, z_ptr, a_ptr, b_ptr, lam_ptr,
    m_ptr, l_ptr, den_ptr, idx_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sfqb, sfqh, sfqt, sfkb, sfkh, sfkt, sob, soh, sot, smb,
    H, HKV, T, W, NC1, sm_scale,
    BLOCK: tl.constexpr, D: tl.constexpr, F: tl.constexpr, HAS_MASK: tl.constexpr, LOLCATS: tl.constexpr,
    FEATURES: tl.constexpr, LINEAR: tl.constexpr, PREC: tl.constexpr, DECAY: tl.constexpr,
):
    mb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets for large B*H*T*D
    b = bh // H
    h = bh % H
    hk = h // (H // HKV)
    s0 = mb * BLOCK
    r = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    tq = s0 + r
    q_ok = tq < T
    q = _load_rows(q_ptr + b * sqb + h * sqh, tq, sqt, d, q_ok)
    kbase = k_ptr + b * skb + hk * skh
    vbase = v_ptr + b * svb + hk * svh

    # Window: online softmax over keys [t-w+1, t].
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    idx = tl.zeros([BLOCK], tl.int32)
    acc = tl.zeros([BLOCK, D], tl.float32)
    lo = (tl.maximum(s0 - W + 1, 0) // BLOCK) * BLOCK
    hi = tl.minimum(s0 + BLOCK, T)
    for n in range(lo, hi, BLOCK):
        kk, vv, s, ok = _window_block(q, kbase, vbase, km_ptr, b, smb, tq, n, r, d, skt, svt, T, W, sm_scale,
                                      HAS_MASK, PREC)
        s = tl.where(ok, s, float("-inf"))
        bmax = tl.max(s, 1)
        if LOLCATS:
            idx = tl.where(bmax > m_i, n + tl.argmax(s, 1).to(tl.int32), idx)
        m_new = tl.maximum(m_i, bmax)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: keep exps at 0
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
        m_i = m_new

    # Linear: keys j <= t - w. Prefix state of the chunks every row of the block sees, then the
    # remaining keys (at most two blocks) under the exact mask.
    lin = tl.zeros([BLOCK, D], tl.float32)
    lden = tl.zeros([BLOCK], tl.float32)
    if LINEAR:
        if FEATURES:
            pq = _load_rows(fq_ptr + b * sfqb + h * sfqh, tq, sfqt, f, q_ok).to(tl.float32)
        else:
            pq = phi(q.to(tl.float32))
        c0, s_pre, z_pre = _prefix_state(s_ptr, z_ptr, b, hk, HKV, NC1, s0, W, d, f, BLOCK, D, F)
        lam = _load_lam(lam_ptr, hk, DECAY)
        if DECAY:
            # The prefix state holds its keys as of position c0*BLOCK - 1; row t reads it t-w-c0*BLOCK+1 later.
            pqs = pq * _decayed(lam, tq - W - c0 * BLOCK + 1)[:, None]
        else:
            pqs = pq
        lin += tl.dot(pqs, s_pre, input_precision=PREC)
        lden += tl.sum(pqs * z_pre[None, :], 1)
        fkbase = fk_ptr + b * sfkb + hk * sfkh
        for n in range(c0 * BLOCK, s0 + BLOCK - W, BLOCK):
            tk = n + r
            pk, vf = _phi_key_block(kbase, vbase, fkbase, km_ptr, b, smb, tk, d, f, skt, svt, sfkt, T,
                                    HAS_MASK, FEATURES)
            A = tl.dot(pq, tl.trans(pk), input_precision=PREC)
            if DECAY:
                A = A * _decayed(lam, tq[:, None] - W - tk[None, :])
            A = tl.where(tk[None, :] <= tq[:, None] - W, A, 0.0)
            lin += tl.dot(A, vf, input_precision=PREC)
            lden += tl.sum(A, 1)

    # Without the linear part the caller passes a = 1, b = 0: out = acc / l exactly.
    a = tl.load(a_ptr + h)
    bw = tl.load(b_ptr + h)
    if LOLCATS:
        num = a * acc + bw * lin
        den = a * l_i + bw * lden
    else:
        has_win = l_i > 0
        wsc = tl.where(has_win, a / tl.where(has_win, l_i, 1.0), 0.0)
        num = wsc[:, None] * acc + bw * lin
        den = tl.where(has_win, a, 0.0) + bw * lden
    has_any = den > 0
    out = tl.where(has_any[:, None], num / tl.where(has_any, den, 1.0)[:, None], 0.0)
    tl.store(o_ptr + b * sob + h * soh + tq[:, None] * sot + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=q_ok[:, None])
    row = bh * T + tq
    tl.store(m_ptr + row, m_i, mask=q_ok)
    tl.store(l_ptr + row, l_i, mask=q_ok)
    tl.store(den_ptr + row, den, mask=q_ok)
    if LOLCATS:
        tl.store(idx_ptr + row, idx, mask=q_ok)


# -------------------------------------------------------------------------------------- backward


@triton.jit
def _bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, fq_ptr, fk_ptr, o_ptr, do_ptr, dq_ptr, dfq_ptr, km_ptr, s_ptr, z_ptr, a_ptr, b_ptr,
    m_ptr, l_ptr, den_ptr, idx_ptr,
    gsc_ptr, dt_ptr, lsc_ptr, ldd_ptr, dm_ptr, da_ptr, db_ptr, lam_ptr, sa_ptr, za_ptr, dl_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sfqb, sfqh, sfqt, sfkb, sfkh, sfkt, sob, soh, sot,
    sdob, sdoh, sdot, sdqb, sdqh, sdqt, sdfqb, sdfqh, sdfqt, smb,
    H, HKV, T, W, NC1, sm_scale,
    BLOCK: tl.constexpr, D: tl.constexpr, F: tl.constexpr, HAS_MASK: tl.constexpr, LOLCATS: tl.constexpr,
    FEATURES: tl.constexpr, LINEAR: tl.constexpr, PREC: tl.constexpr, DECAY: tl.constexpr,
):
    mb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets for large B*H*T*D
    b = bh // H
    h = bh % H
    hk = h // (H // HKV)
    s0 = mb * BLOCK
    r = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    tq = s0 + r
    q_ok = tq < T
    q = _load_rows(q_ptr + b * sqb + h * sqh, tq, sqt, d, q_ok)
    qf = q.to(tl.float32)
    do = _load_rows(do_ptr + b * sdob + h * sdoh, tq, sdot, d, q_ok).to(tl.float32)
    o = _load_rows(o_ptr + b * sob + h * soh, tq, sot, d, q_ok).to(tl.float32)
    row = bh * T + tq
    m = tl.load(m_ptr + row, mask=q_ok, other=0.0)
    l = tl.load(l_ptr + row, mask=q_ok, other=0.0)
    den = tl.load(den_ptr + row, mask=q_ok, other=0.0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    has_win = l > 0
    l_safe = tl.where(has_win, l, 1.0)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)  # rows output as zeros get no grad
    dnum = do * inv[:, None]
    dden = -tl.sum(do * o, 1) * inv
    kbase = k_ptr + b * skb + hk * skh
    vbase = v_ptr + b * svb + hk * svh
    lo = (tl.maximum(s0 - W + 1, 0) // BLOCK) * BLOCK
    hi = tl.minimum(s0 + BLOCK, T)

    # Pass 1: the normalised window average ow = sum_j p_j v_j.
    ow = tl.zeros([BLOCK, D], tl.float32)
    for n in range(lo, hi, BLOCK):
        kk, vv, s, ok = _window_block(q, kbase, vbase, km_ptr, b, smb, tq, n, r, d, skt, svt, T, W, sm_scale,
                                      HAS_MASK, PREC)
        p = tl.where(ok, tl.exp(s - m_use[:, None]) / l_safe[:, None], 0.0)
        ow += tl.dot(p.to(vv.dtype), vv, input_precision=PREC)

    a = tl.load(a_ptr + h)
    bw = tl.load(b_ptr + h)
    # Window gradient as ds_j = p_j (g . v_j - dt) with p the normalised probabilities.
    if LOLCATS:
        # out = (a*l*ow + b*N) / (a*l + b*Z): d/dP_j = a*dnum.v_j + a*dden, P_j = l*p_j.
        gsc = a * l * inv
        dt = -a * l * dden
        da_row = l * (tl.sum(dnum * ow, 1) + dden)
        # Gradient through m = max_j s_j (torch.amax in the reference): -sum_j ds_j.
        dm = -(gsc * tl.sum(do * ow, 1) - dt)
    else:
        gsc = tl.where(has_win, a * inv, 0.0)
        dt = gsc * tl.sum(do * ow, 1)
        da_row = tl.where(has_win, tl.sum(dnum * ow, 1) + dden, 0.0)
    g = do * gsc[:, None]

    # Pass 2: dq from the window.
    dq = tl.zeros([BLOCK, D], tl.float32)
    for n in range(lo, hi, BLOCK):
        kk, vv, s, ok = _window_block(q, kbase, vbase, km_ptr, b, smb, tq, n, r, d, skt, svt, T, W, sm_scale,
                                      HAS_MASK, PREC)
        p = tl.where(ok, tl.exp(s - m_use[:, None]) / l_safe[:, None], 0.0)
        dp = tl.dot(g.to(vv.dtype), tl.trans(vv), input_precision=PREC)
        ds = p * (dp - dt[:, None])
        dq += tl.dot(ds.to(kk.dtype), kk, input_precision=PREC)
    if LOLCATS:
        idx = tl.load(idx_ptr + row, mask=q_ok, other=0)
        k_max = tl.load(kbase + idx[:, None] * skt + d[None, :], mask=(q_ok & has_win)[:, None], other=0.0)
        dq += dm[:, None] * k_max.to(tl.float32)
    dq = dq * sm_scale

    # Linear part: readout (for the logit gradient) and d phi(q), from the prefix state and <= 2
    # blocks. d phi(q) goes into dq through elu1's derivative, or out as the features' gradient.
    lsc = bw * inv  # dN = lsc * do, the gradient of phi(q) S
    ldd = bw * dden  # dZ, the gradient of phi(q) . z
    db_row = tl.zeros([BLOCK], tl.float32)
    dl_row = tl.zeros([BLOCK], tl.float32)
    if LINEAR:
        dn = do * lsc[:, None]
        if FEATURES:
            pq = _load_rows(fq_ptr + b * sfqb + h * sfqh, tq, sfqt, f, q_ok).to(tl.float32)
        else:
            pq = phi(qf)
        c0, s_pre, z_pre = _prefix_state(s_ptr, z_ptr, b, hk, HKV, NC1, s0, W, d, f, BLOCK, D, F)
        lin = tl.dot(pq, s_pre, input_precision=PREC)
        lden = tl.sum(pq * z_pre[None, :], 1)
        dpq = tl.dot(dn, tl.trans(s_pre), input_precision=PREC) + ldd[:, None] * z_pre[None, :]
        lam = _load_lam(lam_ptr, hk, DECAY)
        if DECAY:
            # Row t reads the prefix state e_t = t-w-c0*BLOCK+1 positions after its last key: every
            # term below carries gamma^e_t, and d/d log gamma of key j's weight gamma^(e_t + age_j) is
            # (e_t + age_j) times it: e_t times the read, plus the read of the age-weighted state.
            e_t = tl.maximum(tq - W - c0 * BLOCK + 1, 0)
            qs = _decayed(lam, e_t)
            lin = lin * qs[:, None]
            lden = lden * qs
            dpq = dpq * qs[:, None]
            _, sa_pre, za_pre = _prefix_state(sa_ptr, za_ptr, b, hk, HKV, NC1, s0, W, d, f, BLOCK, D, F)
            lin_a = tl.dot(pq, sa_pre, input_precision=PREC)
            lden_a = tl.sum(pq * za_pre[None, :], 1)
            dl_row = e_t.to(tl.float32) * (tl.sum(lin * dn, 1) + ldd * lden)
            dl_row += qs * (tl.sum(lin_a * dn, 1) + ldd * lden_a)
        fkbase = fk_ptr + b * sfkb + hk * sfkh
        for n in range(c0 * BLOCK, s0 + BLOCK - W, BLOCK):
            tk = n + r
            pk, vf = _phi_key_block(kbase, vbase, fkbase, km_ptr, b, smb, tk, d, f, skt, svt, sfkt, T,
                                    HAS_MASK, FEATURES)
            ok = tk[None, :] <= tq[:, None] - W
            A = tl.where(ok, tl.dot(pq, tl.trans(pk), input_precision=PREC), 0.0)
            if DECAY:
                age = tl.maximum(tq[:, None] - W - tk[None, :], 0)
                dec = _decayed(lam, age)
                A = A * dec  # the weights of the output; dA below is the gradient of each weight
            lin += tl.dot(A, vf, input_precision=PREC)
            lden += tl.sum(A, 1)
            dA = tl.where(ok, tl.dot(dn, tl.trans(vf), input_precision=PREC) + ldd[:, None], 0.0)
            if DECAY:
                dl_row += tl.sum(age.to(tl.float32) * A * dA, 1)
                dA = dA * dec
            dpq += tl.dot(dA, pk, input_precision=PREC)
        if FEATURES:
            tl.store(dfq_ptr + b * sdfqb + h * sdfqh + tq[:, None] * sdfqt + f[None, :],
                     dpq.to(dfq_ptr.dtype.element_ty), mask=q_ok[:, None])
        else:
            dq += dpq * dphi(qf)
        db_row += tl.sum(dnum * lin, 1) + dden * lden

    tl.store(dq_ptr + b * sdqb + h * sdqh + tq[:, None] * sdqt + d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=q_ok[:, None])
    tl.store(gsc_ptr + row, gsc, mask=q_ok)
    tl.store(dt_ptr + row, dt, mask=q_ok)
    tl.store(lsc_ptr + row, lsc, mask=q_ok)
    tl.store(ldd_ptr + row, ldd, mask=q_ok)
    tl.store(da_ptr + row, da_row, mask=q_ok)
    tl.store(db_ptr + row, db_row, mask=q_ok)
    if DECAY:
        tl.store(dl_ptr + row, dl_row, mask=q_ok)
    if LOLCATS:
        tl.store(dm_ptr + row, dm, mask=q_ok)


@triton.jit
def _q_state_kernel(
    q_ptr, fq_ptr, do_ptr, lsc_ptr, ldd_ptr, g_ptr, gz_ptr, lam_ptr,
    sqb, sqh, sqt, sfqb, sfqh, sfqt, sdob, sdoh, sdot,
    H, HKV, T, NC1,
    BLOCK: tl.constexpr, D: tl.constexpr, F: tl.constexpr, FEATURES: tl.constexpr, PREC: tl.constexpr,
    DECAY: tl.constexpr,
):
    """Per chunk, summed over the query heads of one KV head: phi(Q)^T dN [F, D] and phi(Q)^T dZ [F];
    with a decay each query row weighted by gamma^r, r its offset in the chunk (a reverse decayed
    scan then makes the suffix state of chunk c hold query t at gamma^(t - c*BLOCK))."""
    c = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // HKV
    hk = bhk % HKV
    group = H // HKV
    rows = c * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    ok = rows < T
    gs = tl.zeros([F, D], tl.float32)
    gz = tl.zeros([F], tl.float32)
    if DECAY:
        qs = _decayed(tl.load(lam_ptr + hk), tl.arange(0, BLOCK))
    for hh in range(0, group):
        h = hk * group + hh
        pq = _q_feature_rows(q_ptr + b * sqb + h * sqh, fq_ptr + b * sfqb + h * sfqh, rows, sqt, sfqt, d, f, ok,
                             FEATURES)
        if DECAY:
            pq = pq * qs[:, None]
        do = _load_rows(do_ptr + b * sdob + h * sdoh, rows, sdot, d, ok).to(tl.float32)
        row = (b * H + h) * T + rows
        lsc = tl.load(lsc_ptr + row, mask=ok, other=0.0)
        ldd = tl.load(ldd_ptr + row, mask=ok, other=0.0)
        gs += tl.dot(tl.trans(pq), do * lsc[:, None], input_precision=PREC)
        gz += tl.sum(pq * ldd[:, None], 0)
    slot = bhk * NC1 + c
    tl.store(g_ptr + slot * F * D + f[:, None] * D + d[None, :], gs)
    tl.store(gz_ptr + slot * F + f, gz)


@triton.jit
def _bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, fq_ptr, fk_ptr, do_ptr, dk_ptr, dv_ptr, dfk_ptr, km_ptr, g_ptr, gz_ptr,
    m_ptr, l_ptr, idx_ptr, gsc_ptr, dt_ptr, lsc_ptr, ldd_ptr, dm_ptr, lam_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sfqb, sfqh, sfqt, sfkb, sfkh, sfkt, sdob, sdoh, sdot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, sdfkb, sdfkh, sdfkt, smb,
    H, HKV, T, W, NC1, sm_scale,
    BLOCK: tl.constexpr, D: tl.constexpr, F: tl.constexpr, HAS_MASK: tl.constexpr, LOLCATS: tl.constexpr,
    FEATURES: tl.constexpr, LINEAR: tl.constexpr, PREC: tl.constexpr, DECAY: tl.constexpr,
):
    nb = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)
    b = bhk // HKV
    hk = bhk % HKV
    group = H // HKV
    n0 = nb * BLOCK
    r = tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    tk = n0 + r
    k_ok = _key_ok(km_ptr, b, smb, tk, T, HAS_MASK)
    kk = _load_rows(k_ptr + b * skb + hk * skh, tk, skt, d, k_ok)
    vv = _load_rows(v_ptr + b * svb + hk * svh, tk, svt, d, k_ok)
    kf = kk.to(tl.float32)
    vf = vv.to(tl.float32)
    if LINEAR:
        if FEATURES:
            pk = _load_rows(fk_ptr + b * sfkb + hk * sfkh, tk, sfkt, f, k_ok).to(tl.float32)
        else:
            pk = tl.where(k_ok[:, None], phi(kf), 0.0)
    dk = tl.zeros([BLOCK, D], tl.float32)
    dv = tl.zeros([BLOCK, D], tl.float32)
    dpk = tl.zeros([BLOCK, F], tl.float32)
    lam = _load_lam(lam_ptr, hk, DECAY)
    # Queries t >= U see the whole key block through the linear state (suffix from chunk U/BLOCK).
    U = tl.cdiv(n0 + BLOCK - 1 + W, BLOCK) * BLOCK
    for hh in range(0, group):
        h = hk * group + hh
        qbase = q_ptr + b * sqb + h * sqh
        dobase = do_ptr + b * sdob + h * sdoh
        rbase = (b * H + h) * T
        # Window: queries t in [j, j+w-1] for the keys j of this block.
        for ts in range(n0, tl.minimum(n0 + BLOCK - 1 + W, T), BLOCK):
            tq = ts + r
            q_ok = tq < T
            q = _load_rows(qbase, tq, sqt, d, q_ok)
            do = _load_rows(dobase, tq, sdot, d, q_ok).to(tl.float32)
            m = tl.load(m_ptr + rbase + tq, mask=q_ok, other=0.0)
            l = tl.load(l_ptr + rbase + tq, mask=q_ok, other=0.0)
            gsc = tl.load(gsc_ptr + rbase + tq, mask=q_ok, other=0.0)
            dt = tl.load(dt_ptr + rbase + tq, mask=q_ok, other=0.0)
            m_use = tl.where(m == float("-inf"), 0.0, m)
            l_safe = tl.where(l > 0, l, 1.0)
            s = tl.dot(kk, tl.trans(q), input_precision=PREC) * sm_scale  # [keys, queries]
            ok = (tq[None, :] >= tk[:, None]) & (tq[None, :] < tk[:, None] + W) & q_ok[None, :] & k_ok[:, None]
            p = tl.where(ok, tl.exp(s - m_use[None, :]) / l_safe[None, :], 0.0)
            g = (do * gsc[:, None]).to(vv.dtype)
            dv += tl.dot(p.to(vv.dtype), g, input_precision=PREC)
            dp = tl.dot(vv, tl.trans(g), input_precision=PREC)
            ds = p * (dp - dt[None, :])
            if LOLCATS:
                idx = tl.load(idx_ptr + rbase + tq, mask=q_ok, other=-1)
                dm = tl.load(dm_ptr + rbase + tq, mask=q_ok, other=0.0)
                ds += tl.where(ok & (idx[None, :] == tk[:, None]), dm[None, :], 0.0)
            dk += tl.dot(ds.to(q.dtype), q, input_precision=PREC)
        if LINEAR:
            # Linear, queries t in [j+w, U) that the suffix state does not cover.
            fqbase = fq_ptr + b * sfqb + h * sfqh
            for ts in range(n0 + W, tl.minimum(U, T), BLOCK):
                tq = ts + r
                q_ok = tq < T
                pq = _q_feature_rows(qbase, fqbase, tq, sqt, sfqt, d, f, q_ok, FEATURES)
                do = _load_rows(dobase, tq, sdot, d, q_ok).to(tl.float32)
                lsc = tl.load(lsc_ptr + rbase + tq, mask=q_ok, other=0.0)
                ldd = tl.load(ldd_ptr + rbase + tq, mask=q_ok, other=0.0)
                dn = do * lsc[:, None]
                ok = (tq[None, :] >= tk[:, None] + W) & (q_ok & (tq < U))[None, :]  # t >= U: suffix state
                A = tl.where(ok, tl.dot(pk, tl.trans(pq), input_precision=PREC), 0.0)
                if DECAY:
                    dec = _decayed(lam, tq[None, :] - W - tk[:, None])
                    A = A * dec
                dv += tl.dot(A, dn, input_precision=PREC)
                dA = tl.where(ok, tl.dot(vf, tl.trans(dn), input_precision=PREC) + ldd[None, :], 0.0)
                if DECAY:
                    dA = dA * dec
                dpk += tl.dot(dA, pq, input_precision=PREC)
    dk = dk * sm_scale
    if LINEAR:
        cu = tl.minimum(U // BLOCK, NC1 - 1)
        sbase = bhk * NC1 + cu
        g_suf = tl.load(g_ptr + sbase * F * D + f[:, None] * D + d[None, :])
        gz_suf = tl.load(gz_ptr + sbase * F + f)
        if DECAY:
            # The suffix state holds query t at gamma^(t - cu*BLOCK); key j adds gamma^(cu*BLOCK - w - j).
            ks = _decayed(lam, cu * BLOCK - W - tk)
            dpk += ks[:, None] * (tl.dot(vf, tl.trans(g_suf), input_precision=PREC) + gz_suf[None, :])
            dv += ks[:, None] * tl.dot(pk, g_suf, input_precision=PREC)
        else:
            dpk += tl.dot(vf, tl.trans(g_suf), input_precision=PREC) + gz_suf[None, :]
            dv += tl.dot(pk, g_suf, input_precision=PREC)
        # Padded keys never entered the linear part: their feature gradient is zero.
        if FEATURES:
            tl.store(dfk_ptr + b * sdfkb + hk * sdfkh + tk[:, None] * sdfkt + f[None, :],
                     tl.where(k_ok[:, None], dpk, 0.0).to(dfk_ptr.dtype.element_ty), mask=(tk < T)[:, None])
        else:
            dk += tl.where(k_ok[:, None], dpk * dphi(kf), 0.0)
    tl.store(dk_ptr + b * sdkb + hk * sdkh + tk[:, None] * sdkt + d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=(tk < T)[:, None])
    tl.store(dv_ptr + b * sdvb + hk * sdvh + tk[:, None] * sdvt + d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=(tk < T)[:, None])


# ----------------------------------------------------------------------------------------- python


def _s3(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(block: int, d: int) -> dict:
    # Not tuned on a GPU yet. Chosen from offline sm_90 compiles (ptxas -v): at BLOCK = D = 64,
    # 4 warps spill registers in every kernel, 8 warps spill none in the forward and little in the
    # backward. D = 128 gets fewer pipeline stages so its [D, D] fp32 state fits in shared memory.
    # ``d`` is the wider of the head dim and the feature width.
    return dict(num_warps=8 if block * d >= 64 * 64 else 4, num_stages=2 if d >= 128 else 3)


def default_block(d: int, f: int) -> int:
    """Block for head dim d and feature width f (f = d for elu1); not timed on a GPU yet. Offline
    sm_90 compiles at D = 64, F = 128 (Hedgehog): BLOCK 32 spills 44-96 B in the forward and
    470-1140 B in the backward, BLOCK 64 0-80 B and 850-1530 B; the backward dominates training,
    where learned maps are used, so wider features get BLOCK 32, as D = 128 does."""
    return DEFAULT_BLOCK if max(d, f) <= 64 else 32


def _decay_scan(x: Tensor, lam: Tensor, block: int, *, reverse: bool = False, aged: Tensor | None = None) -> None:
    """``_decay_scan_kernel`` in place over x ``[B*H_kv, NC1, ...]`` (and ``aged``, same shape)."""
    rows, nc1 = x.shape[:2]
    e = x[0, 0].numel()
    block_e = min(1024, triton.next_power_of_2(e))
    _decay_scan_kernel[(triton.cdiv(e, block_e), rows)](
        x, aged if aged is not None else x, lam, lam.shape[0], nc1, e, block,
        REVERSE=reverse, AGED=aged is not None, BLOCK_E=block_e,
    )


def _kv_states(k: Tensor, v: Tensor, phi_k: Tensor | None, km: Tensor, has_mask: bool, block: int,
               prec: str, lam: Tensor | None = None, aged: bool = False) -> tuple[Tensor, ...]:
    """Exclusive prefix states over chunks: S[bh, c] = sum over keys < c*block, [B*Hkv, NC+1, F, D];
    z [B*Hkv, NC+1, F]. phi(k) is elu1 of k, or ``phi_k`` when given. With a decay (``lam``, log
    gamma ``[H_kv]``) key j < c*block is weighted gamma^(c*block - 1 - j); ``aged`` then also gives
    (Sa, z_a), the same sums weighted (c*block - 1 - j) gamma^(c*block - 1 - j)."""
    B, HKV, T, D = k.shape
    feats = phi_k if phi_k is not None else k
    F = feats.shape[-1]
    nc = triton.cdiv(T, block)
    decay = lam is not None
    aged = aged and decay
    s = torch.zeros(B * HKV, nc + 1, F, D, device=k.device, dtype=torch.float32)
    z = torch.zeros(B * HKV, nc + 1, F, device=k.device, dtype=torch.float32)
    sa, za = (torch.zeros_like(s), torch.zeros_like(z)) if aged else (s, z)
    _kv_state_kernel[(nc, B * HKV)](
        k, v, feats, km, s, z, lam if decay else z, sa, za, *_s3(k), *_s3(v), *_s3(feats), km.stride(0), HKV, T,
        nc + 1, BLOCK=block, D=D, F=F, HAS_MASK=has_mask, FEATURES=phi_k is not None, PREC=prec, DECAY=decay,
        AGED=aged, **_launch(block, max(D, F)),
    )
    if not decay:
        return s.cumsum_(1), z.cumsum_(1)
    _decay_scan(s, lam, block, aged=sa if aged else None)
    _decay_scan(z, lam, block, aged=za if aged else None)
    return (s, z, sa, za) if aged else (s, z)


class _HybridAttentionTriton(torch.autograd.Function):
    """Inputs q, k, v, the two logits and, for learned maps, the features phi_q ``[B, H, T, F]`` and
    phi_k ``[B, H_kv, T, F]`` (None for elu1, computed in the kernels, and when ``linear`` is False);
    ``log_decay`` ``[H_kv]`` (or None) decays the linear state."""

    @staticmethod
    def forward(ctx, q, k, v, window_logit, linear_logit, phi_q, phi_k, window, lolcats, linear, key_padding_mask,
                block, log_decay):
        B, H, T, D = q.shape
        HKV = k.shape[1]
        q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
        features = phi_q is not None
        if features:
            phi_q, phi_k = last_dim_contiguous(phi_q), last_dim_contiguous(phi_k)
        F = phi_q.shape[-1] if features else D
        has_mask = key_padding_mask is not None
        km = key_padding_mask.to(torch.int8).contiguous() if has_mask else q.new_zeros(1, 1, dtype=torch.int8)
        if linear:
            a = torch.sigmoid(window_logit.detach().float()).contiguous()
            bw = torch.sigmoid(linear_logit.detach().float()).contiguous()
        else:
            # The window formulation is the hybrid one with b = 0; a = 1 makes its normalisation exact.
            a = torch.ones(H, device=q.device, dtype=torch.float32)
            bw = torch.zeros(H, device=q.device, dtype=torch.float32)
        prec = dot_precision(q.dtype)
        decay = linear and log_decay is not None  # the window formulation has no linear state to decay
        lam = log_decay.detach().float().contiguous() if decay else a  # a: a placeholder, never read
        if linear:
            s, z = _kv_states(k, v, phi_k, km, has_mask, block, prec, lam if decay else None)
        else:
            s = z = q.new_zeros(1, dtype=torch.float32)  # never read
        fq, fk = (phi_q, phi_k) if features else (q, k)  # placeholders when the kernels compute elu1
        o = torch.empty_like(q)
        stats = torch.empty(3, B * H, T, device=q.device, dtype=torch.float32)
        m, l, den = stats[0], stats[1], stats[2]
        idx = torch.empty(B * H, T, device=q.device, dtype=torch.int32) if lolcats else m
        grid = (triton.cdiv(T, block), B * H)
        _fwd_kernel[grid](
            q, k, v, fq, fk, o, km, s, z, a, bw, lam, m, l, den, idx,
            *_s3(q), *_s3(k), *_s3(v), *_s3(fq), *_s3(fk), *_s3(o), km.stride(0),
            H, HKV, T, window, triton.cdiv(T, block) + 1, 1.0 / math.sqrt(D),
            BLOCK=block, D=D, F=F, HAS_MASK=has_mask, LOLCATS=lolcats, FEATURES=features, LINEAR=linear,
            PREC=prec, DECAY=decay, **_launch(block, max(D, F)),
        )
        ctx.save_for_backward(q, k, v, phi_q, phi_k, o, km, a, bw, m, l, den, idx, lam)
        ctx.cfg = (window, lolcats, linear, has_mask, block, window_logit.dtype, linear_logit.dtype, decay,
                   None if log_decay is None else log_decay.dtype)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, phi_q, phi_k, o, km, a, bw, m, l, den, idx, lam = ctx.saved_tensors
        window, lolcats, linear, has_mask, block, wl_dtype, ll_dtype, decay, ld_dtype = ctx.cfg
        B, H, T, D = q.shape
        HKV = k.shape[1]
        features = phi_q is not None
        F = phi_q.shape[-1] if features else D
        do = last_dim_contiguous(do)
        prec = dot_precision(q.dtype)
        scale = 1.0 / math.sqrt(D)
        launch = _launch(block, max(D, F))
        nc1 = triton.cdiv(T, block) + 1
        if decay:  # recomputed, with the age-weighted sums d/d log gamma needs
            s, z, sa, za = _kv_states(k, v, phi_k, km, has_mask, block, prec, lam, aged=True)
        elif linear:
            s, z = _kv_states(k, v, phi_k, km, has_mask, block, prec)  # recomputed: cheaper than keeping them
        else:
            s = z = q.new_zeros(1, dtype=torch.float32)
        if not decay:
            sa, za = s, z  # never read
        fq, fk = (phi_q, phi_k) if features else (q, k)
        dq = torch.empty_like(q)
        dfq = torch.empty_like(phi_q) if features else dq
        rows = torch.empty(8 if decay else 7, B * H, T, device=q.device, dtype=torch.float32)
        gsc, dt, lsc, ldd, dm, da_row, db_row = rows.unbind(0)[:7]
        dl_row = rows[7] if decay else db_row  # d/d log gamma per row (a placeholder without a decay)
        _bwd_q_kernel[(triton.cdiv(T, block), B * H)](
            q, k, v, fq, fk, o, do, dq, dfq, km, s, z, a, bw, m, l, den, idx,
            gsc, dt, lsc, ldd, dm, da_row, db_row, lam, sa, za, dl_row,
            *_s3(q), *_s3(k), *_s3(v), *_s3(fq), *_s3(fk), *_s3(o), *_s3(do), *_s3(dq), *_s3(dfq), km.stride(0),
            H, HKV, T, window, nc1, scale,
            BLOCK=block, D=D, F=F, HAS_MASK=has_mask, LOLCATS=lolcats, FEATURES=features, LINEAR=linear,
            PREC=prec, DECAY=decay, **launch,
        )
        del s, z, sa, za
        if linear:
            # Query-side chunk states, then suffix sums: slot c = sum over query chunks >= c.
            g = torch.zeros(B * HKV, nc1, F, D, device=q.device, dtype=torch.float32)
            gz = torch.zeros(B * HKV, nc1, F, device=q.device, dtype=torch.float32)
            _q_state_kernel[(nc1 - 1, B * HKV)](
                q, fq, do, lsc, ldd, g, gz, lam, *_s3(q), *_s3(fq), *_s3(do), H, HKV, T, nc1,
                BLOCK=block, D=D, F=F, FEATURES=features, PREC=prec, DECAY=decay, **launch,
            )
            if decay:
                _decay_scan(g, lam, block, reverse=True)
                _decay_scan(gz, lam, block, reverse=True)
            else:
                g = g.flip(1).cumsum_(1).flip(1)
                gz = gz.flip(1).cumsum_(1).flip(1)
        else:
            g = gz = q.new_zeros(1, dtype=torch.float32)  # never read
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        dfk = torch.empty_like(phi_k) if features else dk
        _bwd_kv_kernel[(triton.cdiv(T, block), B * HKV)](
            q, k, v, fq, fk, do, dk, dv, dfk, km, g, gz, m, l, idx, gsc, dt, lsc, ldd, dm, lam,
            *_s3(q), *_s3(k), *_s3(v), *_s3(fq), *_s3(fk), *_s3(do), *_s3(dk), *_s3(dv), *_s3(dfk), km.stride(0),
            H, HKV, T, window, nc1, scale,
            BLOCK=block, D=D, F=F, HAS_MASK=has_mask, LOLCATS=lolcats, FEATURES=features, LINEAR=linear,
            PREC=prec, DECAY=decay, **launch,
        )
        if linear:
            dwl = (da_row.view(B, H, T).sum((0, 2)) * a * (1 - a)).to(wl_dtype)
            dll = (db_row.view(B, H, T).sum((0, 2)) * bw * (1 - bw)).to(ll_dtype)
        else:  # the window formulation does not depend on the mixing weights
            dwl = torch.zeros(H, device=q.device, dtype=wl_dtype)
            dll = torch.zeros(H, device=q.device, dtype=ll_dtype)
        if not features:
            dfq = dfk = None
        dld = None
        if decay:
            dld = dl_row.view(B, HKV, H // HKV, T).sum((0, 2, 3)).to(ld_dtype)
        elif ld_dtype is not None:  # the window formulation does not depend on the decay
            dld = torch.zeros(HKV, device=q.device, dtype=ld_dtype)
        return dq, dk, dv, dwl, dll, dfq, dfk, None, None, None, None, None, dld


def _features(q: Tensor, k: Tensor, v: Tensor, feature_map: FeatureMap) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(k, v, phi(q), phi(k)) for a map other than elu1, computed in torch so that autograd reaches
    its parameters. A single map may be per head (e.g. a HedgehogFeatureMap of H heads), so with it
    GQA k/v are expanded to the query heads first; a (query_map, key_map) pair maps k at the KV heads."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
    query_map, key_map = resolve_qk_maps(feature_map)
    phi_q, phi_k = query_map(q), key_map(k)
    B, H, T, _ = q.shape
    F = phi_q.shape[-1]
    if phi_q.shape != (B, H, T, F) or phi_k.shape != (B, k.shape[1], T, F):
        raise ValueError(
            f"feature maps must give phi(q) [B, H, T, F] and phi(k) [B, H_kv, T, F] of one width F; got "
            f"{tuple(phi_q.shape)} and {tuple(phi_k.shape)}"
        )
    check_feature_dim(F, q.shape[-1])
    if not (phi_q.is_floating_point() and phi_k.is_floating_point()):
        raise ValueError(f"features must be floating point, got {phi_q.dtype}, {phi_k.dtype}")
    return k, v, phi_q, phi_k


def hybrid_attention_triton(
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
    block_size: int | None = None,
    output_final_state: bool = False,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState | None]:
    """Fused hybrid attention (see docs/design.md "ops"): q ``[B, H, T, D]``, k/v ``[B, H_kv, T, D]``
    with ``H % H_kv == 0``; returns ``(o, final_state)``, o ``[B, H, T, D]`` in q's dtype. The
    kernels do not write the decode state: with ``output_final_state`` it is one torch GEMM over the
    keys that left the window (``prefill_state``), else None. Differentiable in q, k, v, both
    logits and the parameters of a learned ``feature_map`` ("elu1", one callable for q and k, or a
    (query_map, key_map) pair; the maps run in torch, the kernels read their features).
    ``block_size`` (power of two >= 16) is the query/key/chunk block, default 64 (32 when D or the
    feature width is above 64). ``log_decay`` ``[H_kv]``: log gamma <= 0 per KV head, a decaying
    linear state (key j enters query t's linear part at gamma^(t - w - j), as
    ``hybrid.reference_parts``); differentiable, and the final state holds the decayed sums."""
    lolcats, linear = formulation_flags(formulation)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"q must be [B, H, T, D], k/v [B, H_kv, T, D]; got {shapes}")
    B, H, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D or H % k.shape[1] != 0:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} (need H % H_kv == 0)")
    check_head_dim(D)
    check_device(q)
    # Mixed dtypes (e.g. under autocast) run in q's dtype; the casts are differentiable.
    k, v = k.to(q.dtype), v.to(q.dtype)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotImplementedError(f"triton backend supports fp32/fp16/bf16, got {q.dtype}")
    for name, logit in (("window_logit", window_logit), ("linear_logit", linear_logit)):
        if logit.shape != (H,):
            raise ValueError(f"{name} must be [H]=[{H}], got {tuple(logit.shape)}")
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if key_padding_mask is not None and (key_padding_mask.shape != (B, T) or key_padding_mask.dtype != torch.bool):
        raise ValueError(f"key_padding_mask must be bool [B, T]=[{B}, {T}]")
    if log_decay is not None and log_decay.shape != (k.shape[1],):
        raise ValueError(f"log_decay must be [H_kv]=[{k.shape[1]}] (one per KV head), got {tuple(log_decay.shape)}")
    resolve_qk_maps(feature_map)  # rejects unknown names even where the maps go unused
    phi_q = phi_k = None
    if linear and not is_elu1(feature_map) and T > 0:
        hkv = k.shape[1]
        k, v, phi_q, phi_k = _features(q, k, v, feature_map)
        if log_decay is not None and k.shape[1] != hkv:  # k/v expanded to the query heads for a per-head map
            log_decay = log_decay.repeat_interleave(k.shape[1] // hkv)
    F = phi_q.shape[-1] if phi_q is not None else D
    block = block_size or default_block(D, F)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block}")
    if T == 0:
        return q.new_zeros(q.shape), None
    o = _HybridAttentionTriton.apply(
        q, k, v, window_logit, linear_logit, phi_q, phi_k, int(window), lolcats, linear, key_padding_mask, block,
        log_decay,
    )
    if not output_final_state:
        return o, None
    state = prefill_state(
        k.detach(), v.detach(), window=window, feature_map=feature_map, key_padding_mask=key_padding_mask,
        log_decay=None if log_decay is None else log_decay.detach(),
    )
    return o, state
