"""The figure of NLL vs context on the held-out books: every stage of every variant on one axis (left)
and each stage's paired gap to base with its 95 % interval over the scored windows (right)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from hybrid_llama.report.plots import OUTSIDE, log2_axis, save_figure
from hybrid_llama.report.quality_plots import _lines, _windows
from hybrid_llama.report.results import nll_delta, stage_rows


def plot_books_nll(tables: dict[str, list[dict]], out_stem: str | Path, *, title: str,
                   windows: dict[str, int] | None = None) -> list[Path]:
    """``tables``: {variant: rows of its books table} (perplexity.csv format, base repeated in each)."""
    fig = Figure(figsize=(12, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    base = next((rows for _, stage, rows in stage_rows(tables) if stage == "base"), [])
    for label, style, rows in _lines(tables):
        pts = sorted((int(r["context_len"]), float(r["nll"])) for r in rows)
        left.plot([p[0] for p in pts], [p[1] for p in pts], ms=4, label=label, **style)
        if rows is base or not base:
            continue
        gaps = [(L, nll_delta(rows, base, L)) for L, _ in pts]
        gaps = [(L, d) for L, d in gaps if d is not None]
        if gaps:
            right.errorbar([L for L, _ in gaps], [d["diff"] for _, d in gaps],
                           yerr=[1.96 * d["stderr"] if d["stderr"] == d["stderr"] else 0 for _, d in gaps],
                           capsize=3, ms=4, label=label, **style)
    right.axhline(0.0, color="black", ls="--", lw=1.2)
    for ax, ylabel in ((left, "NLL of the scored tail tokens (nats/token)"),
                       (right, "NLL − base NLL, same windows (nats/token, 95 % interval)")):
        _windows(ax, windows)
        log2_axis(ax)
        ax.set_xlabel("context length (tokens, log scale)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    (right if right.has_data() else left).legend(**OUTSIDE, fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, out_stem)
