"""Figures for the report (matplotlib, no display needed).

Every function reads CSV/JSON artifacts, writes ``<out_stem>.png`` and ``<out_stem>.svg`` and returns
both paths. Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot global state), so
they render headless (Agg) and are safe to call from several threads of a workflow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

from hybrid_llama.eval.mmlu import CHANCE
from hybrid_llama.report.results import crossover, paired_speedup

# Legends go beside the axes (saved with bbox_inches="tight"), never on top of the lines.
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0}


def save_figure(fig: Figure, out_stem: str | Path) -> list[Path]:
    stem = Path(out_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")]
    fig.savefig(paths[0], dpi=130, bbox_inches="tight")
    with rc_context({"svg.fonttype": "none"}):  # keep text as text: searchable, smaller
        fig.savefig(paths[1], bbox_inches="tight")
    return paths


def _devices(values: Iterable) -> str:
    names = sorted({str(v) for v in values if isinstance(v, str) and v})
    return ", ".join(names) if names else "unknown device"


def log2_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=20))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"$2^{{{round(math.log2(x))}}}$" if x > 0 else ""))


def _read_throughput(csv_path) -> pd.DataFrame:
    df = pd.read_csv(csv_path)
    if "status" not in df:
        df["status"] = "ok"
    return df


def _variant_label(df: pd.DataFrame, variant: str) -> str:
    g = df[df["variant"] == variant]
    backend = g["backend"].iloc[0] if "backend" in g and len(g) else ""
    label = f"{variant} ({backend})" if backend and backend not in variant else variant
    bad = g[g["status"] == "oom"]
    if len(bad):
        label += f" [OOM at {int(bad['seq_len'].min())}]"
    return label


def _header(df: pd.DataFrame) -> str:
    parts = [_devices(df.get("device_name", df.get("device", [])))]
    if "dtype" in df:
        parts.append("/".join(sorted(df["dtype"].astype(str).unique())))
    if "batch" in df:
        parts.append("batch " + "/".join(str(b) for b in sorted(df["batch"].unique())))
    return ", ".join(parts)


def _style(variant: str, k: int) -> dict:
    """Base black and dashed (the reference on every figure), variants in colour."""
    return {"color": "black", "ls": "--", "lw": 1.8} if variant == "base" else {"color": f"C{k % 10}", "ls": "-"}


def plot_throughput(csv_path: str | Path, out_stem: str | Path, *, title: str | None = None) -> list[Path]:
    """Top: prefill and decode tokens/s vs prompt length, log-log, one line per variant and backend;
    an 'x' marks where a variant overtakes base. Bottom: each variant's speed-up over base, the median
    of the per-repeat paired ratios with bars from their min to max, so a gain inside the bars is noise."""
    df = _read_throughput(csv_path)
    ok = df[df["status"] == "ok"]
    fig = Figure(figsize=(11, 8.2), layout="constrained")
    axes = fig.subplots(2, 2, sharex="col")
    titles = {"prefill": "prefill (whole prompt)", "decode": "decode (after a prompt of that length)"}
    for col, phase in enumerate(("prefill", "decode")):
        ax, ax_ratio = axes[0, col], axes[1, col]
        base_rows = ok[(ok["variant"] == "base") & (ok["phase"] == phase)].set_index("seq_len")
        for k, variant in enumerate(df["variant"].unique()):
            g = ok[(ok["variant"] == variant) & (ok["phase"] == phase)].sort_values("seq_len")
            if not len(g):
                continue
            line = ax.plot(g["seq_len"], g["tokens_per_s"], marker="o", ms=3, label=_variant_label(df, variant),
                           **_style(variant, k))[0]
            if variant == "base":
                continue
            shared = [n for n in g["seq_len"] if n in base_rows.index]
            by_len = g.set_index("seq_len")
            paired = [paired_speedup(by_len.loc[n].to_dict(), base_rows.loc[n].to_dict()) for n in shared]
            ratio = [p[0] for p in paired]
            if shared:
                ax_ratio.errorbar(shared, ratio, yerr=[[p[0] - p[1] for p in paired], [p[2] - p[0] for p in paired]],
                                  marker="o", ms=3, capsize=2, color=line.get_color(), ls="-")
            cross = crossover(shared, ratio)
            if cross is not None:
                y = float(np.exp(np.interp(np.log(cross), np.log(g["seq_len"]), np.log(g["tokens_per_s"]))))
                ax.plot([cross], [y], marker="x", ms=10, mew=2, color=line.get_color(), ls="none")
                ax.annotate(f"≈{cross:,.0f}", (cross, y), xytext=(4, 6), textcoords="offset points", fontsize=7,
                            color=line.get_color())
        ax.set_yscale("log")
        ax.set_ylabel("throughput (tokens/s, log scale)")
        ax.set_title(titles[phase])
        ax_ratio.axhline(1.0, color="black", ls="--", lw=1.2)
        ax_ratio.set_ylabel("speed-up over base (×; bars: min–max of repeats)")
        ax_ratio.set_xlabel("prompt length (tokens, log scale)")
        for a in (ax, ax_ratio):
            log2_axis(a)
            a.grid(True, which="both", alpha=0.3)
    axes[0, 1].legend(**OUTSIDE, fontsize=8)
    fig.suptitle(title or f"Throughput vs prompt length: {_header(df)} (x: crossover with base)")
    return save_figure(fig, out_stem)


def plot_memory(csv_path: str | Path, out_stem: str | Path, *, title: str | None = None) -> list[Path]:
    """Generation cache size after prefill (log-log) and peak memory vs prompt length, per variant."""
    df = _read_throughput(csv_path)
    ok = df[df["status"] == "ok"]
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax_cache, ax_mem = fig.subplots(1, 2)
    method = ", ".join(sorted(df["mem_method"].dropna().astype(str).unique())) if "mem_method" in df else ""
    big = ok["peak_mem_bytes"].max() > 4 * 2**30 if len(ok) else False
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    for k, variant in enumerate(df["variant"].unique()):
        style = _style(variant, k)
        g = ok[(ok["variant"] == variant) & (ok["phase"] == "prefill")].sort_values("seq_len")
        label = _variant_label(df, variant)
        if "cache_bytes" in g and g["cache_bytes"].notna().any():
            ax_cache.plot(g["seq_len"], g["cache_bytes"], marker="o", ms=3, label=label, **style)
        if len(g):
            ax_mem.plot(g["seq_len"], g["peak_mem_bytes"] / scale, marker="o", ms=3, label=label, **style)
    for ax in (ax_cache, ax_mem):
        log2_axis(ax)
        ax.set_xlabel("prompt length (tokens, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    ax_cache.set_yscale("log")  # the KV cache grows linearly, the hybrid state stays flat: decades apart
    ax_cache.set_ylabel("cache after prefill (bytes, log scale)")
    ax_cache.set_title("generation cache (KV / hybrid state)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_ylabel(f"peak memory during prefill ({unit})")
    ax_mem.set_title(f"peak memory{' (' + method + ')' if method else ''}, weights included")
    for ax in (ax_cache, ax_mem):
        if ax.lines:
            ax.legend(**OUTSIDE, fontsize=7)
    fig.suptitle(title or f"Memory vs prompt length: {_header(df)}")
    return save_figure(fig, out_stem)


def _mmlu_label(res: dict) -> tuple[str, str]:
    meta = res.get("meta") or {}
    parts = [str(meta[k]) for k in ("variant", "stage") if meta.get(k)]
    who = " / ".join(dict.fromkeys(parts)) or str(meta.get("model", "model"))  # "base / base" -> "base"
    setting = f"{res.get('shots', '?')}-shot {res.get('fmt', 'mc')}, {res.get('device_name', '?')}"
    return who, setting


def plot_mmlu(json_paths: list[str | Path], out_stem: str | Path, *, metric: str = "acc",
              aggregate: str = "weighted", title: str | None = None) -> list[Path]:
    """Grouped bars: one group per variant/stage, one bar per shots x format x device, with stderr
    bars and the 25% chance line. ``aggregate``: "weighted" (by subject size) or "mean"."""
    results = [json.loads(Path(p).read_text()) for p in json_paths]
    groups: list[str] = []
    settings: list[str] = []
    values: dict[tuple[str, str], tuple[float, float]] = {}
    for res in results:
        who, setting = _mmlu_label(res)
        agg = res["aggregate"]
        key = f"{metric}_{aggregate}"
        if key not in agg:
            continue
        groups += [who] if who not in groups else []
        settings += [setting] if setting not in settings else []
        values[who, setting] = (agg[key], agg.get(f"{key}_stderr", float("nan")))
    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(settings)) + 2), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(settings))
    for j, setting in enumerate(settings):
        xs, ys, es = [], [], []
        for i, who in enumerate(groups):
            if (who, setting) in values:
                y, e = values[who, setting]
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(100 * y)
                es.append(100 * e)
        bars = ax.bar(xs, ys, width=width * 0.95, yerr=es, capsize=3, label=setting, color=f"C{j % 10}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.axhline(100 * CHANCE, color="k", ls="--", lw=1, label="chance (25%)")
    ax.set_xticks(range(len(groups)), groups, rotation=15)
    ax.set_ylabel(f"MMLU {metric} ({aggregate} over subjects, %) ± stderr")
    ax.set_xlabel("model variant / stage")
    top = max([v[0] + (v[1] if v[1] == v[1] else 0) for v in values.values()] + [CHANCE])
    ax.set_ylim(0, min(100, 100 * top + 15))
    ax.legend(**OUTSIDE, fontsize=8)
    devices = _devices(r.get("device_name") for r in results)
    ax.set_title(title or f"MMLU accuracy: {devices}")
    return save_figure(fig, out_stem)


def _device_for(csv_path: Path, device: str | None) -> str:
    if device:
        return device
    metrics = csv_path.parent / "metrics.json"
    if metrics.exists():
        m = json.loads(metrics.read_text())
        for k in ("device_name", "device"):
            if isinstance(m.get(k), str):
                return m[k]
    return "unknown device"


def plot_transfer_loss(csv_path: str | Path, out_stem: str | Path, *, title: str | None = None,
                       device: str | None = None) -> list[Path]:
    """Attention-transfer MSE per hybrid layer over optimizer steps (loss.csv: step, layer, mse)."""
    csv_path = Path(csv_path)
    df = pd.read_csv(csv_path)
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for layer in sorted(df["layer"].unique()):
        g = df[df["layer"] == layer].sort_values("step")
        ax.plot(g["step"], g["mse"], label=f"layer {layer}", lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("attention-output MSE vs softmax teacher")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if df["layer"].nunique() > 8 else 1)
    ax.set_title(title or f"Attention transfer loss per layer: {_device_for(csv_path, device)}")
    return save_figure(fig, out_stem)


def plot_lora_loss(csv_path: str | Path, out_stem: str | Path, *, title: str | None = None,
                   device: str | None = None) -> list[Path]:
    """LoRA fine-tuning loss, train and validation (loss.csv: step, split, loss)."""
    csv_path = Path(csv_path)
    df = pd.read_csv(csv_path)
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for split in sorted(df["split"].unique(), key=lambda s: (s != "train", s)):
        g = df[df["split"] == split].sort_values("step")
        ax.plot(g["step"], g["loss"], marker="o" if len(g) < 30 else None, ms=3, label=split)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title or f"LoRA fine-tuning loss: {_device_for(csv_path, device)}")
    return save_figure(fig, out_stem)
