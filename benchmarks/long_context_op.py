"""The long-context probe's own hybrid op (``benchmarks/probe_long_context.py``): the shared-normalizer
(``lolcats``) hybrid with the probe's arms applied to its linear part, in fp32. It is checked against
the project's op by ``probe_long_context.py check`` and exists only for the probe."""

from __future__ import annotations

import math

import torch

from hybrid_llama.ops.feature_maps import keys_need_query_heads, resolve_qk_maps


def unrotate(x: torch.Tensor, period: int, theta: float) -> torch.Tensor:
    """Post-RoPE ``[B, H, T, D]`` rotated back by ``period * (t // period)`` positions: the RoPE angles of
    position ``t mod period`` (rotate-half layout), so a feature map sees only angles of its training rows."""
    D, T = x.shape[-1], x.shape[2]
    inv = theta ** (-torch.arange(0, D, 2).float() / D)
    back = -(torch.arange(T) // period * period).float()
    ang = back[:, None] * torch.cat([inv, inv])[None, :]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * torch.cos(ang) + torch.cat([-x2, x1], dim=-1) * torch.sin(ang)


def probe_attention(q, k, v, wl, ll, *, window, feature_map, gamma=1.0, lin_window=0, count_ref=0,
                    wrap=0, theta=1e4, stats=None):
    """Hybrid attention (lolcats formulation) in blocks of ``window`` queries: each block's window keys
    lie in it and the block before; its linear keys are the prefix state of the blocks before that plus
    the older part of the previous block. ``stats`` (a dict) receives the per-query weights of the
    two parts, ``a * sum_win exp(s - m)`` and ``b * phi(q) z`` ``[H, T]``. ``wrap``: the feature maps
    read q and k at RoPE positions ``t mod wrap`` (the window part keeps the true positions)."""
    B, H, T, D = q.shape
    C, g = window, H // k.shape[1]
    phi_q, phi_k = resolve_qk_maps(feature_map)
    kf, vf = k.float(), v.float()
    feat_in = (lambda x: unrotate(x, wrap, theta)) if wrap else (lambda x: x)
    if keys_need_query_heads(feature_map):
        kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
        fk = phi_k(feat_in(kf)).float()
    else:
        fk = phi_k(feat_in(kf)).float()
        kf, vf, fk = (x.repeat_interleave(g, 1) for x in (kf, vf, fk))
    qf = q.float()
    fq = phi_q(feat_in(qf)).float()
    pad = (-T) % C
    n = (T + pad) // C

    def blocks(x):
        return torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B, H, n, C, x.shape[-1])

    def previous(xb):  # block b-1 at block b (zeros before the first)
        return torch.cat([torch.zeros_like(xb[:, :, :1]), xb[:, :, :-1]], dim=2)

    qb, kb, vb, fqb, fkb = map(blocks, (qf, kf, vf, fq, fk))
    tq = torch.arange(C)
    # Window: keys (t - C, t] among [previous block ++ own block] at offsets u: distance t' + C - u.
    kw, vw = torch.cat([previous(kb), kb], dim=3), torch.cat([previous(vb), vb], dim=3)
    dist = tq[:, None] + C - torch.arange(2 * C)[None, :]
    win_mask = ((dist >= 0) & (dist < C)).expand(n, C, 2 * C).clone()
    win_mask[0, :, :C] = False
    s = torch.matmul(qb, kw.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~win_mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    win_sum, win_num = p.sum(-1, keepdim=True), torch.matmul(p, vw)

    # Linear: prefix states P_m over blocks < m, decayed to the last key of block m - 1.
    dec = gamma ** (C - 1 - tq.double()).float()
    U = torch.einsum("bhncf,bhncd->bhnfd", fkb * dec[:, None], vb)
    Uz = (fkb * dec[:, None]).sum(3)
    if gamma == 1.0:
        P = torch.cat([torch.zeros_like(U[:, :, :1]), U.cumsum(2)], dim=2)
        Pz = torch.cat([torch.zeros_like(Uz[:, :, :1]), Uz.cumsum(2)], dim=2)
    else:
        P, Pz = torch.zeros(B, H, n + 1, *U.shape[-2:]), torch.zeros(B, H, n + 1, Uz.shape[-1])
        for m in range(n):
            P[:, :, m + 1] = gamma**C * P[:, :, m] + U[:, :, m]
            Pz[:, :, m + 1] = gamma**C * Pz[:, :, m] + Uz[:, :, m]
    idx = (torch.arange(n) - 1).clamp(min=0)  # P_{b-1}: blocks <= b-2
    S_full, z_full = P[:, :, idx], Pz[:, :, idx]
    if lin_window:
        if gamma != 1.0 or lin_window % C or lin_window < 2 * C:
            raise ValueError("linwin needs gamma 1 and a multiple of the window >= 2 windows")
        M = lin_window // C
        lo = (torch.arange(n) - M + 1).clamp(min=0)
        S_full, z_full = S_full - P[:, :, lo], z_full - Pz[:, :, lo]
    q_dec = (gamma ** (tq.double() + 1)).float()[:, None]
    lin_num = torch.matmul(fqb, S_full) * q_dec
    lin_den = torch.matmul(fqb, z_full.unsqueeze(-1)) * q_dec
    # Block b-1's keys j' <= t' (distance t' - j' + C), decayed by gamma^(t' - j').
    tri = tq[:, None] - tq[None, :]
    A = torch.matmul(fqb, previous(fkb).transpose(-1, -2)) * torch.where(tri >= 0, gamma ** tri.clamp(min=0).double(),
                                                                           0.0).float()
    lin_num, lin_den = lin_num + torch.matmul(A, previous(vb)), lin_den + A.sum(-1, keepdim=True)
    if lin_window:  # block b-M's keys j' > t' are still fewer than M * C positions back
        M = lin_window // C
        old = torch.cat([torch.zeros_like(fkb[:, :, :M]), fkb[:, :, :-M]], dim=2)[:, :, :n]
        old_v = torch.cat([torch.zeros_like(vb[:, :, :M]), vb[:, :, :-M]], dim=2)[:, :, :n]
        A2 = torch.matmul(fqb, old.transpose(-1, -2)) * (tri < 0).float()
        lin_num, lin_den = lin_num + torch.matmul(A2, old_v), lin_den + A2.sum(-1, keepdim=True)
    a = torch.sigmoid(wl.float()).view(1, H, 1, 1, 1)
    b = torch.sigmoid(ll.float()).view(1, H, 1, 1, 1)
    if count_ref:
        t = (torch.arange(n)[:, None] * C + tq[None, :]).float()
        n_lin = (t - C + 1).clamp(min=1)
        b = b * (float(count_ref - C) / n_lin).clamp(max=1.0)[..., None]
    w_win, w_lin = a * win_sum, b * lin_den
    o = (a * win_num + b * lin_num) / (w_win + w_lin)
    if stats is not None:
        stats["w_win"] = w_win[0, ..., 0].reshape(H, -1)[:, :T]
        stats["w_lin"] = w_lin[0, ..., 0].reshape(H, -1)[:, :T]
    return o.reshape(B, H, n * C, D)[:, :, :T].to(q.dtype)
