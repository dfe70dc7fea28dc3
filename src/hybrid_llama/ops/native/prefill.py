"""The parallel op on the CPU as its recurrence in native code (``cpu_kernels.c``'s
``hybrid_prefill_f32``), for inference.

Per position the kernel computes each query head's window softmax over its w keys and its linear
readout phi(q) S, feature maps included, in blocks of 16 positions whose data stays in the L1 cache;
the keys leaving the window are folded into S and z once per block (each query adds the block's
keys before it itself). It does the op's own FLOPs only (the chunked torch ops
compute twice the window's, a band of each [w, 2w] block, and an intra-chunk product besides) and
builds no intermediate tensor: q, k and v are read where they are (a model's views of [B, T, H, D]
included) and the output is written straight into the ``[B, T, H, D]`` memory the layer's output
projection reads.

Threads: the positions are split into one segment per torch thread. A segment starts from the linear
sums of the keys before it (one product per segment, computed here with torch), so the segments run
at once, in one OpenMP loop of the kernel on torch's own thread pool (the build links the libgomp
torch loaded; Python threads were tried: torch's idle OpenMP threads spin for milliseconds after
each op and took a core from them). A build without OpenMP runs one segment.

A decaying linear state (``log_decay``) runs here too: the kernel scales S and z by gamma before each
fold, and a segment's starting sums are those as of the position before it (each earlier segment's
sums aged by gamma per position, plus its own keys at their ages).

Covered: CPU tensors without autograd, no padding mask, head dim a multiple of 64 (the kernel's tile)
up to 256, window up to 4096, any formulation, batch and GQA, elu1 or Hedgehog maps (query map per
query head, key map per KV head), with or without a decay. Anything else returns None and the caller
runs the chunked torch ops, which are what the kernel is tested against.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..feature_maps import FeatureMap
from ..state import HybridState, linear_sums_of, prefill_state
from . import build
from .bindings import TILE, Kernel, fp32_rows, pointers, prefill_maps, strides3
from .build import FORMULATION_CODES, MAX_D, MAX_F, MAX_W

PREFILL, WORKSPACE = Kernel("hybrid_prefill_f32"), Kernel("hybrid_prefill_workspace")
MIN_SEGMENT = 128  # positions per thread below which one thread does it all


def covers(q: Tensor, k: Tensor, window: int, formulation: str, key_padding_mask: Tensor | None,
           log_decay: Tensor | None = None) -> bool:
    """Whether :func:`hybrid_attention_cpu` may take these arguments (cheap checks, before any work;
    the feature map is checked there). A decay is covered wherever it is on the CPU."""
    D = q.shape[-1]
    return (build.enabled() and q.is_cpu and key_padding_mask is None and formulation in FORMULATION_CODES
            and D % TILE == 0 and D <= MAX_D and 1 <= window <= MAX_W and not torch.is_grad_enabled()
            and q.shape[2] > window and (log_decay is None or log_decay.is_cpu))


def _segments(T: int, threads: int) -> list[int]:
    n = max(1, min(threads, T // MIN_SEGMENT))
    return [T * i // n for i in range(n + 1)]


def hybrid_attention_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int,
    formulation: str,
    feature_map: FeatureMap,
    output_final_state: bool,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState | None] | None:
    """``(o, final_state)`` as the other backends give them, or None where the kernel does not apply
    (:func:`covers`, checked by the caller; other feature maps; no compiler). Inputs already checked
    (``check_inputs``). ``log_decay`` ``[H_kv]``: log gamma of a decaying linear state, or None."""
    B, H, T, D = q.shape
    Hk, w = k.shape[1], window
    maps = prefill_maps(feature_map, H, Hk, D)
    lib = build.load()
    if maps is None or lib is None:
        return None
    map_code, weights, F = maps
    if F > MAX_F or (log_decay is not None and log_decay.shape != (Hk,)):
        return None
    q32, k32, v32 = fp32_rows(q), fp32_rows(k), fp32_rows(v)
    wa = torch.sigmoid(window_logit.detach().float()).contiguous()
    wb = torch.sigmoid(linear_logit.detach().float()).contiguous()
    out = q32.new_empty(B, T, H, D).transpose(1, 2)  # the layer reads [B, T, H * D]: no copy there

    bounds = _segments(T, min(torch.get_num_threads(), lib.hybrid_native_threads()))
    n = len(bounds) - 1
    decay = None if log_decay is None else log_decay.detach().float().contiguous()
    # Segment s starts from [S | z] over the keys 0 .. bounds[s]-w-1: prefix sums of one product each.
    # With a decay they are the sums as of position bounds[s]-1: the previous segment's aged by gamma
    # per key that left in between, its own keys weighted by their ages at the last of them.
    S = q32.new_zeros(n, B, Hk, F, D)
    z = q32.new_zeros(n, B, Hk, F)
    linear = formulation != "window"
    if linear and n > 1:
        for s in range(1, n):
            lo, hi = max(bounds[s - 1] - w, 0), max(bounds[s] - w, 0)
            S_part, z_part = linear_sums_of(k32[:, :, lo:hi], v32[:, :, lo:hi], None, feature_map, decay)
            if decay is None:
                torch.add(S[s - 1], S_part, out=S[s])
                torch.add(z[s - 1], z_part, out=z[s])
            else:
                aged = torch.exp(decay * (hi - lo))  # [Hk]
                torch.addcmul(S_part, S[s - 1], aged[:, None, None], out=S[s])
                torch.addcmul(z_part, z[s - 1], aged[:, None], out=z[s])
    stride = WORKSPACE(g=H // Hk, w=w, D=D)
    work = q32.new_empty(n, stride)
    wq, bq, wk, bk = pointers(*weights)
    (q_b, q_h, q_t), (k_b, k_h, k_t), (v_b, v_h, v_t), (o_b, o_h, o_t) = map(strides3, (q32, k32, v32, out))
    code = PREFILL(
        B=B, H=H, Hk=Hk, T=T, D=D, w=w, F=F, formulation=FORMULATION_CODES[formulation], map=map_code,
        segments=n, bounds=(ctypes.c_longlong * (n + 1))(*bounds),
        q=q32.data_ptr(), q_b=q_b, q_h=q_h, q_t=q_t, k=k32.data_ptr(), k_b=k_b, k_h=k_h, k_t=k_t,
        v=v32.data_ptr(), v_b=v_b, v_h=v_h, v_t=v_t, wq=wq, bq=bq, wk=wk, bk=bk, wa=wa.data_ptr(), wb=wb.data_ptr(),
        log_decay=None if decay is None else decay.data_ptr(),
        S=S.data_ptr(), z=z.data_ptr(), out=out.data_ptr(), o_b=o_b, o_h=o_h, o_t=o_t, work=work.data_ptr(),
        work_stride=stride,
    )
    if code != 0:
        return None
    final_state = None
    if output_final_state:
        # The last segment ends with the sums over the keys 0 .. T-1-w (as of T-1): the decode state's.
        final_state = prefill_state(k, v, window=window, feature_map=feature_map,
                                    linear_sums=(S[-1], z[-1]) if linear else None, log_decay=decay)
    return out.to(q.dtype), final_state
