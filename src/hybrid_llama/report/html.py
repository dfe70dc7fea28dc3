"""results/report.html: one self-contained page (images embedded as base64) built with jinja2.

The page answers "what did linearization buy, and what did it cost?" first: a headline table per
(model, device) (``hybrid_llama.report.headline``) and a short generated summary
(``hybrid_llama.report.summary``), then the figures with every variant on one axis, then the detail
in collapsible sections (tables behind the figures, per-subject MMLU, training, generations,
configuration, provenance). Everything shown comes from the result files; a file that is listed but
missing shows as "not measured" and in a list at the top.
"""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import subprocess
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from hybrid_llama.eval.mmlu import CHANCE
from hybrid_llama.eval.tables import BEYOND_WINDOW, read_rows
from hybrid_llama.files import atomic_write
from hybrid_llama.names import SHARED_STAGES, STAGE_LABELS, STAGES
from hybrid_llama.pipeline import Pipeline, parse_result_path
from hybrid_llama.report.formatting import byte_size, plus_minus
from hybrid_llama.report.headline import anchor, headlines
from hybrid_llama.report.long_context import book_tables, niah_tables, recommended_blocks
from hybrid_llama.report.quality_plots import stage_label
from hybrid_llama.report.results import (
    Results,
    mmlu_delta,
    mmlu_metric,
    nll_delta,
    num,
    paired_speedup,
    passkey_at,
    stage_rows,
)
from hybrid_llama.report.summary import summarize

PACKAGES = ["hybrid-llama", "torch", "transformers", "peft", "lm_eval", "triton", "snakemake",
            "safetensors", "tokenizers", "datasets", "numpy", "pandas", "matplotlib", "jinja2"]


# ------------------------------------------------------------------------------------ helpers


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def _fmt(x: Any, spec: str = ".3f") -> str:
    v = num(x)
    return "–" if math.isnan(v) else format(v, spec)


def _pct(x: Any, se: Any = None) -> str:
    v = num(x)
    if math.isnan(v):
        return "–"
    s = f"{100 * v:.1f}"
    return s + (f" ± {100 * num(se):.1f}" if se is not None and not math.isnan(num(se)) else "")


def _nice(x: Any) -> str:
    """Floats with 4 significant digits; everything else as is."""
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def embed_image(path) -> str:
    """A data: URI of a PNG/SVG file, so the page needs no other file."""
    path = Path(path)
    mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _stage_name(slot: str, stage: str) -> str:
    return stage_label(None if slot in SHARED_STAGES else slot, stage)


# ------------------------------------------------------------------------------------ MMLU


def mmlu_rows(res: Results) -> list[dict]:
    """One row per MMLU result: accuracy, and the paired difference to base on the same questions
    (transfer_lora also to the base + LoRA control)."""
    def order(key: tuple) -> tuple:  # model, device, format, shots, then base, control, variants by stage
        model, slot, device, stage, fmt, shots = key
        return model, device, fmt, shots, slot not in SHARED_STAGES, slot, STAGES.index(stage)

    rows = []
    for key in sorted(res.mmlu, key=order):
        model, slot, device, stage, fmt, shots = key
        r, metric = res.mmlu[key], mmlu_metric(fmt)
        agg = r["aggregate"]
        row = {
            "model": model, "device": device, "device_name": r.get("device_name", ""),
            "stage": _stage_name(slot, stage),
            "shared": slot in SHARED_STAGES, "fmt": fmt, "shots": shots, "metric": metric, "n": agg.get("n"),
            "weighted": _pct(agg.get(f"{metric}_weighted"), agg.get(f"{metric}_weighted_stderr")),
            "mean": _pct(agg.get(f"{metric}_mean"), agg.get(f"{metric}_mean_stderr")),
            "wall_time_s": _fmt(r.get("wall_time_s"), ".0f"), "vs_base": "", "significant": "", "vs_control": "",
        }
        for ref, col in (("base", "vs_base"), ("base_lora", "vs_control")):
            other = res.mmlu.get((model, ref, device, ref, fmt, shots))
            if other is None or slot == ref or (ref == "base_lora" and stage != "transfer_lora"):
                continue
            d = mmlu_delta(r, other, fmt)
            if d is not None:
                row[col] = plus_minus(100 * d["diff"], 100 * d["stderr_paired"], 1)
                if col == "vs_base":
                    row["significant"] = "yes" if d["significant"] else "no"
                else:
                    row[col] += " (significant)" if d["significant"] else " (n.s.)"
        rows.append(row)
    return rows


