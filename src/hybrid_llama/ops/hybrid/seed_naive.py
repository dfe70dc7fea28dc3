"""The published recreation's naive implementation style, for benchmarks only.

The "Linearizing Llama" recreation (a ``HybridAttention(LlamaSdpaAttention)`` with
``window_size = 64`` and per-head sigmoid window/linear factors) computes the op like this:

- window part: left-pad k/v by w-1 and ``unfold`` them into ``[B, H, T, D, w]`` windows, einsum the
  scores, softmax, scale by ``sigmoid(window_factor)``;
- linear part: shift ``phi(k)`` and v right by w, build ``phi(k_j) v_j^T`` for every position
  (``[B, H, T, D, D]``), ``cumsum`` it over time, contract with ``phi(q)``; same for ``phi(k)``;
- ``out = (a * win + b * lin_num) / (a * sum_win + b * lin_den)``.

This module re-implements that style (written here, not copied) with the same semantics as
``hybrid_attention(formulation="hybrid", feature_map="elu1")``. One deliberate difference: the
recreation masks the window by replacing scores that are exactly 0 with -inf (which also hits a
real key whose score happens to be 0); here the padded slots are masked explicitly, so results
agree with the other backends. It materialises O(T * D^2) memory and is only here to show what
the chunked backend saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..state import HybridState, prefill_state


def hybrid_attention_seed_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int = 64,
    output_final_state: bool = False,
) -> tuple[Tensor, HybridState | None]:
    """Returns ``(o, final_state)``; the recreation had no decode state, so it is built by
    ``prefill_state`` when asked for (the torch step decodes from it)."""
    B, H, T, D = q.shape
    w = window
    a = torch.sigmoid(window_logit).view(1, H, 1, 1)
    b = torch.sigmoid(linear_logit).view(1, H, 1, 1)

    # Window part: every query gets its own [D, w] slice of keys (a strided view, einsum'd).
    k_win = F.pad(k, (0, 0, w - 1, 0)).unfold(2, w, 1)  # [B, H, T, D, w]
    v_win = F.pad(v, (0, 0, w - 1, 0)).unfold(2, w, 1)
    scores = torch.einsum("bhtd,bhtdw->bhtw", q, k_win) * D**-0.5
    slot_pos = torch.arange(T, device=q.device)[:, None] - (w - 1) + torch.arange(w, device=q.device)
    scores = scores.masked_fill(slot_pos < 0, float("-inf"))  # slots left of position 0
    probs = a * torch.softmax(scores, dim=-1)
    win_num = torch.einsum("bhtw,bhtdw->bhtd", probs, v_win)
    win_den = probs.sum(dim=-1, keepdim=True)

    # Linear part: keys shifted by w, then a cumsum over the full [B, H, T, D, D] outer products.
    phi_q = F.elu(q) + 1
    phi_k = F.pad(F.elu(k) + 1, (0, 0, w, 0))[:, :, :T]
    v_shift = F.pad(v, (0, 0, w, 0))[:, :, :T]
    kv = torch.einsum("bhtf,bhtd->bhtfd", phi_k, v_shift).cumsum(dim=2)
    lin_num = b * torch.einsum("bhtf,bhtfd->bhtd", phi_q, kv)
    lin_den = b * torch.einsum("bhtf,bhtf->bht", phi_q, phi_k.cumsum(dim=2))[..., None]

    o = (win_num + lin_num) / (win_den + lin_den)
    return o, prefill_state(k, v, window=window) if output_final_state else None
