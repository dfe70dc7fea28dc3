"""Training rows at shifted positions: the RoPE angles a hybrid layer meets at long contexts.

A hybrid layer applies its feature maps after RoPE, so ``phi(R_t q) . phi(R_j k)`` depends on the
absolute positions t and j. Rows that always start at position 0 show the maps only the angles of
the first ``seq_len`` positions; past them the maps read inputs they never saw (docs/long-context.md).
Softmax attention depends only on ``t - j``, so shifting a whole row by one offset leaves the
teacher's outputs (its targets) unchanged and moves only what the feature maps read. ``max_position``
(the ``transfer`` and ``lora`` key) draws each training row's start below it; 0 leaves every row at
position 0. ``position_draw`` says how (L the row length):

- ``uniform`` (the default): a start uniform in ``[0, max_position - L]``. A position p past
  ``max_position - L`` lies in a row with probability ``(max_position - p) / (max_position - L + 1)``,
  so the last positions, where an evaluation at ``max_position`` tokens asks its questions, are
  almost never trained.
- ``cover``: a start uniform in ``[-(L - 1), max_position - 1]``, clamped into ``[0, max_position - L]``.
  Every position below ``max_position`` then lies in a row with probability at least
  ``L / (max_position + L - 1)``, the first and last included. On the recommended recipe it gains
  NLL near ``max_position`` and loses the passkeys there (docs/long-context.md, "Positions near the end").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["POSITION_DRAWS", "NO_SHIFT", "RowShift", "check_max_position", "row_offsets", "position_ids"]

POSITION_DRAWS = ("uniform", "cover")


def check_max_position(max_position: int, seq_len: int, model_positions: int | None, key: str) -> None:
    """Reject a ``max_position`` shorter than a row or longer than the model's positions, naming ``key``."""
    if max_position == 0:
        return
    if max_position < seq_len:
        raise ValueError(f"{key}={max_position} is shorter than a training row ({seq_len} tokens); "
                         f"use 0 or >= {seq_len}")
    if model_positions is not None and max_position > model_positions:
        raise ValueError(f"{key}={max_position} exceeds the model's {model_positions} positions")


def _check_draw(draw: str) -> None:
    if draw not in POSITION_DRAWS:
        raise ValueError(f"position draw {draw!r}: expected one of {POSITION_DRAWS}")


def row_offsets(rows: list[int], step: int, seed: int, seq_len: int, max_position: int,
                draw: str = "uniform") -> list[int] | None:
    """Each training row's start position at optimizer step ``step``, or None (``max_position`` 0, or no
    room), drawn as ``draw`` says (``POSITION_DRAWS``, module docstring). A function of (seed, step,
    row) only, so a resumed run shifts every batch as before."""
    _check_draw(draw)
    room = max_position - seq_len
    if max_position == 0 or room <= 0:
        return None
    low = 0 if draw == "uniform" else 1 - seq_len
    high = room if draw == "uniform" else max_position - 1
    out = []
    for r in rows:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_033 + int(r))
        out.append(min(max(int(torch.randint(low, high + 1, (1,), generator=g)), 0), room))
    return out


def position_ids(offsets: list[int], seq_len: int, device: torch.device | str) -> torch.Tensor:
    """``[B, seq_len]`` position ids starting at each row's offset."""
    start = torch.tensor(offsets, dtype=torch.long, device=device)[:, None]
    return start + torch.arange(seq_len, device=device)[None]


@dataclass(frozen=True)
class RowShift:
    """How a stage shifts its training rows: ``max_position`` (0: not at all), the stage's ``seed`` and
    the ``draw`` (``POSITION_DRAWS``). One value that every objective takes, rather than three."""

    max_position: int = 0
    seed: int = 0
    draw: str = "uniform"

    def __post_init__(self) -> None:
        _check_draw(self.draw)

    @classmethod
    def of(cls, settings: Any) -> RowShift:
        """The shift a stage's settings (``TransferSettings`` or ``LoraSettings``) ask for."""
        return cls(int(settings.max_position), int(settings.loop.seed), str(settings.position_draw))

    def position_ids(self, rows: list[int], step: int, seq_len: int,
                     device: torch.device | str) -> torch.Tensor | None:
        """``[len(rows), seq_len]`` position ids of training rows ``rows`` at optimizer step ``step``, or
        None where the rows stay at position 0."""
        offsets = row_offsets(rows, step, self.seed, seq_len, self.max_position, self.draw)
        return None if offsets is None else position_ids(offsets, seq_len, device)


NO_SHIFT = RowShift()  # every row at position 0
