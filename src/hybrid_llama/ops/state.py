"""The recurrent decode state of hybrid attention, and how a prefill builds it.

``HybridState`` holds a ring buffer of the last ``w`` keys/values plus the running linear-attention
sums ``S = sum phi(k) v^T`` and ``z = sum phi(k)`` over the keys that have left the window; with the
sparse cache on, ``sparse`` holds its fixed-size sink, pending and cache buffers (``SparseState``).
The key at position ``t`` lives in slot ``t % w``. Every size is fixed in the context length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .feature_maps import FeatureMap, feature_dim_of, resolve_qk_maps

if TYPE_CHECKING:  # the state holds the cache's buffers; its settings are read, never built, here
    from .sparse.config import SparseCacheConfig


@dataclass
class SparseState:
    """The decode state's exact memories besides the window ring, per (batch row, KV head).

    Sizes are fixed: ``sinks`` pinned slots, ``w`` pending slots (slot ``(s - sinks) % w``), ``λ``
    cache slots kept in position order (empty slots: ``cache_pos`` -1, at the end). ``*_acc`` hold the
    attention each key received so far (read by the ``attention`` score only).
    """

    sink_k: Tensor  # [B, Hk, n_s, D]
    sink_v: Tensor
    sink_valid: Tensor  # [B, n_s] bool
    pend_k: Tensor  # [B, Hk, w, D]
    pend_v: Tensor
    pend_valid: Tensor  # [B, w] bool
    pend_acc: Tensor  # [B, Hk, w] fp32
    cache_k: Tensor  # [B, Hk, λ, D]
    cache_v: Tensor
    cache_valid: Tensor  # [B, Hk, λ] bool
    cache_pos: Tensor  # [B, Hk, λ] int64, -1 = empty
    cache_acc: Tensor  # [B, Hk, λ] fp32
    win_acc: Tensor  # [B, Hk, w] fp32, per window-ring slot

    def map(self, fn) -> SparseState:
        """A copy with ``fn`` applied to every tensor (index_select, to, detach)."""
        return SparseState(**{f.name: fn(f.name, getattr(self, f.name)) for f in fields(self)})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, f.name) for f in fields(self)))


def empty_sparse_state(
    batch: int, kv_heads: int, head_dim: int, window: int, cache: SparseCacheConfig, *, device=None, dtype=None
) -> SparseState:
    """Empty sink, pending and cache buffers: ``cache.sinks`` and ``cache.size`` slots per KV head."""
    def kv(n: int) -> Tensor:
        return torch.zeros(batch, kv_heads, n, head_dim, device=device, dtype=dtype)

    lam, ns = cache.size, cache.sinks
    return SparseState(
        sink_k=kv(ns), sink_v=kv(ns), sink_valid=torch.zeros(batch, ns, dtype=torch.bool, device=device),
        pend_k=kv(window), pend_v=kv(window),
        pend_valid=torch.zeros(batch, window, dtype=torch.bool, device=device),
        pend_acc=torch.zeros(batch, kv_heads, window, device=device),
        cache_k=kv(lam), cache_v=kv(lam),
        cache_valid=torch.zeros(batch, kv_heads, lam, dtype=torch.bool, device=device),
        cache_pos=torch.full((batch, kv_heads, lam), -1, dtype=torch.long, device=device),
        cache_acc=torch.zeros(batch, kv_heads, lam, device=device),
        win_acc=torch.zeros(batch, kv_heads, window, device=device),
    )


@dataclass
class HybridState:
    k_window: Tensor  # [B, H, w, D] ring buffer of the last w keys (post-RoPE)
    v_window: Tensor  # [B, H, w, D]
    window_valid: Tensor  # [B, w] bool: slot holds a real (non-pad) key
    S: Tensor  # [B, H, F, D] fp32, sum of phi(k) v^T over keys that left the window
    z: Tensor  # [B, H, F]    fp32, sum of phi(k)
    seen: int  # tokens consumed; the next token goes to slot seen % w
    sparse: SparseState | None = None  # sinks, pending block and sparse cache (sparse_cache module)
    # True when every key consumed so far is known to be real (no padding): the in-place step then
    # skips reading window_valid back to the host. None = not known, look at window_valid.
    all_real: bool | None = None

    @property
    def window(self) -> int:
        return self.k_window.shape[2]

    def index_select(self, batch_index: Tensor) -> HybridState:
        """The state of the rows ``batch_index`` (beam search / batch reordering)."""
        pick = lambda x: x.index_select(0, batch_index.to(x.device))  # noqa: E731
        return HybridState(
            pick(self.k_window), pick(self.v_window), pick(self.window_valid), pick(self.S), pick(self.z), self.seen,
            None if self.sparse is None else self.sparse.map(lambda _, t: pick(t)), self.all_real,
        )

    def detach(self) -> HybridState:
        """The same state cut from autograd (a cache never backpropagates into its prefill)."""
        return HybridState(
            self.k_window.detach(), self.v_window.detach(), self.window_valid, self.S.detach(), self.z.detach(),
            self.seen, None if self.sparse is None else self.sparse.map(lambda _, t: t.detach()), self.all_real,
        )

    def nbytes(self) -> int:
        """Bytes held: the window ring, the linear sums and the sparse memories (fixed in T)."""
        own = (self.k_window, self.v_window, self.window_valid, self.S, self.z)
        return sum(t.numel() * t.element_size() for t in own) + (0 if self.sparse is None else self.sparse.nbytes())

    def to(self, device=None, dtype=None) -> HybridState:
        """Move to ``device``; ``dtype`` applies to the key/value buffers (S and z stay fp32)."""
        return HybridState(
            self.k_window.to(device=device, dtype=dtype),
            self.v_window.to(device=device, dtype=dtype),
            self.window_valid.to(device=device),
            self.S.to(device=device),
            self.z.to(device=device),
            self.seen,
            None if self.sparse is None else self.sparse.map(
                lambda name, t: t.to(device=device, dtype=dtype if name.endswith(("_k", "_v")) else None)
            ),
            self.all_real,
        )


def init_state(
    batch: int,
    heads: int,
    head_dim: int,
    window: int,
    *,
    feature_dim: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> HybridState:
    """Empty state. ``feature_dim`` is F, the width of phi's output (default ``head_dim``, as for elu1;
    for a ``HedgehogFeatureMap`` pass its ``out_features``)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    f = feature_dim or head_dim
    dtype = dtype or torch.get_default_dtype()
    return HybridState(
        k_window=torch.zeros(batch, heads, window, head_dim, device=device, dtype=dtype),
        v_window=torch.zeros(batch, heads, window, head_dim, device=device, dtype=dtype),
        window_valid=torch.zeros(batch, window, device=device, dtype=torch.bool),
        S=torch.zeros(batch, heads, f, head_dim, device=device, dtype=torch.float32),
        z=torch.zeros(batch, heads, f, device=device, dtype=torch.float32),
        seen=0,
    )


