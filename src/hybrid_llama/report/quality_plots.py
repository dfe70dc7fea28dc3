"""Quality plots: NLL vs context length and passkey heatmaps (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from hybrid_llama.eval.quality import read_passkey_csv, read_perplexity_csv  # noqa: E402


def _rows(rows_or_csv, reader) -> list[dict]:
    if isinstance(rows_or_csv, (str, Path)):
        return reader(rows_or_csv)
    return list(rows_or_csv)


def _save(fig, out_stem: str | Path) -> list[Path]:
    out_stem = Path(out_stem)
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [out_stem.with_suffix(".png"), out_stem.with_suffix(".svg")]
    for p in paths:
        fig.savefig(p, dpi=120 if p.suffix == ".png" else None, bbox_inches="tight")
    plt.close(fig)
    return paths


def plot_nll_vs_context(
    rows_or_csv, out_stem: str | Path, *, device: str, tail: int = 64, window: int | None = None
) -> list[Path]:
    """One line per stage: mean NLL of the last `tail` tokens vs context length (log2 x).

    `window`: the hybrid's softmax window, drawn as a dashed vertical line when given.
    """
    rows = _rows(rows_or_csv, read_perplexity_csv)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for stage in dict.fromkeys(r["stage"] for r in rows):
        pts = sorted((int(r["context_len"]), float(r["nll"])) for r in rows if r["stage"] == stage)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=stage)
    if window:
        ax.axvline(window, color="gray", linestyle="--", linewidth=1, label=f"softmax window ({window})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens, log2)")
    ax.set_ylabel(f"NLL of the last {tail} tokens (nats/token)")
    ax.set_title(f"Held-out NLL vs context length — {device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="stage")
    return _save(fig, out_stem)


def plot_passkey_heatmap(rows_or_csv, out_stem: str | Path, *, device: str) -> list[Path]:
    """One panel per stage: passkey accuracy by context length (x) and key depth (y)."""
    rows = _rows(rows_or_csv, read_passkey_csv)
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    lens = sorted({int(r["context_len"]) for r in rows})
    depths = sorted({float(r["depth"]) for r in rows})
    fig, axes = plt.subplots(1, len(stages), figsize=(1.2 + 0.7 * len(lens) * len(stages) + 1.5 * len(stages), 3.6),
                             squeeze=False, sharey=True)
    image = None
    for ax, stage in zip(axes[0], stages):
        grid = np.full((len(depths), len(lens)), np.nan)
        for r in rows:
            if r["stage"] == stage:
                grid[depths.index(float(r["depth"])), lens.index(int(r["context_len"]))] = float(r["accuracy"])
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", origin="lower", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
        ax.set_xticks(range(len(lens)), [str(L) for L in lens], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(stage)
        ax.set_xlabel("context length (tokens)")
    axes[0][0].set_ylabel("key depth (share of filler before it)")
    fig.suptitle(f"Passkey retrieval accuracy — {device}")
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label="accuracy", shrink=0.9)
    return _save(fig, out_stem)
