"""Training rows at shifted positions: the RoPE angles a hybrid layer meets at long contexts.

A hybrid layer applies its feature maps after RoPE, so ``phi(R_t q) . phi(R_j k)`` depends on the
absolute positions t and j. Rows that always start at position 0 show the maps only the angles of
the first ``seq_len`` positions; past them the maps read inputs they never saw (docs/long-context.md).
Softmax attention depends only on ``t - j``, so shifting a whole row by one offset leaves the
teacher's outputs (its targets) unchanged and moves only what the feature maps read. ``max_position``
(the ``transfer`` and ``lora`` key) draws each training row's start uniformly from
``[0, max_position - row length]``; 0 leaves every row at position 0.
"""

from __future__ import annotations

import torch

__all__ = ["check_max_position", "row_offsets", "position_ids"]


def check_max_position(max_position: int, seq_len: int, model_positions: int | None, key: str) -> None:
    """Reject a ``max_position`` shorter than a row or longer than the model's positions, naming ``key``."""
    if max_position == 0:
        return
    if max_position < seq_len:
        raise ValueError(f"{key}={max_position} is shorter than a training row ({seq_len} tokens); "
                         f"use 0 or >= {seq_len}")
    if model_positions is not None and max_position > model_positions:
        raise ValueError(f"{key}={max_position} exceeds the model's {model_positions} positions")


def row_offsets(rows: list[int], step: int, seed: int, seq_len: int, max_position: int) -> list[int] | None:
    """Each training row's start position at optimizer step ``step``, or None (``max_position`` 0, or no
    room). A function of (seed, step, row) only, so a resumed run shifts every batch as before."""
    room = max_position - seq_len
    if max_position == 0 or room <= 0:
        return None
    out = []
    for r in rows:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + int(r))
        out.append(int(torch.randint(0, room + 1, (1,), generator=g)))
    return out


def position_ids(offsets: list[int], seq_len: int, device: torch.device | str) -> torch.Tensor:
    """``[B, seq_len]`` position ids starting at each row's offset."""
    start = torch.tensor(offsets, dtype=torch.long, device=device)[:, None]
    return start + torch.arange(seq_len, device=device)[None]