def prefill_state(
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
    linear_sums: tuple[Tensor, Tensor] | None = None,
    log_decay: Tensor | None = None,
) -> HybridState:
    """State after consuming ``k, v`` (``[B, H, T, D]``): equal to T calls of ``hybrid_attention_step``.

    ``linear_sums``: ``(S, z)`` over the keys that left the window, when the caller (a prefill op
    returning its final state) already has them; otherwise they are computed here, each key j of the
    n that left weighted by gamma^(n - 1 - j) under ``log_decay`` ``[H]`` (log gamma per head)."""
    if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v must be [B, H, T, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = k.shape
    real = key_padding_mask  # None: every key is real
    if real is not None and (real.shape != (B, T) or real.dtype != torch.bool):
        raise ValueError(f"key_padding_mask must be bool [B, T]=[{B}, {T}], got {real.dtype} {tuple(real.shape)}")

    state = init_state(B, H, D, window, feature_dim=key_feature_dim(feature_map, k), device=k.device, dtype=k.dtype)
    n_lin = max(T - window, 0)  # positions 0 .. T-1-w have left the window
    if linear_sums is not None:  # often views into one [S | z] buffer: the in-place step wants its own memory
        state.S, state.z = (t.contiguous() for t in linear_sums)
    elif n_lin > 0:
        state.S, state.z = linear_sums_of(k[:, :, :n_lin], v[:, :, :n_lin], None if real is None else real[:, :n_lin],
                                          feature_map, log_decay)
    # The last min(T, w) positions n_lin .. T-1 go to slots p % w: a run from slot n_lin % w to the
    # ring's end, then one from slot 0. Slice copies into the fresh buffers, no index tensors.
    start, n_keep = n_lin % window, T - n_lin
    first = min(n_keep, window - start)
    for slot, pos, n in ((start, n_lin, first), (0, n_lin + first, n_keep - first)):
        if n:
            state.k_window[:, :, slot : slot + n] = k[:, :, pos : pos + n]
            state.v_window[:, :, slot : slot + n] = v[:, :, pos : pos + n]
            state.window_valid[:, slot : slot + n] = True if real is None else real[:, pos : pos + n]
    state.seen = T
    state.all_real = real is None or None
    return state


def window_prompt_state(
    k: Tensor, v: Tensor, *, window: int, feature_map: FeatureMap = "elu1", sparse: SparseCacheConfig | None = None
) -> HybridState:
    """State after a prompt of T <= ``window`` real keys ``[B, H, T, D]``: the ring holds them all, the
    linear sums are zero and, with an active sparse cache, its buffers are empty (no key has left the
    window yet). For the ``sre`` and ``random`` scores this is the sparse op's final state too; the
    ``attention`` score also keeps what each key received."""
    if k.shape[2] > window:
        raise ValueError(f"the prompt ({k.shape[2]} tokens) must fit in the window ({window})")
    state = prefill_state(k, v, window=window, feature_map=feature_map)
    if sparse is not None and sparse.active:
        B, H, _, D = k.shape
        state.sparse = empty_sparse_state(B, H, D, window, sparse, device=k.device, dtype=k.dtype)
    return state


def aged_sums(S: Tensor, z: Tensor, log_decay: Tensor | None, positions: int, *,
              in_place: bool = False) -> tuple[Tensor, Tensor]:
    """``S`` ``[B, H, F, D]`` and ``z`` ``[B, H, F]`` of a decaying state as they stand ``positions``
    later: scaled by gamma^positions per head (``log_decay`` ``[H]``); unchanged without a decay.
    ``in_place``: scale the given tensors (a native kernel holds their memory)."""
    if log_decay is None:
        return S, z
    gamma = torch.exp(log_decay.float() * positions)
    if in_place:
        return S.mul_(gamma.view(1, -1, 1, 1)), z.mul_(gamma.view(1, -1, 1))
    return S * gamma.view(1, -1, 1, 1), z * gamma.view(1, -1, 1)


def linear_sums_of(k: Tensor, v: Tensor, real: Tensor | None, feature_map: FeatureMap,
                   log_decay: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``S = sum phi(k) v^T`` ``[B, H, F, D]`` and ``z = sum phi(k)`` ``[B, H, F]`` (fp32) over the
    given keys; ``real`` ``[B, T]`` bool drops padding; ``log_decay`` ``[H]`` weights key j of T by
    gamma^(T - 1 - j), as the decaying state holds them after the last."""
    k_features = resolve_qk_maps(feature_map)[1](k.float())
    if real is not None:
        k_features = k_features * real[:, None, :, None]
    if log_decay is not None:
        age = torch.arange(k.shape[2] - 1, -1, -1, device=k.device, dtype=torch.float32)
        k_features = k_features * torch.exp(log_decay.float()[:, None] * age)[None, :, :, None]
    return torch.matmul(k_features.transpose(-1, -2), v.float()), k_features.sum(dim=2)


def key_feature_dim(feature_map: FeatureMap, k: Tensor) -> int:
    """Width F of the key map's features for keys ``k`` ``[B, H, T, D]``: from the map where it says, else
    measured on one token."""
    try:
        return feature_dim_of(feature_map, k.shape[-1])
    except ValueError:  # an arbitrary callable: measure it on one token
        return resolve_qk_maps(feature_map)[1](k[:1, :, :1].float()).shape[-1]


