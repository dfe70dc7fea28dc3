"""Recurrent form of hybrid attention for generation.

The state holds a ring buffer of the last ``w`` keys/values plus the running linear-attention sums
``S = sum phi(k) v^T`` and ``z = sum phi(k)`` over the keys that have left the window. The key at
position ``t`` lives in slot ``t % w``; writing it evicts position ``t - w``, which is folded into
``S`` and ``z`` (with a decaying state, ``log_decay``, after they are scaled by gamma: ``S <- gamma S
+ phi(k) v^T``). Per-token cost and memory are independent of the context length.

The state itself (and how a prefill builds it) lives in ``state``. Steps are functional: they return
a new ``HybridState`` and never modify the old one, so they are safe under autograd and for cache
reordering; a cache that owns its state may let the step update it in place (``inplace``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..kept import kept
from ..state import HybridState
from .reference import FORMULATIONS, combine, mixing_weights


def check_step_shapes(q: Tensor, k: Tensor, v: Tensor, state: HybridState) -> None:
    """q ``[B, H, 1, D]``, k/v ``[B, H_kv, 1, D]`` with H % H_kv == 0, and a state of H_kv heads with
    ring buffers ``[B, H_kv, w, D]`` (every step backend checks its inputs with this)."""
    if (q.dim() != 4 or k.dim() != 4 or q.shape[2] != 1 or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]
            or v.shape[:3] != k.shape[:3] or q.shape[1] % k.shape[1]
            or state.k_window.shape != (k.shape[0], k.shape[1], state.window, q.shape[3])):
        raise ValueError(
            f"step expects q [B, H, 1, D], k/v [B, H_kv, 1, D] (H % H_kv == 0) and a state of H_kv heads; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, state k_window {tuple(state.k_window.shape)}"
        )


def hybrid_attention_step_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: HybridState,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    feature_map: FeatureMap = "elu1",
    formulation: str = "hybrid",
    key_valid: Tensor | None = None,
    inplace: bool = False,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """One token: q ``[B, H, 1, D]``, k/v ``[B, H_kv, 1, D]`` and a state of H_kv heads (GQA: query
    head h reads KV head h // (H / H_kv); H_kv = H for expanded k/v). ``key_valid`` ``[B]`` (or
    ``[B, 1]``) bool, True = real. With H_kv < H the key features must be per KV head (elu1, or a
    (query_map, key_map) pair whose key map has H_kv heads): the state's phi(k) is shared by the
    query heads of a group.

    ``inplace``: the caller gives the state up (a generation cache does), so the step may update
    its buffers in place; without autograd and padding it then takes a leaner path with the same
    result (no buffer copies, fused updates, the mix without the empty-window guards).
    ``log_decay`` ``[H_kv]``: log gamma of a decaying linear state, as the prefill ops take it."""
    check_step_shapes(q, k, v, state)
    if log_decay is not None and log_decay.shape != (k.shape[1],):
        raise ValueError(f"log_decay must be [H_kv]=[{k.shape[1]}], got {tuple(log_decay.shape)}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"formulation must be one of {FORMULATIONS}, got {formulation!r}")
    B, H, _, D = q.shape
    kv_heads = k.shape[1]
    if kv_heads != H and keys_need_query_heads(feature_map):
        raise ValueError(
            "a single per-head feature map (e.g. HedgehogFeatureMap) needs k/v and the state expanded to the "
            "query heads; pass a (query_map, key_map) pair to keep them at the KV heads"
        )
    w = state.window
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    if inplace and key_valid is None and not torch.is_grad_enabled() and state.S.is_contiguous():
        return _step_in_place(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map,
                              log_decay)
    valid_new = (
        torch.ones(B, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.reshape(B).to(torch.bool)
    )

    slot = state.seen % w
    S, z = state.S, state.z
    if state.seen >= w:
        # Slot `slot` holds position seen-w, which leaves the window now: fold it into S, z.
        old_k = state.k_window[:, :, slot : slot + 1].float()  # [B, H, 1, D]
        old_v = state.v_window[:, :, slot : slot + 1].float()
        phi_old = phi_k_map(old_k) * state.window_valid[:, None, slot : slot + 1, None]  # [B, H_kv, 1, F]
        if log_decay is not None:
            gamma = torch.exp(log_decay.float())
            S, z = S * gamma[None, :, None, None], z * gamma[None, :, None]
        S = S + torch.matmul(phi_old.transpose(-1, -2), old_v)
        z = z + phi_old[:, :, 0]
    # Out-of-place writes keep old states intact (and autograd happy); the buffers are only w long.
    k_window, v_window, window_valid = state.k_window.clone(), state.v_window.clone(), state.window_valid.clone()
    k_window[:, :, slot] = k[:, :, 0].to(k_window.dtype)
    v_window[:, :, slot] = v[:, :, 0].to(v_window.dtype)
    window_valid[:, slot] = valid_new
    new_state = HybridState(k_window, v_window, window_valid, S, z, state.seen + 1)

    # The g = H / H_kv query heads of a KV head are rows of one product against its buffers.
    qf = q.float().reshape(B, kv_heads, H // kv_heads, D)
    scores = torch.matmul(qf, k_window.float().transpose(-1, -2)) / math.sqrt(D)  # [B, H_kv, g, w]
    scores = scores.masked_fill(~window_valid[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    win_sum = p.sum(dim=-1, keepdim=True)
    win_avg = torch.matmul(p, v_window.float()) / torch.where(win_sum > 0, win_sum, torch.ones_like(win_sum))

    phi_q = phi_q_map(q.float()).reshape(B, kv_heads, H // kv_heads, -1)  # [B, H_kv, g, F]
    lin_num = torch.matmul(phi_q, S)
    lin_den = torch.matmul(phi_q, z.unsqueeze(-1))

    a, b = mixing_weights(window_logit, linear_logit)
    per_head = [t.reshape(B, H, 1, -1) for t in (win_avg, win_sum, lin_num, lin_den)]
    out = combine(formulation, a, b, *per_head)
    return out.to(q.dtype), new_state


def _step_in_place(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map, log_decay=None):
    """The step for a cache that owns its state, without autograd, the new key real: the window then
    always holds a real key (the new one), so the empty-window guards of ``combine`` are not needed,
    and a full window of real keys needs no mask at all. Every op here is on a few KB, so the step's
    cost is the number of ops it issues (and, inside a model, the bytes they read cold): products are
    ``bmm``/``baddbmm`` on 3-D views (a 4-D ``matmul`` adds expand/reshape/view calls around its bmm),
    and the mixing weights and the accumulations ride on the products and on the exponent."""
    B, H, _, D = q.shape
    Hk, w = k.shape[1], state.window
    g, slot, BH = H // Hk, state.seen % w, B * Hk
    full = state.seen >= w and (state.all_real or bool(state.window_valid.all()))  # every slot holds a real key
    S, z = state.S, state.z
    if state.seen >= w:  # position seen-w leaves the window: fold it into S, z in place
        phi_old = phi_k_map(state.k_window[:, :, slot : slot + 1].float())  # [B, Hk, 1, F]
        if not full:
            phi_old = phi_old * state.window_valid[:, None, slot : slot + 1, None]
        fdim = phi_old.shape[-1]
        phi_old = phi_old.view(BH, fdim, 1)
        if log_decay is not None:
            gamma = torch.exp(log_decay.detach().float())
            S.mul_(gamma.view(1, Hk, 1, 1))
            z.mul_(gamma.view(1, Hk, 1))
        S.view(BH, fdim, D).baddbmm_(phi_old, state.v_window[:, :, slot].float().view(BH, 1, D))
        z.view(BH, fdim, 1).add_(phi_old)
    state.k_window[:, :, slot] = k[:, :, 0]
    state.v_window[:, :, slot] = v[:, :, 0]
    if not full:  # a full window of real keys already marks this slot
        state.window_valid[:, slot] = True
    state.seen += 1
    if state.seen <= w and (state.all_real or bool(state.window_valid[:, : state.seen].all())):
        # No key has left the window yet (S = z = 0), so every formulation is plain softmax over the
        # keys so far, which fill slots 0 .. seen-1 in order: one SDPA call instead of the mix.
        o = F.scaled_dot_product_attention(q.view(B, Hk, g, D), state.k_window[:, :, : state.seen].to(q.dtype),
                                           state.v_window[:, :, : state.seen].to(q.dtype))
        return o.view(B, H, 1, D), state

    qf = q.float().view(BH, g, D)
    kw, vw = state.k_window.float().view(BH, w, D), state.v_window.float().view(BH, w, D)
    # Scaled scores in one product (beta = 0: the input term is only there to broadcast).
    scores = torch.baddbmm(_zero(q.device), qf, kw.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(D))  # [BH, g, w]
    if not full:
        scores.view(B, Hk, g, w).masked_fill_(~state.window_valid[:, None, None, :], float("-inf"))
    if formulation == "window":
        return torch.bmm(torch.softmax(scores, dim=-1), vw).view(B, H, 1, D).to(q.dtype), state
    a, log_a, b = _mixing_terms(window_logit, linear_logit, Hk, g)
    # The linear readout's weight b goes into phi(q) once; num and den then each take one baddbmm.
    phi_q = phi_q_map(q.float()).view(B, Hk, g, -1).mul(b).view(BH, g, -1)  # [BH, g, F]
    if formulation == "lolcats":
        # Unnormalised exp-scores a * exp(s - max s), sharing the normalizer with the linear part; the
        # weight a enters the exponent as log a (one op on [BH, g, 1] instead of one on the scores).
        shift = scores.amax(dim=-1, keepdim=True)
        shift.view(B, Hk, g, 1).sub_(log_a)
        e = scores.sub_(shift).exp_()
        num = torch.baddbmm(torch.bmm(e, vw), phi_q, S.view(BH, -1, D))
        den = torch.baddbmm(e.sum(dim=-1, keepdim=True), phi_q, z.view(BH, -1, 1))
    else:  # hybrid: the softmax average enters with weight a, its normalizer is a
        p = torch.softmax(scores, dim=-1)
        p.view(B, Hk, g, w).mul_(a)
        num = torch.baddbmm(torch.bmm(p, vw), phi_q, S.view(BH, -1, D))
        den = torch.baddbmm(a.expand(B, Hk, g, 1).reshape(BH, g, 1), phi_q, z.view(BH, -1, 1))
    return num.div_(den).view(B, H, 1, D).to(q.dtype), state


_ZEROS: dict[torch.device, Tensor] = {}


def _zero(device: torch.device) -> Tensor:
    """A 0-dim zero on ``device``: baddbmm's ignored input term (beta = 0), made once per device."""
    if device not in _ZEROS:
        _ZEROS[device] = torch.zeros((), device=device)
    return _ZEROS[device]


def _mixing_terms(window_logit: Tensor, linear_logit: Tensor, kv_heads: int, g: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(a, log a, b)`` as ``[1, H_kv, g, 1]`` fp32 (``log a = logsigmoid``: finite for any logit), kept
    on the window logit until either logit changes (``kept``): a decode step would otherwise spend
    three of its ops on them."""
    def make() -> tuple[Tensor, Tensor, Tensor]:
        wl, ll = window_logit.detach().float(), linear_logit.detach().float()
        return tuple(t.view(1, kv_heads, g, 1) for t in (torch.sigmoid(wl), F.logsigmoid(wl), torch.sigmoid(ll)))

    return kept(window_logit, f"_hybrid_mixing_terms_{kv_heads}", (window_logit, linear_logit), make)