def mmlu_subject_tables(res: Results) -> list[dict]:
    """Per (model, device, format, shots): accuracy per subject (rows) and stage (columns)."""
    groups = defaultdict(dict)
    for (model, slot, device, stage, fmt, shots), r in res.mmlu.items():
        groups[model, device, fmt, shots][slot, stage] = r
    tables = []
    for (model, device, fmt, shots), results in sorted(groups.items()):
        metric = mmlu_metric(fmt)
        cols = sorted(results, key=lambda k: (k[0] not in SHARED_STAGES, k[0], STAGES.index(k[1])))
        subjects = sorted({s for r in results.values() for s in r.get("per_subject", {})})
        rows = [{"subject": s, "cells": [
            _pct((results[c].get("per_subject", {}).get(s) or {}).get(metric)) for c in cols]} for s in subjects]
        tables.append({"model": model, "device": device, "fmt": fmt, "shots": shots, "metric": metric,
                       "columns": [_stage_name(*c) for c in cols], "rows": rows})
    return tables


# ------------------------------------------------------------------------------------ throughput


def throughput_tables(rows: list[dict]) -> dict:
    """Per phase: tokens/s by length for every variant, with the ratio to base; the memory table."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["variant"], r["phase"], int(r["seq_len"])): r for r in rows}
    phases = {}
    for phase in ("prefill", "decode"):
        table = []
        for L in sorted({int(r["seq_len"]) for r in rows if r["phase"] == phase}):
            base, cells = by.get(("base", phase, L)), []
            for v in variants:
                r = by.get((v, phase, L))
                if r is None or r["status"] != "ok":
                    cells.append("" if r is None else r["status"])
                    continue
                tps = num(r["tokens_per_s"])
                cell = f"{tps:,.1f}"
                if base is not None and v != "base" and base["status"] == "ok":
                    ratio, lo, hi = paired_speedup(r, base)
                    cell += f" ({ratio:.2f}×" + (f", {lo:.2f}–{hi:.2f}" if hi > lo else "") + ")"
                cells.append(cell)
            table.append({"seq_len": L, "cells": cells})
        phases[phase] = table
    memory = []
    for L in sorted({int(r["seq_len"]) for r in rows}):
        cells = []
        for v in variants:
            r = by.get((v, "prefill", L))
            ok = r is not None and r["status"] == "ok"
            status = "" if r is None else r["status"]
            cells.append(f"{byte_size(r['peak_mem_bytes'])} / {byte_size(r['cache_bytes'])}" if ok else status)
        memory.append({"seq_len": L, "cells": cells})
    return {"variants": variants, "phases": phases, "memory": memory}


# ------------------------------------------------------------------------------------ quality


def quality_tables(res: Results, model: str, device: str) -> dict:
    """The tables behind the quality figures of one (model, device): NLL with the paired difference
    to base, passkey accuracy, and the component diagnostic."""
    def tables(kind: str) -> dict[str, list[dict]]:
        return {v: rows for (m, v, d), rows in sorted(getattr(res, kind).items()) if m == model and d == device}

    ppl = stage_rows(tables("perplexity"))
    base = next((rows for v, s, rows in ppl if s == "base"), [])
    nll = []
    for L in res.context_lens("perplexity", model, device):
        cells = []
        for _variant, stage, rows in ppl:
            r = next((r for r in rows if int(r["context_len"]) == L), None)
            d = nll_delta(rows, base, L) if stage != "base" else None
            delta = f" ({plus_minus(d['diff'], d['stderr'])})" if d else ""
            cells.append("" if r is None else f"{r['nll']:.3f}{delta}")
        nll.append({"context_len": L, "cells": cells})

    pk = stage_rows(tables("passkey"))
    passkey = []
    for L in res.context_lens("passkey", model, device):
        cells = []
        for _, _, rows in pk:
            p, far = passkey_at(rows, L), passkey_at(rows, L, beyond=BEYOND_WINDOW)
            text = "" if p is None else passkey_text(p)
            cells.append(text + ("" if far is None else f"; beyond the window: {passkey_text(far)}"))
        passkey.append({"context_len": L, "cells": cells})

    comp = stage_rows(tables("components"))
    comp_lens = res.context_lens("components", model, device)
    components = []
    for variant, stage, rows in comp:
        for layer in sorted({r["layer"] for r in rows}):
            at = {r["context_len"]: r for r in rows if r["layer"] == layer}
            components.append({"stage": stage_label(variant, stage), "layer": layer,
                               "cells": [_shares(at.get(L)) for L in comp_lens]})
    return {
        "nll_columns": [stage_label(v, s) for v, s, _ in ppl], "nll": nll,
        "passkey_columns": [stage_label(v, s) for v, s, _ in pk], "passkey": passkey,
        "depths": ", ".join(f"{d:g}" for d in sorted({r["depth"] for _, _, rows in pk for r in rows})),
        "components_lens": comp_lens, "components": components,
    }


def _shares(row: dict | None) -> str:
    """The window's share, and the sparse cache's beside it where a layer has one."""
    if row is None:
        return _pct(None)
    cache = row.get("cache_share")
    if cache:  # absent in older files, 0 for layers without the cache
        return f"{_pct(row['window_share'])} / {_pct(cache)}"
    return _pct(row["window_share"])


# ------------------------------------------------------------------------------------ provenance


def git_info(repo: str | Path) -> dict:
    def run(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20,
                                 check=False)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = run("rev-parse", "HEAD")
    dirty = run("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit or "unknown (not a git checkout, or no commit yet)",
        "short": commit[:12] if commit else "unknown",
        "dirty": bool(dirty),
    }


def package_versions() -> list[dict]:
    out = []
    for name in PACKAGES:
        try:
            out.append({"name": name, "version": metadata.version(name)})
        except metadata.PackageNotFoundError:
            out.append({"name": name, "version": "not installed"})
    out.append({"name": "python", "version": platform.python_version()})
    return out


def benchmark_rows(directory) -> list[dict]:
    """Wall time and peak RSS of every job from Snakemake's benchmark: files."""
    directory = Path(directory)
    rows = []
    for path in sorted(directory.rglob("*.tsv")) if directory.is_dir() else []:
        data = read_rows(path, {}, delimiter="\t")
        if data:
            rows.append({"job": str(path.relative_to(directory).with_suffix("")),
                         "s": num(data[-1].get("s")), "max_rss_mb": num(data[-1].get("max_rss"))})
    return rows


