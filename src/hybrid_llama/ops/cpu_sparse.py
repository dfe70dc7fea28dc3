"""The sparse cache's parallel op on the CPU with native attention (``cpu_kernels.c``'s
``hybrid_sparse_group_f32``), for inference.

The torch path (``sparse_cache.hybrid_attention_sparse``) attends each group of queries (those that
see the same closed blocks) with about 40 tensor ops over masks of the whole exact set; its masks,
exponentials and small batched products, not its arithmetic, were four fifths of a layer's prefill
at 2048 tokens (docs/performance.md). Here one kernel call computes a group's outputs, linear readout
included, straight into the ``[B, T, H, D]`` memory the output projection reads; the block that
closes between two groups (scores, eviction, fold into ``S, z``) stays in torch, the same calls as
the torch path, so both keep the same keys.

Covered: CPU tensors without autograd, no padding mask, the ``sre`` and ``random`` scores (the
``attention`` score needs each query's weights), head dim a multiple of 64 up to 256, elu1 or
Hedgehog maps. Anything else returns None and the caller runs the torch path, which is what this is
tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .cpu_prefill import TILE, _maps, _rows, _strides
from .feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from .gqa import expand_kv
from .native import MAX_D, MAX_F
from .sparse_cache import SparseCacheConfig, close_block, gather_slots, group_bounds, sparse_final_state
from .state import HybridState, init_state


def covers(q: Tensor, cache: SparseCacheConfig, key_padding_mask: Tensor | None) -> bool:
    """Whether :func:`hybrid_attention_sparse_cpu` may take these arguments (cheap checks first)."""
    D = q.shape[-1]
    return (native.enabled() and q.is_cpu and key_padding_mask is None and cache.score != "attention"
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
) -> tuple[Tensor, HybridState | None] | None:
    """``(o, final_state)`` as ``hybrid_attention_sparse`` gives them, or None where the kernel does not
    apply (:func:`covers`, checked by the caller; other feature maps; no compiler)."""
    if k.shape[1] != q.shape[1] and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
    B, H, T, D = q.shape
    Hk, w, lam, ns = k.shape[1], window, cache.size, cache.sinks
    maps = _maps(feature_map, H, Hk, D)
    lib = native.load()
    if maps is None or lib is None or maps[2] > MAX_F:
        return None
    map_code, weights, F = maps
    q32, k32, v32 = _rows(q), _rows(k), _rows(v)
    wa = torch.sigmoid(window_logit.detach().float()).contiguous()
    wb = torch.sigmoid(linear_logit.detach().float()).contiguous()
    out = q32.new_empty(B, T, H, D).transpose(1, 2)  # the layer reads [B, T, H * D]: no copy there
    phi_k = resolve_qk_maps(feature_map)[1]
    S, z = q32.new_zeros(B, Hk, F, D), q32.new_zeros(B, Hk, F)
    cache_pos = torch.zeros(B, Hk, lam, dtype=torch.long)
    cache_ok = torch.zeros(B, Hk, lam, dtype=torch.bool)
    cache_k, cache_v = q32.new_zeros(B, Hk, lam, D), q32.new_zeros(B, Hk, lam, D)
    threads = max(1, min(torch.get_num_threads(), lib.hybrid_native_threads()))
    work = q32.new_empty(lib.hybrid_sparse_group_workspace(B, Hk, H // Hk, D, F, w, ns, lam, threads))
    q_map = tuple(None if t is None else t.data_ptr() for t in weights[:2])
    for J, (t0, t1) in enumerate(group_bounds(T, w, ns)):
        block = ns + J * w  # block J's first position: pending while the group runs
        code = lib.hybrid_sparse_group_f32(
            B, H, Hk, D, F, w, ns, lam, T, t0, t1, block if J else 0, map_code, threads,
            q32.data_ptr(), *_strides(q32), k32.data_ptr(), *_strides(k32), v32.data_ptr(), *_strides(v32),
            cache_k.data_ptr(), cache_v.data_ptr(), cache_ok.data_ptr(), S.data_ptr(), z.data_ptr(),
            wa.data_ptr(), wb.data_ptr(), *q_map, out.data_ptr(), *_strides(out), work.data_ptr(),
        )
        if code != 0:
            return None
        if t1 < T:  # block J closes: the cache and the block compete, the rest folds (as the torch path)
            blk_pos = torch.arange(block, block + w).view(1, 1, -1).expand(B, Hk, -1)
            cand_k = torch.cat([cache_k, k32[:, :, block : block + w]], 2)
            cand_v = torch.cat([cache_v, v32[:, :, block : block + w]], 2)
            cand_pos = torch.cat([cache_pos, blk_pos], -1)
            cand_ok = torch.cat([cache_ok, torch.ones(B, Hk, w, dtype=torch.bool)], -1)
            keep, cache_ok, S, z = close_block(cache.score, cand_k, cand_v, cand_ok, cand_pos, None, S, z, lam, phi_k)
            cache_pos = cand_pos.gather(-1, keep)
            cache_k, cache_v = gather_slots(cand_k, keep), gather_slots(cand_v, keep)
    final = None
    if output_final_state:
        final = init_state(B, Hk, D, w, feature_dim=F, device=q.device, dtype=k.dtype)
        real = torch.ones(B, T, dtype=torch.bool)
        final = sparse_final_state(final, k, v, real, T, w, cache, S, z, cache_pos, cache_ok, None)
    return out.to(q.dtype), final
