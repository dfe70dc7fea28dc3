"""Peak memory of a phase of work (a prefill, a decode), for the throughput measurement.

Peak memory: a variant's weights plus how far the phase raised the memory high-water mark above its
level when the phase began. On CUDA that mark is ``torch.cuda.max_memory_allocated`` (reset before
each phase); on CPU the resident-set high-water mark ``VmHWM`` from ``/proc/self/status``, reset to the
current RSS by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). Where that is not permitted,
``ru_maxrss`` (the lifetime peak, which cannot be reset) is reported instead. The column
``mem_method`` says which was used.

Out-of-memory at a length gives rows with ``status="oom"``; longer lengths of that variant are
``"skipped"``. Any other exception gives ``status="error"`` with the message in ``error``.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

import torch


def _read_hwm() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


class PeakMemory:
    """Resettable peak-memory probe: CUDA max allocated, or the CPU RSS high-water mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.method = "cuda_max_allocated"
        else:
            self.method = "rss_hwm" if self._clear_refs() and _read_hwm() is not None else "ru_maxrss"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5 = reset the peak RSS to the current RSS
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.method == "cuda_max_allocated":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.level = int(torch.cuda.memory_allocated(self.device))
        elif self.method == "rss_hwm":
            self._clear_refs()
            self.level = int(_read_hwm())
        else:
            self.level = 0  # ru_maxrss cannot be reset: growth is the lifetime peak

    def growth(self) -> int:
        """How far the peak rose above the level at the last :meth:`reset`."""
        return max(0, self.peak() - self.level)

    def peak(self) -> int:
        if self.method == "cuda_max_allocated":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.method == "rss_hwm":
            return int(_read_hwm())
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux
