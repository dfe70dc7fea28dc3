"""`chunked` backend: hybrid attention in pure PyTorch, no Python loop over positions.

Window part, in query blocks of ``w``: a query at position t sees keys t-w+1 .. t, which all lie
in its own block or the previous one. Each block attends to the ``2w`` keys of [previous block,
own block] under a fixed band mask: O(T * 2w * D) work. The overlapping key blocks are
``unfold`` views of the slab's keys.

Linear part: query t sees keys j <= t-w, i.e. ordinary causal linear attention (diagonal
included) over the key sequence shifted right by w (``k'_t = k_{t-w}``, zero for t < w); the same
w leading zeros serve as "block -1" of the window part. It runs as chunked linear attention with
chunk C: per chunk the state increment ``phi(K_c)^T [V_c, 1]`` (``[F, D+1]``; the ones column makes
the denominator come out of the same matmul), an exclusive cumulative sum for the state entering
each chunk (a small matmul with a strictly lower-triangular matrix), and an intra-chunk causal
product.

The sequence is processed in slabs of ``SLAB_TARGET`` (1024) positions with the linear state
carried between slabs: a Python loop of T/1024 iterations whose intermediates stay a few MB. That
matters on CPU: a 40 MB temporary is a fresh mmap with page faults on every call, a 5 MB one is
reused from the heap and stays in cache. Fewer, larger slabs also mean fewer parallel regions,
which matters when the cores are shared. The largest temporaries are one slab's window scores
(``[B, H, P/w, w, 2w]``) and chunk states (``[B, H, P/C, F, D+1]``); no tensor of size O(T * D^2)
or O(T^2) is ever built, and autograd works through plain torch ops.

GQA: k/v may have ``H_kv`` heads with ``H % H_kv == 0`` (query head h reads KV head
``h // (H / H_kv)``). Everything derived from the keys alone (the padded key slabs, phi(k), the
chunk states ``[F, D+1]``, their prefix sums and the carried state) is computed once per KV head;
the ``g = H / H_kv`` query heads of a group are stacked as the rows of each block's products
(``_grouped``: ``[B * H_kv * blocks, g * size, X]``), so no key-side tensor is copied per query head,
and the window and linear results meet in one 7-D view for the mix. A (query_map, key_map) pair
keeps this layout (the key map works at the KV heads); a single callable map other than elu1 may be
per head (``HedgehogFeatureMap`` is), so with one k/v are repeated to H heads first.

``formulation="window"`` (the window-only control) skips the linear part altogether.

A decaying linear state (``log_decay``, log gamma per KV head) weights shifted key s for query t by
gamma^(t - s): each chunk's increment takes its keys at gamma^(C - 1 - s) (their weight at the
chunk's end), the prefix sum's lower-triangular matrix becomes gamma^(C (c - 1 - c')), the carry
enters chunk c at gamma^(C c), a query at chunk offset i reads its chunk's entering state at
gamma^(i + 1), and the intra-chunk product takes gamma^(i - s). Every exponent is a non-negative
multiple of log gamma <= 0, so nothing overflows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..feature_maps import FeatureMap, keys_need_query_heads, resolve_qk_maps
from ..gqa import expand_kv
from ..state import HybridState, prefill_state
from .reference import check_inputs, combine, mixing_weights

SLAB_TARGET = 1024  # positions per slab: keeps every intermediate a few MB (cache-sized, heap-reused)


def _pad_time(x: Tensor, before: int, after: int) -> Tensor:
    """Zero-pad dim 2 (time) of ``[B, H, T, X]``."""
    return F.pad(x, (0, 0, before, after)) if before or after else x


def _grouped(x: Tensor, kv_heads: int, g: int, blocks: int, size: int) -> Tensor:
    """``[B, H, blocks * size, X]`` -> ``[B * Hk * blocks, g * size, X]`` (a copy): per KV head and
    block, the rows of its g query heads stacked, so one bmm against the block's keys serves them all."""
    B, X = x.shape[0], x.shape[-1]
    return x.reshape(B, kv_heads, g, blocks, size, X).transpose(2, 3).reshape(B * kv_heads * blocks, g * size, X)


