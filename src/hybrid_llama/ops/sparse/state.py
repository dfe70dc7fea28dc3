"""The sparse cache's decode state as a prefill leaves it (``SparseState`` in ``ops.state``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..feature_maps import FeatureMap
from ..state import HybridState, empty_sparse_state, init_state, key_feature_dim, window_prompt_state
from .config import SparseCacheConfig
from .eviction import gather_slots, group_bounds


def sparse_final_state(state, k, v, real, T, w, cache, S, z, cache_idx, cache_ok, acc):
    """The decode state after T tokens: ring, sinks, pending block, cache and the folded sums."""
    B, Hk, _, D = k.shape
    ns = cache.sinks
    sp = empty_sparse_state(B, Hk, D, w, cache, device=k.device, dtype=k.dtype)
    ring_pos = torch.arange(max(T - w, 0), T, device=k.device)
    # Under autocast k and v can differ in dtype (RoPE widens k), the buffers hold k's: cast v.
    v = v.to(k.dtype)
    k_window, v_window, valid = state.k_window.clone(), state.v_window.clone(), state.window_valid.clone()
    k_window[:, :, ring_pos % w] = k[:, :, ring_pos]
    v_window[:, :, ring_pos % w] = v[:, :, ring_pos]
    valid[:, ring_pos % w] = real[:, ring_pos]
    old_sinks = torch.arange(min(ns, max(T - w, 0)), device=k.device)
    sp.sink_k[:, :, old_sinks], sp.sink_v[:, :, old_sinks] = k[:, :, old_sinks], v[:, :, old_sinks]
    sp.sink_valid[:, old_sinks] = real[:, old_sinks]
    n_old = max(T - w - ns, 0)  # non-sink keys that left the window
    pend = torch.arange(ns + (n_old // w) * w, ns + n_old, device=k.device)
    slots = (pend - ns) % w
    sp.pend_k[:, :, slots], sp.pend_v[:, :, slots] = k[:, :, pend], v[:, :, pend]
    sp.pend_valid[:, slots] = real[:, pend]
    sp.cache_k, sp.cache_v = gather_slots(k, cache_idx), gather_slots(v, cache_idx)
    sp.cache_valid, sp.cache_pos = cache_ok, cache_idx.masked_fill(~cache_ok, -1)
    if acc is not None:
        sp.pend_acc[:, :, slots] = acc[:, :, pend]
        sp.cache_acc = acc.gather(-1, cache_idx) * cache_ok
        sp.win_acc[:, :, ring_pos % w] = acc[:, :, ring_pos]
    sp = sp.map(lambda name, t: t.detach())
    return HybridState(k_window, v_window, valid, S.detach(), z.detach(), T, sparse=sp)




def softmax_prompt_state(k: Tensor, v: Tensor, *, window: int, cache: SparseCacheConfig,
                         feature_map: FeatureMap = "elu1") -> HybridState:
    """The state after a prompt of real keys ``[B, H_kv, T, D]`` that is causal softmax (T <=
    ``cache.softmax_prompt_len(window)``, a score other than ``attention``): what the op's final state
    would be, built from the keys alone. Inside the window that is ``window_prompt_state``; beyond it
    the closed blocks' keys all sit in the cache, in position order (no close had more candidates than
    slots), and the linear sums are zero."""
    B, Hk, T, D = k.shape
    if T <= window:
        return window_prompt_state(k, v, window=window, feature_map=feature_map, sparse=cache)
    if T > cache.softmax_prompt_len(window) or cache.state_needs_queries:
        raise ValueError(f"a prompt of {T} tokens folds keys (window {window}, {cache}): it is not causal softmax")
    closed = (len(group_bounds(T, window, cache.sinks)) - 1) * window  # keys of the blocks closed by T
    cache_idx = torch.zeros(B, Hk, cache.size, dtype=torch.long, device=k.device)
    cache_idx[..., :closed] = torch.arange(cache.sinks, cache.sinks + closed, device=k.device)
    cache_ok = torch.zeros(B, Hk, cache.size, dtype=torch.bool, device=k.device)
    cache_ok[..., :closed] = True
    state = init_state(B, Hk, D, window, feature_dim=key_feature_dim(feature_map, k), device=k.device, dtype=k.dtype)
    real = torch.ones(B, T, dtype=torch.bool, device=k.device)
    return sparse_final_state(state, k, v, real, T, window, cache, state.S, state.z, cache_idx, cache_ok, None)
