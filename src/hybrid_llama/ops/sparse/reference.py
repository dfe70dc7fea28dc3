"""`reference` backend of the sparse cache: the eviction simulated literally, token by token.

For every batch row and KV head it keeps Python lists of positions (sinks, pending block, cache)
and the linear sums, and follows the rules of ``sparse_cache``'s docstring one position at a time.
Slow (a Python loop over T x B x H_kv) and written to be read: the fast path and the decode step are
tested against it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..gqa import expand_kv
from .config import SparseCacheConfig
from .eviction import SRE_EPS, random_scores


def hybrid_attention_sparse_reference(
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
    log_decay: Tensor | None = None,
) -> tuple[Tensor, None, list]:
    """Returns ``(o, None, caches)``: o ``[B, H, T, D]``, and ``caches[b][h_kv][t]`` the sorted
    positions in the cache when query t attends (for the diagnostics' tests). ``log_decay`` ``[H_kv]``:
    the linear state decays by gamma at every position, and a key folded at position t enters it
    at gamma^(t - w - p), so that key p always weighs gamma^(t - w - p) there, as without the cache."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
        if log_decay is not None:
            log_decay = log_decay.repeat_interleave(q.shape[1] // log_decay.shape[0])
    B, H, T, D = q.shape
    Hk, w, lam, ns = k.shape[1], window, cache.size, cache.sinks
    g = H // Hk
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    qf, kf, vf = q.float(), k.float(), v.float()
    fq, fk = phi_q_map(qf), phi_k_map(kf)  # [B, H, T, F], [B, Hk, T, F]
    real = key_padding_mask if key_padding_mask is not None else torch.ones(B, T, dtype=torch.bool)
    a = torch.sigmoid(window_logit.float())
    b = torch.sigmoid(linear_logit.float())
    out = torch.zeros(B, H, T, D)
    history = [[[] for _ in range(Hk)] for _ in range(B)]
    for bi in range(B):
        for hk in range(Hk):
            sinks, pending, cached, acc = [], [], [], {}
            S = torch.zeros(fk.shape[-1], D)
            z = torch.zeros(fk.shape[-1])
            rand = random_scores(torch.arange(T).view(1, 1, T).expand(1, Hk, T), Hk)[0, hk]
            lam_h = 0.0 if log_decay is None else log_decay[hk].float()
            for t in range(T):
                if log_decay is not None:  # the sums age one position
                    S, z = S * torch.exp(lam_h), z * torch.exp(lam_h)
                if t >= w:
                    s = t - w
                    (sinks if s < ns else pending).append(s)
                    if len(pending) == w:  # the block closes
                        valid = [p for p in cached + pending if real[bi, p]]
                        if cache.score == "sre":  # self-recall error against the state before the fold
                            recall = {p: (fk[bi, hk, p] @ S) / (fk[bi, hk, p] @ z + SRE_EPS) for p in valid}
                            recall = {p: r.detach() for p, r in recall.items()}  # a score, not a path for gradients
                            score = {p: (vf[bi, hk, p] - recall[p]).norm().item() for p in valid}
                        elif cache.score == "random":
                            score = {p: float(rand[p]) for p in valid}
                        else:
                            score = {p: acc.get(p, 0.0) for p in valid}
                        ranked = sorted(valid, key=lambda p: (-score[p], p))  # noqa: B023 (used at once)
                        kept = sorted(ranked[:lam])
                        for p in valid:
                            if p not in kept:
                                weight = 1.0 if log_decay is None else torch.exp(lam_h * (t - w - p))
                                S = S + torch.outer(fk[bi, hk, p], vf[bi, hk, p]) * weight
                                z = z + fk[bi, hk, p] * weight
                        cached, pending = kept, []
                history[bi][hk].append(list(cached))
                exact = [p for p in sinks + cached + pending + list(range(max(0, t - w + 1), t + 1)) if real[bi, p]]
                for h in range(hk * g, (hk + 1) * g):
                    lin_num, lin_den = fq[bi, h, t] @ S, fq[bi, h, t] @ z
                    if exact:
                        s_ = torch.stack([qf[bi, h, t] @ kf[bi, hk, p] for p in exact]) / math.sqrt(D)
                        e = torch.exp(s_ - s_.max())
                        num = a[h] * (e[:, None] * vf[bi, hk, exact]).sum(0) + b[h] * lin_num
                        den = a[h] * e.sum() + b[h] * lin_den
                        if cache.score == "attention":
                            for p, weight in zip(exact, (e / e.sum()).tolist()):
                                acc[p] = acc.get(p, 0.0) + weight
                    else:
                        num, den = b[h] * lin_num, b[h] * lin_den
                    out[bi, h, t] = num / den if den > 0 else torch.zeros(D)
    return out.to(q.dtype), None, history
