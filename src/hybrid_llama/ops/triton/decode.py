"""`triton` backend, decode: one fused kernel per generated token.

One program per (batch row, KV head):
  1. when ``seen >= w``, fold the key leaving the window (slot ``seen % w``, position seen-w) into
     S, z (only if that slot held a real key); with a decaying state (``log_decay``, constexpr
     ``DECAY``) S, z are first scaled by gamma of the KV head, ``S <- gamma S + phi(k) v^T``, as the
     torch step does (also when the leaving slot was padding);
  2. write the new key/value into that slot of the ring buffer;
  3. for every query head sharing the KV head (GQA): softmax over the w slots, linear readout
     ``phi(q) S`` / ``phi(q) . z``, and the same combination as ``reference.combine``.
Traffic per KV head: the w x D ring buffer and the F x D state, read once and written once,
independent of the context length. No tensor cores: everything is a vector-matrix product.

Feature maps: elu1 is computed in the kernel (F = D). For any other map (one callable, or a
(query_map, key_map) pair) the step computes in torch phi(q) of the new query ``[B, H, F]`` and
phi(k) of the key leaving the window ``[B, H_kv, F]`` (the kernel multiplies it by the slot's
validity, so a padded key adds nothing), and the kernel reads them (constexpr ``FEATURES``); the
state is then ``S [B, H_kv, F, D]``, ``z [B, H_kv, F]``. ``formulation="window"`` skips the
linear readout (constexpr ``LINEAR``) but still folds evicted keys into S, z, as the torch step
does, so the states of both steps stay equal.

Like ``decode.hybrid_attention_step_torch`` the step is functional by default: it returns a new
``HybridState`` and leaves the old one untouched (the kernel reads the old buffers and writes new
ones). ``inplace=True`` updates the state's tensors in place instead (only the changed slot is
written), for callers that own their state, e.g. a benchmark or a static-cache generation loop.
The step is inference-only: with grad enabled and an input (or a feature map's output) that
requires grad it raises NotImplementedError, so ``hybrid_attention_step`` falls back to the
differentiable torch step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..feature_maps import FeatureMap, is_elu1, keys_need_query_heads, resolve_qk_maps
from ..hybrid.step import check_step_shapes
from ..state import HybridState
from .common import (
    check_device,
    check_feature_dim,
    check_head_dim,
    formulation_flags,
    last_dim_contiguous,
    phi,
)


@triton.jit(do_not_specialize=["slot"])  # slot changes every token: one compiled variant
def _step_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, fq_ptr, fk_ptr,
    kw_ptr, vw_ptr, s_ptr, z_ptr,  # old state
    kw_new, vw_new, s_new, z_new,  # new state (the same tensors when in place)
    valid_ptr, ev_ptr, a_ptr, b_ptr, lam_ptr,
    sqb, sqh, skb, skh, svb, svh, sob, soh,
    H, HKV, slot, sm_scale,
    W: tl.constexpr, WP: tl.constexpr, D: tl.constexpr, F: tl.constexpr, EVICT: tl.constexpr,
    INPLACE: tl.constexpr, LOLCATS: tl.constexpr, FEATURES: tl.constexpr, LINEAR: tl.constexpr,
    DECAY: tl.constexpr,
):
    bhk = tl.program_id(0).to(tl.int64)  # 64-bit offsets for large batches
    b = bhk // HKV
    hk = bhk % HKV
    d = tl.arange(0, D)
    f = tl.arange(0, F)
    ws = tl.arange(0, WP)
    w_ok = ws < W
    st_off = bhk * F * D + f[:, None] * D + d[None, :]
    S = tl.load(s_ptr + st_off)
    z = tl.load(z_ptr + bhk * F + f)
    win_off = bhk * W * D + ws[:, None] * D + d[None, :]
    K = tl.load(kw_ptr + win_off, mask=w_ok[:, None], other=0.0)
    V = tl.load(vw_ptr + win_off, mask=w_ok[:, None], other=0.0)
    if EVICT:
        # The slot's current occupant (position seen - w) leaves the window.
        ev = tl.load(ev_ptr + b).to(tl.float32)
        v_old = tl.sum(tl.where(ws[:, None] == slot, V, 0.0).to(tl.float32), 0)
        if FEATURES:
            pk = tl.load(fk_ptr + bhk * F + f).to(tl.float32) * ev
        else:
            k_old = tl.sum(tl.where(ws[:, None] == slot, K, 0.0).to(tl.float32), 0)
            pk = phi(k_old) * ev
        if DECAY:
            gamma = tl.exp(tl.load(lam_ptr + hk))
            S = S * gamma
            z = z * gamma
        S += pk[:, None] * v_old[None, :]
        z += pk
    k_in = tl.load(k_ptr + b * skb + hk * skh + d).to(kw_ptr.dtype.element_ty)
    v_in = tl.load(v_ptr + b * svb + hk * svh + d).to(vw_ptr.dtype.element_ty)
    is_slot = ws[:, None] == slot
    K = tl.where(is_slot, k_in[None, :], K)
    V = tl.where(is_slot, v_in[None, :], V)
    if INPLACE:
        tl.store(kw_new + bhk * W * D + slot * D + d, k_in)
        tl.store(vw_new + bhk * W * D + slot * D + d, v_in)
    else:
        tl.store(kw_new + win_off, K, mask=w_ok[:, None])
        tl.store(vw_new + win_off, V, mask=w_ok[:, None])
    tl.store(s_new + st_off, S)
    tl.store(z_new + bhk * F + f, z)

    valid = tl.load(valid_ptr + b * W + ws, mask=w_ok, other=0) != 0
    Kf = K.to(tl.float32)
    Vf = V.to(tl.float32)
    group = H // HKV
    for hh in range(0, group):
        h = hk * group + hh
        q = tl.load(q_ptr + b * sqb + h * sqh + d).to(tl.float32)
        s = tl.sum(Kf * q[None, :], 1) * sm_scale
        s = tl.where(valid, s, float("-inf"))
        m = tl.max(s, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp(s - m)  # 0 on empty / padded slots
        l = tl.sum(p, 0)
        acc = tl.sum(p[:, None] * Vf, 0)
        # Without the linear part the caller passes a = 1, b = 0: out = acc / l exactly.
        a = tl.load(a_ptr + h)
        bw = tl.load(b_ptr + h)
        if LINEAR:
            if FEATURES:
                pq = tl.load(fq_ptr + (b * H + h) * F + f).to(tl.float32)
            else:
                pq = phi(q)
            lin = tl.sum(pq[:, None] * S, 0)
            lden = tl.sum(pq * z, 0)
        else:
            lin = tl.zeros([D], tl.float32)
            lden = 0.0
        if LOLCATS:
            num = a * acc + bw * lin
            den = a * l + bw * lden
        else:
            has_win = l > 0
            num = tl.where(has_win, a / tl.where(has_win, l, 1.0), 0.0) * acc + bw * lin
            den = tl.where(has_win, a, 0.0) + bw * lden
        out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
        tl.store(o_ptr + b * sob + h * soh + d, out.to(o_ptr.dtype.element_ty))


def hybrid_attention_step_triton(
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
    """One decode step, same semantics as ``hybrid_llama.ops.hybrid.step.hybrid_attention_step_torch``.

    q ``[B, H, 1, D]``; k, v ``[B, H_kv, 1, D]`` with the state's heads equal to H_kv (H % H_kv == 0;
    H_kv = H for expanded k/v); ``key_valid`` ``[B]`` bool. Returns (out ``[B, H, 1, D]``, new state).
    ``feature_map``: "elu1" (fused), or a callable / (query_map, key_map) pair applied in torch to the
    new query and to the key leaving the window; the state's S is then ``[B, H_kv, F, D]``.
    ``log_decay`` ``[H_kv]``: log gamma of a decaying linear state; when a key leaves the window S, z
    are scaled by gamma before it is folded in (None: no decay).
    """
    lolcats, linear = formulation_flags(formulation)
    check_step_shapes(q, k, v, state)
    if v.shape != k.shape:
        raise ValueError(f"triton decode needs v shaped like k {tuple(k.shape)}, got {tuple(v.shape)}")
    if log_decay is not None and log_decay.shape != (k.shape[1],):
        raise ValueError(f"log_decay must be [H_kv]=[{k.shape[1]}], got {tuple(log_decay.shape)}")
    B, H, _, D = q.shape
    HKV = k.shape[1]
    w = state.window
    check_head_dim(D)
    check_device(q)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotImplementedError(f"triton decode supports fp32/fp16/bf16, got {q.dtype}")
    features = not is_elu1(feature_map)
    query_map, key_map = resolve_qk_maps(feature_map)
    if features and HKV != H and keys_need_query_heads(feature_map):
        raise ValueError(
            "a single per-head feature map (e.g. HedgehogFeatureMap) needs k/v and the state expanded to the "
            "query heads; pass a (query_map, key_map) pair to keep them at the KV heads"
        )
    F = state.S.shape[2] if state.S.dim() == 4 else -1
    if state.S.shape != (B, HKV, F, D) or state.z.shape != (B, HKV, F):
        raise ValueError(f"state S {tuple(state.S.shape)} / z {tuple(state.z.shape)} do not match [B, H_kv, F, D] "
                         f"= [{B}, {HKV}, F, {D}]")
    if not features and F != D:
        raise NotImplementedError("triton decode supports elu1 states with F = D only")
    if features:
        check_feature_dim(F, D)
    slot = state.seen % w
    evict = state.seen >= w
    # Features in torch, as the torch step computes them: phi(q) for the readout, phi(k) of the key
    # leaving the window (masked by the slot's validity in the kernel).
    phi_q = phi_old = None
    if features:
        if linear:
            phi_q = query_map(q.float())
            if phi_q.shape != (B, H, 1, F):
                raise ValueError(f"query features {tuple(phi_q.shape)} do not match the state's width F = {F}")
        if evict:
            phi_old = key_map(state.k_window[:, :, slot : slot + 1].float())
            if phi_old.shape != (B, HKV, 1, F):
                raise ValueError(f"key features {tuple(phi_old.shape)} do not match the state's width F = {F}")
    grad_inputs = (q, k, v, window_logit, linear_logit, *(x for x in (phi_q, phi_old, log_decay) if x is not None))
    if torch.is_grad_enabled() and any(x.requires_grad for x in grad_inputs):
        # The step kernel has no backward; the dispatcher then uses the (differentiable) torch step.
        raise NotImplementedError("triton decode step is inference-only (no autograd)")
    valid_new = torch.ones(B, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.reshape(B)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    kw, vw = state.k_window.contiguous(), state.v_window.contiguous()
    S, z = state.S.float().contiguous(), state.z.float().contiguous()
    ev = state.window_valid[:, slot].to(torch.int8).contiguous()  # read before the slot is overwritten
    # [B, H, F] and [B, H_kv, F], contiguous; placeholders (never read) when the kernel computes elu1.
    fq = phi_q.reshape(B, H, F).contiguous() if phi_q is not None else q
    fk = phi_old.reshape(B, HKV, F).contiguous() if phi_old is not None else k
    if inplace:
        if not (kw is state.k_window and vw is state.v_window and S is state.S and z is state.z):
            raise ValueError("inplace=True needs contiguous fp32 S/z and contiguous window buffers")
        valid = state.window_valid
        valid[:, slot] = valid_new.to(torch.bool)
        new = state
        new.seen += 1
    else:
        valid = state.window_valid.clone()
        valid[:, slot] = valid_new.to(torch.bool)
        new = HybridState(torch.empty_like(kw), torch.empty_like(vw), valid, torch.empty_like(S), torch.empty_like(z),
                          state.seen + 1)
    valid8 = valid.to(torch.int8)
    if linear:
        a = torch.sigmoid(window_logit.detach().float()).contiguous()
        bw = torch.sigmoid(linear_logit.detach().float()).contiguous()
    else:  # the window formulation: hybrid with b = 0, a = 1 makes its normalisation exact
        a = torch.ones(H, device=q.device, dtype=torch.float32)
        bw = torch.zeros(H, device=q.device, dtype=torch.float32)
    decay = log_decay is not None
    lam = log_decay.float().contiguous() if decay else a  # a: a placeholder, never read
    out = torch.empty_like(q)
    _step_kernel[(B * HKV,)](
        q, k, v, out, fq, fk, kw, vw, S, z, new.k_window, new.v_window, new.S, new.z, valid8, ev, a, bw, lam,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        H, HKV, slot, 1.0 / math.sqrt(D),
        W=w, WP=triton.next_power_of_2(w), D=D, F=F, EVICT=evict, INPLACE=inplace, LOLCATS=lolcats,
        FEATURES=features, LINEAR=linear, DECAY=decay,
        num_warps=8 if D * max(F, w) >= 64 * 64 else 4,  # 4 warps need ~254 registers at D = w = 64
    )
    return out, new
