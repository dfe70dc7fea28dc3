"""`triton` backend, decode: one fused kernel per generated token.

One program per (batch row, KV head):
  1. when ``seen >= w``, fold the key leaving the window (slot ``seen % w``, position seen-w) into
     S, z (only if that slot held a real key);
  2. write the new key/value into that slot of the ring buffer;
  3. for every query head sharing the KV head (GQA): softmax over the w slots, linear readout
     ``phi(q) S`` / ``phi(q) . z``, and the same combination as ``reference.combine``.
Traffic per KV head: the w x D ring buffer and the F x D state, read once and written once,
independent of the context length. No tensor cores: everything is a vector-matrix product.

Like ``decode.hybrid_attention_step_torch`` the step is functional by default: it returns a new
``HybridState`` and leaves the old one untouched (the kernel reads the old buffers and writes new
ones). ``inplace=True`` updates the state's tensors in place instead (only the changed slot is
written), for callers that own their state, e.g. a benchmark or a static-cache generation loop.
The step is inference-only: with grad enabled and an input that requires grad it raises
NotImplementedError, so ``hybrid_attention_step`` falls back to the differentiable torch step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .decode import HybridState, check_step_shapes
from .triton_common import (
    check_device,
    check_feature_map,
    check_formulation,
    check_head_dim,
    last_dim_contiguous,
    phi,
)


@triton.jit(do_not_specialize=["slot"])  # slot changes every token: one compiled variant
def _step_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    kw_ptr, vw_ptr, s_ptr, z_ptr,  # old state
    kw_new, vw_new, s_new, z_new,  # new state (the same tensors when in place)
    valid_ptr, ev_ptr, a_ptr, b_ptr,
    sqb, sqh, skb, skh, svb, svh, sob, soh,
    H, HKV, slot, sm_scale,
    W: tl.constexpr, WP: tl.constexpr, D: tl.constexpr, EVICT: tl.constexpr, INPLACE: tl.constexpr,
    LOLCATS: tl.constexpr,
):
    bhk = tl.program_id(0).to(tl.int64)  # 64-bit offsets for large batches
    b = bhk // HKV
    hk = bhk % HKV
    d = tl.arange(0, D)
    ws = tl.arange(0, WP)
    w_ok = ws < W
    st_off = bhk * D * D + d[:, None] * D + d[None, :]
    S = tl.load(s_ptr + st_off)
    z = tl.load(z_ptr + bhk * D + d)
    win_off = bhk * W * D + ws[:, None] * D + d[None, :]
    K = tl.load(kw_ptr + win_off, mask=w_ok[:, None], other=0.0)
    V = tl.load(vw_ptr + win_off, mask=w_ok[:, None], other=0.0)
    if EVICT:
        # The slot's current occupant (position seen - w) leaves the window.
        ev = tl.load(ev_ptr + b).to(tl.float32)
        k_old = tl.sum(tl.where(ws[:, None] == slot, K, 0.0).to(tl.float32), 0)
        v_old = tl.sum(tl.where(ws[:, None] == slot, V, 0.0).to(tl.float32), 0)
        pk = phi(k_old) * ev
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
    tl.store(z_new + bhk * D + d, z)

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
        pq = phi(q)
        lin = tl.sum(pq[:, None] * S, 0)
        lden = tl.sum(pq * z, 0)
        a = tl.load(a_ptr + h)
        bw = tl.load(b_ptr + h)
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
    feature_map="elu1",
    formulation: str = "hybrid",
    key_valid: Tensor | None = None,
    inplace: bool = False,
) -> tuple[Tensor, HybridState]:
    """One decode step, same semantics as ``hybrid_llama.ops.decode.hybrid_attention_step_torch``.

    q ``[B, H, 1, D]``; k, v ``[B, H_kv, 1, D]`` with the state's heads equal to H_kv (H % H_kv == 0;
    H_kv = H for expanded k/v); ``key_valid`` ``[B]`` bool. Returns (out ``[B, H, 1, D]``, new state).
    """
    check_feature_map(feature_map)
    lolcats = check_formulation(formulation)
    check_step_shapes(q, k, v, state)
    if v.shape != k.shape:
        raise ValueError(f"triton decode needs v shaped like k {tuple(k.shape)}, got {tuple(v.shape)}")
    B, H, _, D = q.shape
    HKV = k.shape[1]
    w = state.window
    check_head_dim(D)
    check_device(q)
    if state.S.shape != (B, HKV, D, D):
        raise NotImplementedError("triton decode supports elu1 states with F = D only")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotImplementedError(f"triton decode supports fp32/fp16/bf16, got {q.dtype}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, window_logit, linear_logit)):
        # The step kernel has no backward; the dispatcher then uses the (differentiable) torch step.
        raise NotImplementedError("triton decode step is inference-only (no autograd)")
    valid_new = torch.ones(B, dtype=torch.bool, device=q.device) if key_valid is None else key_valid.reshape(B)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    kw, vw = state.k_window.contiguous(), state.v_window.contiguous()
    S, z = state.S.float().contiguous(), state.z.float().contiguous()
    slot = state.seen % w
    evict = state.seen >= w
    ev = state.window_valid[:, slot].to(torch.int8).contiguous()  # read before the slot is overwritten
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
    a = torch.sigmoid(window_logit.detach().float()).contiguous()
    bw = torch.sigmoid(linear_logit.detach().float()).contiguous()
    out = torch.empty_like(q)
    _step_kernel[(B * HKV,)](
        q, k, v, out, kw, vw, S, z, new.k_window, new.v_window, new.S, new.z, valid8, ev, a, bw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        H, HKV, slot, 1.0 / math.sqrt(D),
        W=w, WP=triton.next_power_of_2(w), D=D, EVICT=evict, INPLACE=inplace, LOLCATS=lolcats,
        num_warps=8 if D * max(D, w) >= 64 * 64 else 4,  # 4 warps need ~254 registers at D = w = 64
    )
    return out, new
