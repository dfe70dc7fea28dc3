"""A decode state continued by several tokens at once: the chunked form with an initial state.

A cache that already holds a prompt (a chat's earlier turns, a shared few-shot preamble) meets L new
tokens at positions t0 .. t0+L-1, t0 = ``state.seen``. Running ``hybrid_attention_step`` L times gives
the answer one token at a time, each step a few dozen small ops; here the L queries run as one masked
product against the keys they can reach, so the cost is that of a prefill of L tokens.

Query i (position t0 + i) reads, with E the ring's w keys in position order (t0-w .. t0-1, the slots
never written invalid) followed by the L new keys (E index j is position t0 - w + j):

- exactly, the window: E indices i < j <= i + w;
- linearly, the keys that left the window since the state was taken, E indices j <= i, each at
  gamma^(i - j), plus the state's own sums ``S, z`` at gamma^(i + 1) (a step ages them, then folds).

The final state is the ring of E's last w keys and the sums aged by gamma^L with E's first L keys
folded in: what L steps leave, up to the order of fp32 sums. Every product is ``[L, w + L]``, so
longer continuations run in slabs of ``SLAB`` tokens, each continuing the state the last one left.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..state import HybridState, aged_sums
from .reference import FORMULATIONS, combine, mixing_weights

SLAB = 256  # queries per product: keeps the [L, w + L] scores a few MB at long continuations


def ring_in_order(state: HybridState) -> tuple[Tensor, Tensor, Tensor]:
    """The ring's keys, values ``[B, Hk, w, D]`` and validity ``[B, w]`` in position order: index j
    holds position ``seen - w + j`` (slot ``p % w``); slots of positions below 0 are invalid."""
    shift = -(state.seen % state.window)
    return tuple(torch.roll(x, shift, dims=x.dim() - 2 if x.dim() == 4 else 1)
                 for x in (state.k_window, state.v_window, state.window_valid))


def ring_from_ordered(k: Tensor, v: Tensor, valid: Tensor, seen: int) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`ring_in_order`: keys of positions seen-w .. seen-1 back into slots p % w."""
    shift = seen % k.shape[2]
    return torch.roll(k, shift, dims=2), torch.roll(v, shift, dims=2), torch.roll(valid, shift, dims=1)


