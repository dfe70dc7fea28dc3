"""The sparse cache's parallel op on the CPU with native attention (``cpu_kernels.c``'s
``hybrid_sparse_group_f32``), for inference.

The torch path (``sparse_cache.hybrid_attention_sparse``) attends each group of queries (those that
see the same closed blocks) with about 40 tensor ops over masks of the whole exact set; its masks,
exponentials and small batched products, not its arithmetic, were four fifths of a layer's prefill
at 2048 tokens (docs/performance.md). Here one kernel call computes a group's outputs, linear readout
included, straight into the ``[B, T, H, D]`` memory the output projection reads; the block that
closes between two groups (scores, eviction, fold into ``S, z``) runs natively too for the ``sre``
score (``hybrid_sparse_close_f32``: the same scores to fp32 rounding, so the same keys but for
near-ties), and in torch, the torch path's own calls, for the ``random`` score.

A decaying linear state (``log_decay``) as the block loop keeps it: S, z as of each group's first
position, which the group kernel reads at gamma^(the query's offset); before a close they are aged to
its position here (one multiply), and the close folds each loser at gamma^(its age); the final
state's sums are as of the last position, as the decode step keeps them.

Covered: CPU tensors without autograd, no padding mask, the ``sre`` and ``random`` scores (the
``attention`` score needs each query's weights), head dim a multiple of 64 up to 256, elu1 or
Hedgehog maps, with or without a decay. Anything else returns None and the caller runs the torch
path, which is what this is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..gqa import expand_kv
from ..sparse.config import SparseCacheConfig
from ..sparse.eviction import close_block, fold_weights, gather_slots, group_bounds
from ..sparse.state import sparse_final_state
from ..state import HybridState, aged_sums, init_state
from . import build
from .bindings import TILE, Kernel, fill, fp32_rows, pointers, prefill_maps, strides3
from .build import MAX_D, MAX_F

GROUP, WORKSPACE = Kernel("hybrid_sparse_group_f32"), Kernel("hybrid_sparse_group_workspace")
CLOSE, CLOSE_WORKSPACE = Kernel("hybrid_sparse_close_f32"), Kernel("hybrid_sparse_close_workspace")
# Arguments that change from one group to the next (the rest are bound once per call).
PER_GROUP = ("t0", "t1", "range_lo", "cache_k", "cache_v", "cache_ok", "S", "z")


def covers(q: Tensor, cache: SparseCacheConfig, key_padding_mask: Tensor | None) -> bool:
    """Whether :func:`hybrid_attention_sparse_cpu` may take these arguments (cheap checks first)."""
    D = q.shape[-1]
    return (build.enabled() and q.is_cpu and key_padding_mask is None and cache.score != "attention"
            and D % TILE == 0 and D <= MAX_D and not torch.is_grad_enabled())


def hybrid_attention_sparse_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int,
    cache: SparseCacheConfig,
    feature_map: FeatureMap,
    output_final_state: bool,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState | None] | None:
    """``(o, final_state)`` as ``hybrid_attention_sparse`` gives them, or None where the kernel does not
    apply (:func:`covers`, checked by the caller; other feature maps; no compiler). ``log_decay``
    ``[H_kv]``: log gamma of a decaying linear state, as for ``hybrid_attention_sparse``."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
        if log_decay is not None:
            log_decay = log_decay.repeat_interleave(q.shape[1] // log_decay.shape[0])
    B, H, T, D = q.shape
    Hk, w, lam, ns = k.shape[1], window, cache.size, cache.sinks
    maps = prefill_maps(feature_map, H, Hk, D)
    lib = build.load()
    if maps is None or lib is None or maps[2] > MAX_F:
        return None
    map_code, weights, F = maps
    q32, k32, v32 = fp32_rows(q), fp32_rows(k), fp32_rows(v)
    wa = torch.sigmoid(window_logit.detach().float()).contiguous()
    wb = torch.sigmoid(linear_logit.detach().float()).contiguous()
    lam_kv = None if log_decay is None else log_decay.detach().float().contiguous()  # log gamma [Hk]
    if lam_kv is not None and lam_kv.shape != (Hk,):
        return None
    out = q32.new_empty(B, T, H, D).transpose(1, 2)  # the layer reads [B, T, H * D]: no copy there
    phi_k = resolve_qk_maps(feature_map)[1]
    S, z = q32.new_zeros(B, Hk, F, D), q32.new_zeros(B, Hk, F)
    cache_pos = torch.zeros(B, Hk, lam, dtype=torch.long)
    cache_ok = torch.zeros(B, Hk, lam, dtype=torch.bool)
    cache_k, cache_v = q32.new_zeros(B, Hk, lam, D), q32.new_zeros(B, Hk, lam, D)
    threads = max(1, min(torch.get_num_threads(), lib.hybrid_native_threads()))
    work = q32.new_empty(WORKSPACE(B=B, Hk=Hk, g=H // Hk, D=D, F=F, w=w, ns=ns, lam=lam, threads=threads))
    wq, bq = pointers(*weights[:2])
    (q_b, q_h, q_t), (k_b, k_h, k_t), (v_b, v_h, v_t), (o_b, o_h, o_t) = map(strides3, (q32, k32, v32, out))
    args, slots = GROUP.template(
        PER_GROUP, B=B, H=H, Hk=Hk, D=D, F=F, w=w, ns=ns, lam=lam, T=T, map=map_code, threads=threads,
        q=q32.data_ptr(), q_b=q_b, q_h=q_h, q_t=q_t, k=k32.data_ptr(), k_b=k_b, k_h=k_h, k_t=k_t,
        v=v32.data_ptr(), v_b=v_b, v_h=v_h, v_t=v_t, wa=wa.data_ptr(), wb=wb.data_ptr(), wq=wq, bq=bq,
        out=out.data_ptr(), o_b=o_b, o_h=o_h, o_t=o_t, work=work.data_ptr(), log_decay=pointers(lam_kv)[0],
    )
    # The 'sre' close runs natively, updating the cache, S and z in place; other scores stay in torch.
    native_close = cache.score == "sre"
    if native_close:
        wk, bk = pointers(*weights[2:])
        close_work = q32.new_empty(CLOSE_WORKSPACE(B=B, Hk=Hk, D=D, F=F, w=w, lam=lam))
        close_args, close_slots = CLOSE.template(
            ("block",), B=B, Hk=Hk, D=D, F=F, w=w, lam=lam, map=map_code, threads=threads,
            k=k32.data_ptr(), k_b=k_b, k_h=k_h, k_t=k_t, v=v32.data_ptr(), v_b=v_b, v_h=v_h, v_t=v_t,
            cache_k=cache_k.data_ptr(), cache_v=cache_v.data_ptr(), cache_pos=cache_pos.data_ptr(),
            cache_ok=cache_ok.data_ptr(), S=S.data_ptr(), z=z.data_ptr(), wk=wk, bk=bk, work=close_work.data_ptr(),
            log_decay=pointers(lam_kv)[0],
        )
    bounds = group_bounds(T, w, ns)
    for J, (t0, t1) in enumerate(bounds):
        block = ns + J * w  # block J's first position: pending while the group runs
        code = lib.hybrid_sparse_group_f32(*fill(args, slots, t0, t1, block if J else 0, cache_k.data_ptr(),
                                                 cache_v.data_ptr(), cache_ok.data_ptr(), S.data_ptr(), z.data_ptr()))
        if code != 0:
            return None
        if t1 < T and lam_kv is not None:  # S, z as of t1, the close's position (in place: the close's)
            aged_sums(S, z, lam_kv, t1 - t0, in_place=True)
        if t1 < T and native_close:
            if lib.hybrid_sparse_close_f32(*fill(close_args, close_slots, block)) != 0:
                return None
        elif t1 < T:  # block J closes: the cache and the block compete, the rest folds (as the torch path)
            blk_pos = torch.arange(block, block + w).view(1, 1, -1).expand(B, Hk, -1)
            cand_k = torch.cat([cache_k, k32[:, :, block : block + w]], 2)
            cand_v = torch.cat([cache_v, v32[:, :, block : block + w]], 2)
            cand_pos = torch.cat([cache_pos, blk_pos], -1)
            cand_ok = torch.cat([cache_ok, torch.ones(B, Hk, w, dtype=torch.bool)], -1)
            keep, cache_ok, S, z = close_block(cache.score, cand_k, cand_v, cand_ok, cand_pos, None, S, z, lam, phi_k,
                                               fold_weights(lam_kv, t1, w, cand_pos))
            cache_pos = cand_pos.gather(-1, keep)
            cache_k, cache_v = gather_slots(cand_k, keep), gather_slots(cand_v, keep)
    final = None
    if output_final_state:
        if lam_kv is not None:  # as of the last position, as the decode step keeps them
            aged_sums(S, z, lam_kv, T - 1 - bounds[-1][0], in_place=True)
        final = init_state(B, Hk, D, w, feature_dim=F, device=q.device, dtype=k.dtype)
        real = torch.ones(B, T, dtype=torch.bool)
        final = sparse_final_state(final, k, v, real, T, w, cache, S, z, cache_pos, cache_ok, None)
    return out.to(q.dtype), final
