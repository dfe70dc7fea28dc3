"""Quality figures with every variant on one axis: NLL vs context, passkey accuracy vs context and
the component diagnostic (the window's share of each hybrid layer's normalizer).

Each function takes ``{variant: rows}`` (the rows of that variant's quality table, which repeats the
shared stages base and base_lora) and writes ``<out_stem>.png`` and ``.svg``. Colours follow the
variant, line styles and markers the stage; base is black and dashed.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from hybrid_llama.names import STAGE_LABELS, STAGES
from hybrid_llama.report.plots import OUTSIDE, log2_axis, save_figure
from hybrid_llama.report.results import passkey_at, stage_rows

STAGE_STYLE = {"converted": (":", "v"), "transfer": ("-.", "s"), "transfer_lora": ("-", "o")}
SHARED_STYLE = {"base": {"color": "black", "ls": "--", "marker": "o", "lw": 1.8},
                "base_lora": {"color": "0.55", "ls": "--", "marker": "^"}}


def stage_label(variant: str | None, stage: str) -> str:
    return STAGE_LABELS[stage] if variant is None else f"{variant} · {STAGE_LABELS[stage].removeprefix('hybrid ')}"


def _lines(tables: dict[str, list[dict]]):
    """(label, style, rows) per line: colour by variant, line style and marker by stage."""
    colors = {v: f"C{k % 10}" for k, v in enumerate(tables)}
    for variant, stage, rows in stage_rows(tables):
        if variant is None:
            yield stage_label(None, stage), SHARED_STYLE[stage], rows
        else:
            ls, marker = STAGE_STYLE.get(stage, ("-", "o"))
            yield stage_label(variant, stage), {"color": colors[variant], "ls": ls, "marker": marker}, rows


def _windows(ax, windows: dict[str, int] | None) -> None:
    for w in sorted(set((windows or {}).values())):
        ax.axvline(w, color="0.4", ls=(0, (1, 3)), lw=1)
        ax.annotate(f"window {w}", (w, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=7, color="0.3")


def _context_figure(tables: dict[str, list[dict]], points, out_stem: str | Path, *, title: str, ylabel: str,
                    windows: dict[str, int] | None, ylim: tuple[float, float] | None = None) -> list[Path]:
    """One line per (variant, stage) of ``points(rows) -> (context lengths, values)``, log-2 x axis,
    the windows marked."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    for label, style, rows in _lines(tables):
        ax.plot(*points(rows), ms=4, label=label, **style)
    _windows(ax, windows)
    log2_axis(ax)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel("context length (tokens, log scale)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**OUTSIDE, fontsize=7)
    ax.set_title(title)
    return save_figure(fig, out_stem)


def plot_nll(tables: dict[str, list[dict]], out_stem: str | Path, *, title: str,
             windows: dict[str, int] | None = None) -> list[Path]:
    """Held-out NLL of the last tokens vs context length (log x), every stage of every variant."""
    def nll(rows: list[dict]) -> tuple[list[int], list[float]]:
        pts = sorted((int(r["context_len"]), float(r["nll"])) for r in rows)
        return [p[0] for p in pts], [p[1] for p in pts]

    return _context_figure(tables, nll, out_stem, title=title, windows=windows,
                           ylabel="NLL of the scored tail tokens (nats/token)")


def plot_passkey(tables: dict[str, list[dict]], out_stem: str | Path, *, title: str,
                 windows: dict[str, int] | None = None) -> list[Path]:
    """Passkey accuracy (all depths pooled) vs context length (log x), every stage of every variant."""
    def accuracy(rows: list[dict]) -> tuple[list[int], list[float]]:
        lens = sorted({int(r["context_len"]) for r in rows})
        return lens, [100 * passkey_at(rows, L)["accuracy"] for L in lens]

    return _context_figure(tables, accuracy, out_stem, title=title, windows=windows, ylim=(-5, 105),
                           ylabel="passkey retrieved (% of trials, all depths)")


def plot_components(tables: dict[str, list[dict]], out_stem: str | Path, *, title: str) -> list[Path]:
    """One panel per hybrid (variant, stage): the window's share of the normalizer per layer, one
    line per measured context length. 1 = the layer acts as window-only attention."""
    panels = [(v, s, [r for r in rows if r["stage"] == s])
              for v, rows in tables.items() for s in sorted({r["stage"] for r in rows}, key=STAGES.index)]
    cols = min(3, max(1, len(panels)))
    nrows = max(1, -(-len(panels) // cols))
    fig = Figure(figsize=(4.2 * cols, 3.2 * nrows + 0.6), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False, sharey=True)
    lens = sorted({int(r["context_len"]) for _, _, rows in panels for r in rows})
    colors = {L: f"C{i % 10}" for i, L in enumerate(lens)}
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    if not panels:
        axes[0][0].text(0.5, 0.5, "no hybrid stage was measured", ha="center", va="center")
    for ax, (variant, stage, rows) in zip(axes.flat, panels):
        for L in lens:
            pts = sorted((int(r["layer"]), float(r["window_share"])) for r in rows if int(r["context_len"]) == L)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=colors[L],
                        label=f"{L} tokens")
        layers = sorted({int(r["layer"]) for r in rows})
        ax.set_xticks(layers)
        ax.set_xlim(layers[0] - 0.5, layers[-1] + 0.5)
        ax.axhline(1.0, color="0.5", ls=":", lw=1)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(stage_label(variant, stage), fontsize=9)
        ax.set_xlabel("hybrid layer index")
        ax.set_ylabel("window share of normalizer")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, title="context", title_fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, out_stem)
