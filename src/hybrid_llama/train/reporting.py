"""What a run reports while it trains: the loss CSV and the progress bar."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hybrid_llama.files import atomic_write

__all__ = ["LossCSV", "Progress"]


class LossCSV:
    """Append-only CSV log. On resume, rows after the checkpoint's step are dropped, so none repeat."""

    def __init__(self, path: str | os.PathLike, header: Sequence[str], resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[list[str]] = []
        if resume_step is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                r = csv.reader(f)
                next(r, None)
                rows = [row for row in r if row and int(row[0]) <= resume_step]

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(header)
                w.writerows(rows)

        atomic_write(self.path, write)
        self._f = open(self.path, "a", newline="")
        self._w = csv.writer(self._f)

    def write(self, *row: Any) -> None:
        self._w.writerow([f"{v:.8g}" if isinstance(v, float) else v for v in row])

    def write_rows(self, rows: Iterable[Sequence[Any]]) -> None:
        """Write ``rows`` and flush, so a killed run's log holds every finished step."""
        for row in rows:
            self.write(*row)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Progress:
    """tqdm bar over optimizer steps showing loss and tokens/s (silent when disabled)."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4g}", tok_s=f"{tokens_per_s:.0f}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
