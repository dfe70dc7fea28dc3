"""Recurrent form of hybrid attention for generation.

The state holds a ring buffer of the last ``w`` keys/values plus the running linear-attention sums
``S = sum phi(k) v^T`` and ``z = sum phi(k)`` over the keys that have left the window. The key at
position ``t`` lives in slot ``t % w``; writing it evicts position ``t - w``, which is folded into
``S`` and ``z``. Per-token cost and memory are independent of the context length.

Steps are functional: they return a new ``HybridState`` and never modify the old one, so they are
safe under autograd and for cache reordering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .feature_maps import FeatureMap, feature_dim_of, keys_need_query_heads, resolve_qk_maps
from .reference import FORMULATIONS, combine, mixing_weights
from .sparse_cache import SparseState


@dataclass
class HybridState:
    k_window: Tensor  # [B, H, w, D] ring buffer of the last w keys (post-RoPE)
    v_window: Tensor  # [B, H, w, D]
    window_valid: Tensor  # [B, w] bool: slot holds a real (non-pad) key
    S: Tensor  # [B, H, F, D] fp32, sum of phi(k) v^T over keys that left the window
    z: Tensor  # [B, H, F]    fp32, sum of phi(k)
    seen: int  # tokens consumed; the next token goes to slot seen % w
    sparse: SparseState | None = None  # sinks, pending block and sparse cache (sparse_cache module)

    @property
    def window(self) -> int:
        return self.k_window.shape[2]

    def index_select(self, batch_index: Tensor) -> HybridState:
        """The state of the rows ``batch_index`` (beam search / batch reordering)."""
        pick = lambda x: x.index_select(0, batch_index.to(x.device))  # noqa: E731
        return HybridState(
            pick(self.k_window), pick(self.v_window), pick(self.window_valid), pick(self.S), pick(self.z), self.seen,
            None if self.sparse is None else self.sparse.map(lambda _, t: pick(t)),
        )

    def detach(self) -> HybridState:
        """The same state cut from autograd (a cache never backpropagates into its prefill)."""
        return HybridState(
            self.k_window.detach(), self.v_window.detach(), self.window_valid, self.S.detach(), self.z.detach(),
            self.seen, None if self.sparse is None else self.sparse.map(lambda _, t: t.detach()),
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
) -> HybridState:
    """State after consuming ``k, v`` (``[B, H, T, D]``): equal to T calls of ``hybrid_attention_step``.

    ``linear_sums``: ``(S, z)`` over the keys that left the window, when the caller (a prefill op
    returning its final state) already has them; otherwise they are computed here."""
    if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v must be [B, H, T, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = k.shape
    real = (
        key_padding_mask
        if key_padding_mask is not None
        else torch.ones(B, T, dtype=torch.bool, device=k.device)
    )
    if real.shape != (B, T) or real.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be bool [B, T]=[{B}, {T}], got {real.dtype} {tuple(real.shape)}")

    state = init_state(B, H, D, window, feature_dim=_feature_dim(feature_map, k), device=k.device, dtype=k.dtype)
    n_lin = max(T - window, 0)  # positions 0 .. T-1-w have left the window
    if linear_sums is not None:
        state.S, state.z = linear_sums
    elif n_lin > 0:
        state.S, state.z = linear_sums_of(k[:, :, :n_lin], v[:, :, :n_lin], real[:, :n_lin], feature_map)
    kept = torch.arange(n_lin, T, device=k.device)  # the last min(T, w) positions
    slots = kept % window
    k_window, v_window, valid = state.k_window.clone(), state.v_window.clone(), state.window_valid.clone()
    k_window[:, :, slots] = k[:, :, kept]
    v_window[:, :, slots] = v[:, :, kept].to(v_window.dtype)
    valid[:, slots] = real[:, kept]
    state.k_window, state.v_window, state.window_valid, state.seen = k_window, v_window, valid, T
    return state


def linear_sums_of(k: Tensor, v: Tensor, real: Tensor | None, feature_map: FeatureMap) -> tuple[Tensor, Tensor]:
    """``S = sum phi(k) v^T`` ``[B, H, F, D]`` and ``z = sum phi(k)`` ``[B, H, F]`` (fp32) over the
    given keys; ``real`` ``[B, T]`` bool drops padding."""
    k_features = resolve_qk_maps(feature_map)[1](k.float())
    if real is not None:
        k_features = k_features * real[:, None, :, None]
    return torch.matmul(k_features.transpose(-1, -2), v.float()), k_features.sum(dim=2)


def _feature_dim(feature_map: FeatureMap, k: Tensor) -> int:
    try:
        return feature_dim_of(feature_map, k.shape[-1])
    except ValueError:  # an arbitrary callable: measure it on one token
        return resolve_qk_maps(feature_map)[1](k[:1, :, :1].float()).shape[-1]


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
) -> tuple[Tensor, HybridState]:
    """One token: q ``[B, H, 1, D]``, k/v ``[B, H_kv, 1, D]`` and a state of H_kv heads (GQA: query
    head h reads KV head h // (H / H_kv); H_kv = H for expanded k/v). ``key_valid`` ``[B]`` (or
    ``[B, 1]``) bool, True = real. With H_kv < H the key features must be per KV head (elu1, or a
    (query_map, key_map) pair whose key map has H_kv heads): the state's phi(k) is shared by the
    query heads of a group.

    ``inplace``: the caller gives the state up (a generation cache does), so the step may update
    its buffers in place; without autograd and padding it then takes a leaner path with the same
    result (no buffer copies, fused updates, the mix without the empty-window guards)."""
    check_step_shapes(q, k, v, state)
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
        return _step_in_place(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map)
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


def _step_in_place(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map):
    """The step for a cache that owns its state, without autograd, the new key real: the window then
    always holds a real key (the new one), so the empty-window guards of ``combine`` are not needed,
    and a full window of real keys needs no mask at all. Every op here is on a few KB: the step's
    cost is the number of ops, so the mix is written out instead of going through ``combine``."""
    B, H, _, D = q.shape
    Hk, w = k.shape[1], state.window
    g, slot = H // Hk, state.seen % w
    full = state.seen >= w and bool(state.window_valid.all())  # every slot holds a real key
    S, z = state.S, state.z
    if state.seen >= w:  # position seen-w leaves the window: fold it into S, z in place
        phi_old = phi_k_map(state.k_window[:, :, slot : slot + 1].float())  # [B, Hk, 1, F]
        if not full:
            phi_old = phi_old * state.window_valid[:, None, slot : slot + 1, None]
        fdim = phi_old.shape[-1]
        S.view(B * Hk, fdim, D).baddbmm_(phi_old.view(B * Hk, fdim, 1),
                                         state.v_window[:, :, slot].float().view(B * Hk, 1, D))
        z.add_(phi_old.view(B, Hk, fdim))
    state.k_window[:, :, slot] = k[:, :, 0]
    state.v_window[:, :, slot] = v[:, :, 0]
    state.window_valid[:, slot] = True
    state.seen += 1

    qf = q.float().view(B, Hk, g, D)
    kw, vw = state.k_window.float(), state.v_window.float()
    scores = torch.matmul(qf * (1.0 / math.sqrt(D)), kw.transpose(-1, -2))  # [B, Hk, g, w]
    if not full:
        scores = scores.masked_fill(~state.window_valid[:, None, None, :], float("-inf"))
    if formulation == "window":
        return torch.matmul(torch.softmax(scores, dim=-1), vw).view(B, H, 1, D).to(q.dtype), state
    a, b = mixing_weights(window_logit, linear_logit)
    a, b = a.view(1, Hk, g, 1), b.view(1, Hk, g, 1)
    phi_q = phi_q_map(q.float()).view(B, Hk, g, -1)  # (a per-head query map sees [B, H, 1, D])
    lin_num = torch.matmul(phi_q, S)  # [B, Hk, g, D]
    lin_den = torch.matmul(phi_q, z.unsqueeze(-1))  # [B, Hk, g, 1]
    if formulation == "lolcats":  # unnormalised exp-scores share the normalizer with the linear part
        e = (scores - scores.amax(dim=-1, keepdim=True)).exp_()
        num = torch.matmul(e, vw).mul_(a).add_(lin_num.mul_(b))
        den = e.sum(dim=-1, keepdim=True).mul_(a).add_(lin_den.mul_(b))
    else:
        num = torch.matmul(torch.softmax(scores, dim=-1), vw).mul_(a).add_(lin_num.mul_(b))
        den = lin_den.mul_(b).add_(a)
    return num.div_(den).view(B, H, 1, D).to(q.dtype), state