def _blocks_7d(y: Tensor, kv_heads: int, g: int, chunks: int, per_chunk: int) -> Tensor:
    """A grouped window result ``[B * Hk * n, g * w, X]`` (n = chunks * per_chunk blocks) as the view
    ``[B, Hk, chunks, per_chunk, g, w, X]``: its own memory order, so the mix runs on contiguous data
    (an elementwise op over a permuted 7-D view is several times slower on CPU)."""
    return y.view(-1, kv_heads, chunks, per_chunk, g, y.shape[-2] // g, y.shape[-1])


def _chunks_7d(y: Tensor, kv_heads: int, g: int, chunks: int, per_chunk: int) -> Tensor:
    """A grouped linear result ``[B * Hk * chunks, g * C, X]`` (C = per_chunk * w) as the same view
    ``[B, Hk, chunks, per_chunk, g, w, X]`` as :func:`_blocks_7d`'s; with one block per chunk (the
    default chunk) the two layouts are the same memory order."""
    w = y.shape[-2] // (g * per_chunk)
    return y.view(-1, kv_heads, chunks, g, per_chunk, w, y.shape[-1]).transpose(3, 4)


def _emit(out: Tensor, outs: list[Tensor], result: Tensor | None, t0: int, T: int, L: int) -> Tensor | None:
    """Keep one slab's output ``[B, Hk, chunks, per_chunk, g, w, D]`` (the mix's layout; rows past ``L``
    are the last slab's padding). At inference it is copied once into ``result``, a ``[B, H, T, D]``
    tensor whose memory is ``[B, T, H, D]``: the layer's transpose back to ``[B, T, H * D]`` is then
    free. Under autograd it is collected in ``outs`` (concatenated at the end). Returns ``result``."""
    B, Hk, nc, m, g, w, D = out.shape
    heads = out.permute(0, 1, 4, 2, 3, 5, 6)  # [B, Hk, g, chunks, per_chunk, w, D]: heads, then positions
    if out.requires_grad:
        outs.append(heads.reshape(B, Hk * g, nc * m * w, D)[:, :, :L])
        return result
    if result is None:
        result = out.new_empty(B, T, Hk * g, D).transpose(1, 2)
    dst = result[:, :, t0 : t0 + L]
    if L == nc * m * w:
        dst.view(B, Hk, g, nc, m, w, D).copy_(heads)
    else:
        dst.copy_(heads.reshape(B, Hk * g, nc * m * w, D)[:, :, :L])
    return result


class _ChunkDecay:
    """The decay factors of one chunk size C for KV heads with log gamma ``lam`` ``[Hk]`` (fp32)."""

    def __init__(self, lam: Tensor, C: int) -> None:
        self.lam, self.C = lam, C
        i = torch.arange(C, device=lam.device, dtype=torch.float32)
        self.key_scale = torch.exp(lam[:, None] * (C - 1 - i))  # [Hk, C]: a key's weight at its chunk's end
        self.query_scale = torch.exp(lam[:, None] * (i + 1))  # [Hk, C]: the entering state's weight at offset i
        diff = i[:, None] - i[None, :]
        self.intra = torch.exp(lam[:, None, None] * diff.clamp(min=0)) * (diff >= 0)  # [Hk, C, C]

    def prefix(self, nc: int) -> Tensor:
        """``[Hk, nc, nc]``: chunk c' < c's increment at the end of chunk c - 1, gamma^(C (c - 1 - c'))."""
        c = torch.arange(nc, device=self.lam.device, dtype=torch.float32)
        diff = c[:, None] - 1 - c[None, :]
        return torch.exp(self.lam[:, None, None] * self.C * diff.clamp(min=0)) * (diff >= 0)

    def powers(self, n: Tensor | int) -> Tensor:
        """gamma^n per head, ``[Hk, *n.shape]``."""
        n = torch.as_tensor(n, device=self.lam.device, dtype=torch.float32)
        return torch.exp(self.lam.view(-1, *([1] * n.dim())) * n)


def _aged(sums: Tensor, decay: _ChunkDecay | None, n: int) -> Tensor:
    """Linear sums ``[B, Hk, F, D+1]`` n positions later: decayed by gamma^n, or as they are."""
    return sums if decay is None else sums * decay.powers(n)[None, :, None, None]


def default_chunk(window: int) -> int:
    """Linear-attention chunk: a multiple of the window near 64 (slabs must hold whole blocks of both)."""
    return window * max(1, round(64 / window))


def hybrid_attention_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int = 64,
    formulation: str = "hybrid",
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
    chunk_size: int | None = None,
    slab_size: int | None = None,
    output_final_state: bool = False,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState | None]:
    """Returns ``(o, final_state)``; the decode state after the T tokens when ``output_final_state``,
    its linear sums taken from the same pass (no second pass over the keys), else None.
    ``log_decay`` ``[H_kv]``: a decaying linear state (``reference_parts``)."""
    check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask, log_decay)
    g = q.shape[1] // k.shape[1]  # query heads per KV head (GQA), 1 when k/v have H heads
    if g > 1 and keys_need_query_heads(feature_map):
        k, v = expand_kv(q, k, v)
        if log_decay is not None:
            log_decay = log_decay.repeat_interleave(g)
        g = 1
    out_dtype = q.dtype
    k_in, v_in = k, v  # the decode state's window buffers keep the keys' own dtype
    phi_q_map, phi_k_map = resolve_qk_maps(feature_map)
    q, k, v = q.float(), k.float(), v.float()
    B, H, T, D = q.shape
    Hk = H // g  # KV heads: key-derived tensors are per KV head, the queries grouped per KV head
    # With w >= T every window reaches position 0 and no key is old enough for the linear part, so
    # window T is the same op, and it keeps the block size (and the work) bounded by T. (Explicit
    # chunk sizes are the caller's block layout: keep w as given then.)
    w = window if chunk_size else min(window, max(T, 1))
    C = chunk_size or default_chunk(w)
    if C % w:
        raise ValueError(f"chunk_size {C} must be a multiple of the window {w}")
    P = slab_size or C * max(1, SLAB_TARGET // C)
    if P % C:
        raise ValueError(f"slab_size {P} must be a multiple of chunk_size {C}")
    scale = 1.0 / math.sqrt(D)
    real = key_padding_mask if key_padding_mask is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)

    # Band of a query block against [previous block, own block]: key slot c is position
    # (block-1)*w + c, query row i is position block*w + i.
    i = torch.arange(w, device=q.device)[:, None]
    c = torch.arange(2 * w, device=q.device)[None, :]
    band = (c - w - i <= 0) & (c - w - i > -w)  # [w, 2w]
    band_bias = torch.zeros(w, 2 * w, device=q.device).masked_fill_(~band, float("-inf"))

    a, b = mixing_weights(window_logit, linear_logit)
    a7, b7 = a.view(1, Hk, 1, 1, g, 1, 1), b.view(1, Hk, 1, 1, g, 1, 1)  # per query head, 7-D layout below
    band_bias_g = band_bias.repeat(g, 1)  # [g w, 2w]: the g query heads' rows of a block share the band
    m = C // w  # window blocks per linear chunk
    decay = None if log_decay is None or formulation == "window" else _ChunkDecay(log_decay.float(), C)
    carry = None  # [S | z] over every key before the slab, [B, Hk, F, D+1]
    sums = None  # [S | z] over the keys 0 .. T-1-w, for the final state
    outs, result, lower = [], None, None
    for t0 in range(0, T, P):
        t1 = min(t0 + P, T)
        L = t1 - t0
        Lp = -(-L // C) * C  # only the last slab is padded, at its end (rows dropped at the end)
        front = max(w - t0, 0)  # only slab 0: positions < 0 are zero keys, masked below
        lo = t0 - w + front
        # Keys of positions t0-w .. t0+Lp-1. Their first Lp rows are also the linear keys of this
        # slab: query t sees linear keys j <= t-w, i.e. the keys shifted right by w.
        kw = _pad_time(k[:, :, lo:t1], front, Lp - L)  # [B, Hk, w + Lp, D]
        vw = _pad_time(v[:, :, lo:t1], front, Lp - L)
        ok = F.pad(real[:, lo:t1], (front, Lp - L), value=False)  # [B, w + Lp]
        qs = _pad_time(q[:, :, t0:t1], 0, Lp - L)
        n, nc = Lp // w, Lp // C

        # ---- window part: blocks of w queries against the 2w keys ending at the block's end. Each
        # KV head's block is one batch entry whose rows are its g query heads' w queries (grouped),
        # so the keys are never copied per query head. Key blocks: unfold views [B, Hk, n, D, 2w].
        kb = kw.unfold(2, 2 * w, w).reshape(B * Hk * n, D, 2 * w)
        vb = vw.unfold(2, 2 * w, w).transpose(-1, -2).reshape(B * Hk * n, 2 * w, D)
        qg = _grouped(qs, Hk, g, n, w)  # [B Hk n, g w, D]
        if key_padding_mask is None:
            # Every key is real: only the band matters. One fused op: bias + scale * q k^T. In slab 0
            # the keys before position 0 (block -1) are the front padding: block 0 must not see them,
            # and every query still has its own key, so no window is empty.
            scores = torch.baddbmm(band_bias_g, qg, kb, alpha=scale)
            if front:
                scores.view(B, Hk, n, g * w, 2 * w)[:, :, 0, :, :front] = float("-inf")
            has_win = None
        else:
            scores = torch.bmm(qg * scale, kb).view(B, Hk, n, g, w, 2 * w)
            allowed = band & ok.unfold(1, 2 * w, w)[:, None, :, None, None, :]  # [B, 1, n, 1, w, 2w]
            has_win = allowed.any(dim=-1, keepdim=True)
            # Rows without a real key get a dummy softmax (finite) and win_sum = 0 below.
            scores = scores.masked_fill(~(allowed | ~has_win), float("-inf")).view(B * Hk * n, g * w, 2 * w)
            has_win = has_win.view(B, 1, nc, m, 1, w, 1)
        p = torch.softmax(scores, dim=-1)
        win_avg = _blocks_7d(torch.bmm(p, vb), Hk, g, nc, m)  # [B, Hk, nc, m, g, w, D] view
        if formulation == "lolcats":
            # sum_j exp(s_j - max s) = 1 / max_j softmax_j: recovers LoLCATs' unnormalised sum.
            win_sum = _blocks_7d(1.0 / p.amax(dim=-1, keepdim=True), Hk, g, nc, m)
            if has_win is not None:
                win_sum = win_sum * has_win
        elif has_win is not None:
            win_sum = has_win.to(q.dtype)
        else:
            win_sum = p.new_ones(())  # hybrid only needs "the window is non-empty"
        if formulation == "window":
            out = win_avg if has_win is None else win_avg * has_win.to(q.dtype)
            result = _emit(out, outs, result, t0, T, L)
            continue

        # ---- linear part: causal linear attention over the shifted keys, chunks of C. phi(k), the
        # chunk states, their prefix sums and the carry are per KV head; the queries are grouped per
        # KV head as in the window part.
        phi_q = phi_q_map(qs)
        Fd = phi_q.shape[-1]
        phi_k = phi_k_map(kw[:, :, :Lp])
        if key_padding_mask is not None:
            phi_k = phi_k * ok[:, None, :Lp, None]  # padded keys never enter S or z (phi(0) = 1)
        elif front:
            phi_k = _pad_time(phi_k[:, :, front:], front, 0)  # nor do the zero keys before position 0
        v1 = torch.cat([vw[:, :, :Lp], torch.ones_like(vw[:, :, :Lp, :1])], dim=-1)  # ones -> den
        qc = _grouped(phi_q, Hk, g, nc, C)  # [B Hk nc, g C, F]
        kc = phi_k.reshape(B * Hk * nc, C, Fd)
        vc = v1.reshape(B * Hk * nc, C, D + 1)
        kc_end = kc if decay is None else (
            phi_k.view(B, Hk, nc, C, Fd) * decay.key_scale[None, :, None, :, None]).view(B * Hk * nc, C, Fd)
        kv = torch.bmm(kc_end.transpose(1, 2), vc).view(B, Hk, nc, Fd, D + 1)  # each chunk's increment
        # State entering each chunk = carry + sum of the earlier chunks' increments: an exclusive
        # prefix sum, done as one small matmul with a strictly lower-triangular matrix (faster than
        # a strided cumsum on CPU).
        if decay is not None:
            lower = decay.prefix(nc)  # [Hk, nc, nc], broadcast over the batch
        elif lower is None or lower.shape[0] != nc:
            lower = torch.ones(nc, nc, dtype=q.dtype, device=q.device).tril_(-1)
        state_in = torch.matmul(lower, kv.reshape(B, Hk, nc, -1)).view(B, Hk, nc, Fd, D + 1)
        # The carry and the slab's increments as they stand after the slab's last (or, for the final
        # state, its last real) shifted key; with a decay each is weighted by its age there.
        if decay is None:
            slab_total = kv.sum(dim=2)
        else:
            slab_total = (kv * decay.powers(C * torch.arange(nc - 1, -1, -1))[None, :, :, None, None]).sum(dim=2)
        if output_final_state and t1 == T:
            # The padded tail rows L.. of the last slab are keys still in the window (or beyond T).
            if Lp == L:
                tail = slab_total
            else:
                tail_k = phi_k[:, :, :L]
                if decay is not None:
                    tail_k = tail_k * decay.powers(torch.arange(L - 1, -1, -1))[None, :, :, None]
                tail = tail_k.transpose(-1, -2) @ v1[:, :, :L]
            sums = tail if carry is None else _aged(carry, decay, L) + tail
        if carry is not None:
            entering = carry[:, :, None] if decay is None else (
                carry[:, :, None] * decay.powers(C * torch.arange(nc))[None, :, :, None, None])
            state_in = state_in + entering
            carry = _aged(carry, decay, Lp) + slab_total
        else:
            carry = slab_total
        intra = torch.bmm(qc, kc.transpose(1, 2))  # [B Hk nc, g C, C]
        if decay is None:
            intra.view(-1, g, C, C).tril_()  # causal within the chunk, diagonal included
        else:  # causal with gamma^(i - s); a [Hk, C, C] factor broadcast over batch, chunks and group
            intra = (intra.view(B, Hk, nc, g, C, C) * decay.intra[None, :, None, None]).view(B * Hk * nc, g * C, C)
            qc = (qc.view(B, Hk, nc, g, C, Fd) * decay.query_scale[None, :, None, None, :, None]).view(qc.shape)
        lin = torch.baddbmm(torch.bmm(qc, state_in.view(B * Hk * nc, Fd, D + 1)), intra, vc)
        lin = _chunks_7d(lin, Hk, g, nc, m)  # [B, Hk, nc, m, g, w, D+1], aligned with win_avg

        if has_win is None:
            # Common case (no padding, every window non-empty): the mix without combine's guards. The
            # window's weight is a (hybrid) or a * win_sum with win_sum >= 1 (lolcats): the
            # normalizer is positive.
            w_win = a7 if formulation == "hybrid" else win_sum * a7
            out = torch.addcmul(win_avg * w_win, lin[..., :D], b7) / torch.addcmul(w_win, lin[..., D:], b7)
        else:
            out = combine(formulation, a7, b7, win_avg, win_sum, lin[..., :D], lin[..., D:])
        result = _emit(out, outs, result, t0, T, L)
    if result is None:
        result = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    final_state = None
    if output_final_state:
        linear_sums = None if sums is None else (sums[..., :D], sums[..., D])
        final_state = prefill_state(
            k_in, v_in, window=window, feature_map=feature_map, key_padding_mask=key_padding_mask,
            linear_sums=linear_sums, log_decay=log_decay,
        )
    return result.to(out_dtype), final_state