def check_continuation(q: Tensor, k: Tensor, v: Tensor, state: HybridState, feature_map: FeatureMap) -> None:
    B, H, L, D = q.shape
    if k.shape[0] != B or k.shape[2] != L or v.shape[:3] != k.shape[:3] or H % k.shape[1]:
        raise ValueError(f"q, k, v must be [B, H, L, D], [B, H_kv, L, D] (H % H_kv == 0); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if state.k_window.shape[:2] != k.shape[:2] or state.k_window.shape[3] != D:
        raise ValueError(f"the state holds {tuple(state.k_window.shape)} keys, k is {tuple(k.shape)}")
    if k.shape[1] != H and keys_need_query_heads(feature_map):
        raise ValueError("a single per-head feature map needs k/v and the state at the query heads; pass a "
                         "(query_map, key_map) pair to keep them at the KV heads")


def hybrid_attention_continue_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: HybridState,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    feature_map: FeatureMap = "elu1",
    formulation: str = "hybrid",
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """q ``[B, H, L, D]``, k/v ``[B, H_kv, L, D]`` (every new key real) continuing ``state``; returns
    (out ``[B, H, L, D]``, the state after them), as L calls of ``hybrid_attention_step`` would. The
    given state is left as it was."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    if state.sparse is not None:
        raise ValueError("a state with a sparse cache continues with sparse.continuation")
    check_continuation(q, k, v, state, feature_map)
    outs = []
    for s in range(0, q.shape[2], SLAB):
        o, state = _continue_slab(q[:, :, s : s + SLAB], k[:, :, s : s + SLAB], v[:, :, s : s + SLAB], state,
                                  window_logit, linear_logit, feature_map, formulation, log_decay)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)), state


def _continue_slab(q, k, v, state: HybridState, window_logit, linear_logit, feature_map, formulation, log_decay):
    B, H, L, D = q.shape
    Hk, w, t0 = k.shape[1], state.window, state.seen
    g = H // Hk
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    ring_k, ring_v, ring_ok = ring_in_order(state)
    keys = torch.cat([ring_k.float(), k.float()], dim=2)  # E: [B, Hk, w + L, D]
    vals = torch.cat([ring_v.float(), v.float()], dim=2)
    ok = torch.cat([ring_ok, torch.ones(B, L, dtype=torch.bool, device=q.device)], dim=1)  # [B, w + L]

    i = torch.arange(L, device=q.device).view(-1, 1)
    j = torch.arange(w + L, device=q.device).view(1, -1)
    in_window = (j > i) & (j <= i + w) & ok[:, None, None, :]  # [B, 1, L, w + L]
    qf = q.float().reshape(B, Hk, g * L, D)
    scores = (torch.matmul(qf, keys.transpose(-1, -2)) / math.sqrt(D)).view(B, Hk, g, L, w + L)
    scores = scores.masked_fill(~in_window[:, :, None], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    win_sum = p.sum(dim=-1, keepdim=True)
    win_avg = torch.matmul(p, vals[:, :, None]) / torch.where(win_sum > 0, win_sum, torch.ones_like(win_sum))

    # The linear part: the keys that left the window since t0 (E index j <= i), at gamma^(i - j).
    phi_k = phi_k_map(keys) * ok[:, None, :, None]  # [B, Hk, w + L, F]
    phi_q = phi_q_map(q.float()).reshape(B, Hk, g, L, -1)
    gap = (i - j).float()  # [L, w + L]
    lin_mask = (gap >= 0).float()
    if log_decay is not None:
        lam = log_decay.float().view(1, Hk, 1, 1, 1)
        lin_mask = lin_mask * torch.exp(lam * gap.clamp(min=0))  # [1, Hk, 1, L, w + L]
        state_age = torch.exp(lam * (i.float() + 1))  # the state's sums at query i: [1, Hk, 1, L, 1]
    attn = torch.matmul(phi_q, phi_k[:, :, None].transpose(-1, -2)) * lin_mask
    S0, z0 = state.S, state.z
    from_state_num = torch.matmul(phi_q, S0[:, :, None])  # [B, Hk, g, L, D]
    from_state_den = torch.matmul(phi_q, z0[:, :, None, :, None])
    if log_decay is not None:
        from_state_num, from_state_den = from_state_num * state_age, from_state_den * state_age
    lin_num = torch.matmul(attn, vals[:, :, None]) + from_state_num
    lin_den = attn.sum(dim=-1, keepdim=True) + from_state_den

    a, b = mixing_weights(window_logit, linear_logit)
    per_head = [x.reshape(B, H, L, -1) for x in (win_avg, win_sum, lin_num, lin_den)]
    out = combine(formulation, a, b, *per_head)

    # The state after the slab: E's first L keys folded (key j at gamma^(L - 1 - j)), its last w the ring.
    folded = phi_k[:, :, :L]
    if log_decay is not None:
        age = torch.arange(L - 1, -1, -1, device=q.device, dtype=torch.float32)
        folded = folded * torch.exp(log_decay.float().view(1, Hk, 1, 1) * age.view(1, 1, -1, 1))
    S0, z0 = aged_sums(S0, z0, log_decay, L)
    S = S0 + torch.matmul(folded.transpose(-1, -2), vals[:, :, :L])
    z = z0 + folded.sum(dim=2)
    seen = t0 + L
    k_ring, v_ring, ring_valid = ring_from_ordered(
        torch.cat([ring_k, k.to(ring_k.dtype)], 2)[:, :, L:], torch.cat([ring_v, v.to(ring_v.dtype)], 2)[:, :, L:],
        ok[:, L:], seen)
    new_state = HybridState(k_ring.contiguous(), v_ring.contiguous(), ring_valid.contiguous(), S.contiguous(),
                            z.contiguous(), seen, all_real=state.all_real)
    return out.to(q.dtype), new_state