def manifest_summary(path) -> dict:
    """A manifest without its long per-document hash list (the count stays)."""
    data = _read_json(path)
    items = {k: (f"{len(v)} document sha256 hashes" if k == "doc_hashes" else v) for k, v in data.items()}
    return {"path": str(path), "items": items}


# ------------------------------------------------------------------------------------ report


def _existing(files: Iterable, missing: list[str]) -> list[Path]:
    """The files that exist; the others are added to ``missing`` (the page lists them)."""
    out = []
    for f in map(Path, files):
        if f.is_file():
            out.append(f)
        else:
            missing.append(f.as_posix())
    return out


def build_context(
    *,
    config: dict,
    mmlu: list,
    quality: list,
    throughput: list,
    generations: list,
    plots: list,
    transfer_metrics: list,
    lora_metrics: list,
    manifests: list,
    exports: list = (),
    report_dir: str | Path = "results",
    benchmarks_dir: str | Path = "logs/benchmarks",
    repo_dir: str | Path = ".",
) -> dict:
    """Everything the template shows, as plain strings/lists (no file access in the template)."""
    pipe = Pipeline(config, repo_dir)
    res = Results.load([*mmlu, *quality, *throughput])
    missing = res.missing
    plots_by_name = {}
    for p in _existing(plots, missing):
        name, w = parse_result_path(p)
        plots_by_name[(name, *(w.get(k) for k in ("model", "variant", "device", "fmt")))] = embed_image(p)

    def plot(name: str, model: str, variant: str | None = None, device: str | None = None,
             fmt: str | None = None) -> str | None:
        return plots_by_name.get((name, model, variant, device, fmt))

    heads = headlines(pipe, res)
    glance = []
    for h in heads:
        glance.append({
            "id": h.id, "model": h.model, "device": h.device, "device_name": h.device_name, "lengths": h.lengths,
            "window": h.window, "mmlu_headers": h.mmlu_headers,
            "rows": [{"label": r.label, "shared": r.slot in SHARED_STAGES, "cells": r.cells} for r in h.rows],
            "summary": summarize(h, res),
        })

    mmlu_table, subject_tables = mmlu_rows(res), mmlu_subject_tables(res)
    sections = []
    for model in pipe.models:
        for device in pipe.devices:
            speed = res.throughput.get((model, device))
            sections.append({
                "model": model, "device": device,
                "ids": {k: anchor(k, model, device) for k in ("nll", "passkey", "components", "throughput",
                                                                "memory", "mmlu", "books", "niah")},
                "nll_plot": plot("plot_nll", model, device=device),
                "passkey_plot": plot("plot_passkey", model, device=device),
                "components_plot": plot("plot_components", model, device=device),
                "throughput_plot": plot("plot_throughput", model, device=device),
                "memory_plot": plot("plot_memory", model, device=device),
                "quality": quality_tables(res, model, device),
                # long contexts (hybrid_llama.report.long_context)
                "books_plot": plot("plot_books_nll", model, device=device),
                "books": book_tables(res, model, device),
                "niah": niah_tables(res, model, device),
                "speed": throughput_tables(speed) if speed else None,
                "mmlu_subjects": [t for t in subject_tables if (t["model"], t["device"]) == (model, device)],
            })

    transfer_sections = []
    for p in _existing(transfer_metrics, missing):
        w = parse_result_path(p, ["transfer_metrics"])[1]
        m = _read_json(p)
        before, after = m.get("mse_before") or {}, m.get("mse_after") or {}
        layers = sorted(set(before) | set(after), key=lambda x: int(x) if str(x).isdigit() else 0)
        transfer_sections.append({
            "model": w["model"], "variant": w["variant"],
            "layers": [{"layer": k, "before": _fmt(before.get(k), ".4g"), "after": _fmt(after.get(k), ".4g"),
                        "ratio": _fmt(num(after.get(k)) / num(before.get(k)), ".3f")} for k in layers],
            "facts": {k: m.get(k) for k in ("steps", "train_tokens", "tokens_per_s", "wall_time_s",
                                            "trainable", "num_trainable_params", "autocast_bf16") if k in m},
            "plot": plot("plot_transfer_loss", w["model"], w["variant"]),
        })
    lora_sections = []
    for p in _existing(lora_metrics, missing):
        w = parse_result_path(p, ["lora_metrics"])[1]
        m = _read_json(p)
        lora_sections.append({
            "model": w["model"], "variant": w["variant"],
            "facts": {k: m.get(k) for k in ("objective", "val_metric", "val_loss_before", "val_loss_after",
                                            "train_loss_final", "steps", "tokens_per_s", "wall_time_s",
                                            "autocast_bf16") if k in m},
            "plot": plot("plot_lora_loss", w["model"], w["variant"]),
        })

    export_rows = []
    for p in exports:
        w = parse_result_path(p, ["export"])[1]
        card = Path(p) / "README.md"
        export_rows.append({
            "model": w["model"], "variant": w["variant"], "stage": STAGE_LABELS.get(pipe.export_stage(w["variant"])),
            # relative links: the report sits in results/ next to the exported directories
            "href": Path(os.path.relpath(p, report_dir)).as_posix() + "/",
            "card": Path(os.path.relpath(card, report_dir)).as_posix() if card.is_file() else None,
        })
        if not card.is_file():
            missing.append(card.as_posix())

    gens = defaultdict(lambda: defaultdict(dict))
    for p in _existing(generations, missing):
        w = parse_result_path(p, ["generations"])[1]
        order = (w["variant"] not in SHARED_STAGES, w["variant"], STAGES.index(w["stage"]))
        for s in _read_json(p).get("samples", []):
            gens[w["model"]][s["prompt"]][order] = (_stage_name(w["variant"], w["stage"]), s["completion"])
    generation_sections = [
        {"model": model, "prompts": [
            {"prompt": prompt, "stages": [{"label": lab, "text": txt} for _, (lab, txt) in sorted(by_stage.items())]}
            for prompt, by_stage in prompts.items()]}
        for model, prompts in gens.items()
    ]

    devices = {(k[2], r.get("device_name")) for k, r in res.mmlu.items()}
    devices |= {(d, r.get("device_name")) for (_, d), rows in res.throughput.items() for r in rows[:1]}
    result_versions = {tuple((k, r.get(k)) for k in ("lm_eval_version", "torch_version", "transformers_version"))
                       for r in res.mmlu.values()}
    bench = benchmark_rows(benchmarks_dir)
    variants_cfg = [
        {"name": v, "description": spec.get("description", ""), "stages": pipe.variant_stages(v),
         **{k: pipe.hybrid(v).get(k) for k in ("layers", "window", "formulation", "feature_map", "backend")},
         "transfer": spec.get("transfer") or {}, "lora": spec.get("lora") or {}}
        for v, spec in pipe.variants.items()
    ]
    return {
        "title": "hybrid-llama results",
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "models": list(pipe.models),
        "glance": glance,
        "recommended": recommended_blocks(pipe, res),
        "heldout_books": ", ".join(config.get("data", {}).get("books", {}).get("heldout", [])),
        "missing": missing,
        "sections": sections,
        "config_yaml": yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100),
        "variants": variants_cfg,
        "mmlu": mmlu_table,
        "mmlu_plots": [{"name": f"{k[1]} {k[4]}", "src": v} for k, v in sorted(plots_by_name.items())
                       if k[0] == "plot_mmlu"],
        "chance": CHANCE,
        "transfer": transfer_sections,
        "lora": lora_sections,
        "exports": export_rows,
        "generations": generation_sections,
        "git": git_info(repo_dir),
        "packages": package_versions(),
        "result_versions": [dict(v) for v in sorted(result_versions, key=repr)],
        "devices": sorted(devices, key=repr),
        "manifests": [manifest_summary(p) for p in _existing(manifests, missing)],
        "benchmarks": [{**b, "s": _fmt(b["s"], ".1f"), "max_rss_mb": _fmt(b["max_rss_mb"], ".0f")} for b in bench],
        "total_wall_s": _fmt(sum(b["s"] for b in bench if not math.isnan(b["s"])), ".0f"),
    }


def render(context: dict) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["json"] = lambda x: json.dumps(x, default=str)  # autoescape escapes it once
    env.filters["nice"] = _nice
    return env.get_template("report.html.j2").render(**context)


def passkey_text(p: dict) -> str:
    """'75% (12/16, 51–90%)': accuracy, trials and the 95 % Wilson interval."""
    return f"{p['accuracy']:.0%} ({p['found']}/{p['trials']}, {p['ci_low']:.0%}–{p['ci_high']:.0%})"


def write_report(out_path: str | Path, **inputs: Any) -> Path:
    """Render the report from the workflow's result files (see build_context) to out_path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(out_path, render(build_context(report_dir=out_path.parent, **inputs)))
