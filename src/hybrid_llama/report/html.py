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
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from hybrid_llama.eval.mmlu import CHANCE
from hybrid_llama.files import atomic_write
from hybrid_llama.names import SHARED_STAGES, STAGE_LABELS, STAGES
from hybrid_llama.pipeline import Pipeline, parse_result_path
from hybrid_llama.report.headline import anchor, headlines
from hybrid_llama.report.long_context import book_tables, niah_tables, recommended_blocks
from hybrid_llama.report.provenance import benchmark_rows, git_info, manifest_summary, package_versions
from hybrid_llama.report.results import (
    Results,
    num,
)
from hybrid_llama.report.summary import summarize
from hybrid_llama.report.tables import (
    fixed,
    mmlu_rows,
    mmlu_subject_tables,
    quality_tables,
    stage_name,
    throughput_tables,
)
from hybrid_llama.report.zeroshot import load as load_zeroshot
from hybrid_llama.report.zeroshot import tables as zeroshot_tables

# ------------------------------------------------------------------------------------ helpers


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def _nice(x: Any) -> str:
    """Floats with 4 significant digits; everything else as is."""
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def embed_image(path) -> str:
    """A data: URI of a PNG/SVG file, so the page needs no other file."""
    path = Path(path)
    mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


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


def _stages_label(pipe: Pipeline, variant: str) -> list[str]:
    """The stages the report lists for a variant; one with none trains only as others' parent."""
    return pipe.variant_stages(variant) or [f"none (trained as the parent of {', '.join(pipe.derived_from(variant))})"]


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
    zeroshot: list = (),
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

    zs = load_zeroshot(zeroshot, missing)
    windows = {v: pipe.hybrid(v)["window"] for v in pipe.variants}
    heads = headlines(pipe, res, zs if zeroshot else None)
    glance = []
    for h in heads:
        glance.append({
            "id": h.id, "model": h.model, "device": h.device, "device_name": h.device_name, "lengths": h.lengths,
            "window": h.window, "mmlu_headers": h.mmlu_headers, "zeroshot": h.zeroshot,
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
            "layers": [{"layer": k, "before": fixed(before.get(k), ".4g"), "after": fixed(after.get(k), ".4g"),
                        "ratio": fixed(num(after.get(k)) / num(before.get(k)), ".3f")} for k in layers],
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
            gens[w["model"]][s["prompt"]][order] = (stage_name(w["variant"], w["stage"]), s["completion"])
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
        {"name": v, "description": spec.get("description", ""), "stages": _stages_label(pipe, v),
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
        # the section and its link: where the config runs MMLU jobs (mmlu.shots) or results were given
        "has_mmlu": bool(mmlu_table) or bool(config.get("mmlu", {}).get("shots")),
        "zeroshot": [{**t, "id": anchor("zeroshot", t["model"], t["device"])}
                     for t in zeroshot_tables(zs, windows, windows[next(iter(windows))])],
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
        "benchmarks": [{**b, "s": fixed(b["s"], ".1f"), "max_rss_mb": fixed(b["max_rss_mb"], ".0f")} for b in bench],
        "total_wall_s": fixed(sum(b["s"] for b in bench if not math.isnan(b["s"])), ".0f"),
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


def write_report(out_path: str | Path, **inputs: Any) -> Path:
    """Render the report from the workflow's result files (see build_context) to out_path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(out_path, render(build_context(report_dir=out_path.parent, **inputs)))
