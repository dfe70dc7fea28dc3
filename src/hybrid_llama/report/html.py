"""results/report.html: one self-contained page (images embedded as base64) built with jinja2.

`write_report` reads the workflow's result files, turns them into plain rows and renders
`templates/report.html.j2`. Everything shown comes from the files: MMLU (with paired significance
against the base model), throughput and memory with speedups, training metrics, perplexity and
passkey tables, greedy generations, the generated summary and provenance (git commit, package
versions, devices, data manifests, wall times from Snakemake's benchmark files).
"""

from __future__ import annotations

import base64
import csv
import json
import math
import platform
import subprocess
from collections import defaultdict
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import yaml

from hybrid_llama.eval.mmlu import CHANCE
from hybrid_llama.pipeline import STAGE_LABELS, STAGES, parse_result_path, path

STAGE_ORDER = list(STAGES)
PACKAGES = ["hybrid-llama", "torch", "transformers", "peft", "lm_eval", "triton", "snakemake",
            "safetensors", "tokenizers", "datasets", "numpy", "pandas", "matplotlib", "jinja2"]


# ------------------------------------------------------------------------------------ helpers


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def _read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _stage_key(stage: str) -> int:
    return STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)


def _fmt(x: Any, spec: str = ".3f") -> str:
    v = _num(x)
    return "–" if math.isnan(v) else format(v, spec)


def _pct(x: Any, se: Any = None) -> str:
    v = _num(x)
    if math.isnan(v):
        return "–"
    s = f"{100 * v:.1f}"
    return s + (f" ± {100 * _num(se):.1f}" if se is not None and not math.isnan(_num(se)) else "")


def _bytes(x: Any) -> str:
    v = _num(x)
    return "–" if math.isnan(v) else f"{v / 2**20:,.1f}"


def _nice(x: Any) -> str:
    """Floats with 4 significant digits; everything else as is."""
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def embed_image(path) -> str:
    """A data: URI of a PNG/SVG file, so the page needs no other file."""
    path = Path(path)
    mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode("ascii")


# ------------------------------------------------------------------------------------ MMLU


def _device(result: dict) -> str:
    """The requested device (config/wildcard, may carry a label), else the one the result records."""
    return (result.get("meta") or {}).get("device") or result.get("device")


def mmlu_metric(fmt: str) -> str:
    """The headline metric of a format: letters -> acc; answer texts -> acc_norm (lm-eval's usual)."""
    return "acc" if fmt == "mc" else "acc_norm"


def mmlu_rows(paths: Iterable) -> tuple[list[dict], list[dict]]:
    """(table rows, summary pairs). Every stage is compared with the base model on the same
    questions (same model, device, format, shots); transfer_lora also with the base_lora control."""
    from hybrid_llama.eval.quality import paired_difference

    results = [_read_json(p) for p in paths]
    index = {}
    for r in results:
        m = r.get("meta") or {}
        index[m.get("model"), _device(r), r.get("fmt"), r.get("shots"), m.get("stage"), m.get("variant")] = r

    def find(r: dict, stage: str) -> dict | None:
        m = r["meta"]
        return index.get((m.get("model"), _device(r), r.get("fmt"), r.get("shots"), stage, stage))

    rows, pairs = [], []
    for r in results:
        m, agg, fmt = r.get("meta") or {}, r["aggregate"], r.get("fmt", "mc")
        metric = mmlu_metric(fmt)
        row = {
            "model": m.get("model"),
            "device": _device(r),
            "device_name": r.get("device_name"),
            "variant": "—" if m.get("stage") in ("base", "base_lora") else m.get("variant"),
            "stage": m.get("stage"),
            "stage_label": STAGE_LABELS.get(m.get("stage"), m.get("stage")),
            "fmt": fmt,
            "shots": r.get("shots"),
            "metric": metric,
            "n": agg.get("n"),
            "n_subjects": agg.get("n_subjects"),
            "weighted": _pct(agg.get(f"{metric}_weighted"), agg.get(f"{metric}_weighted_stderr")),
            "mean": _pct(agg.get(f"{metric}_mean"), agg.get(f"{metric}_mean_stderr")),
            "acc": _pct(agg.get("acc_weighted"), agg.get("acc_weighted_stderr")),
            "wall_time_s": _fmt(r.get("wall_time_s"), ".0f"),
            "delta": "",
            "delta_se": "",
            "significant": "",
            "delta_control": "",
        }
        for other, key in (("base", "delta"), ("base_lora", "delta_control")):
            ref = find(r, other)
            if ref is None or ref is r or m.get("stage") in ("base", other):
                continue
            try:
                d = paired_difference(r, ref, metric=metric)
            except (ValueError, KeyError):
                continue
            verdict = "yes" if d["significant"] else "no"
            if key == "delta":
                row["delta"] = f"{100 * d['diff']:+.1f}"
                row["delta_se"] = f"{100 * d['stderr_paired']:.1f}"
                row["significant"] = verdict
            else:
                row["delta_control"] = f"{100 * d['diff']:+.1f} ± {100 * d['stderr_paired']:.1f} ({verdict})"
            if m.get("stage") == "transfer_lora":
                label = f"{m.get('model')}/{m.get('variant')} transfer+LoRA vs {other}, {r.get('shots')}-shot {fmt} ({metric}), {_device(r)}"
                pairs.append({"label": label, **d})
        rows.append(row)
    rows.sort(key=lambda x: (x["model"] or "", x["device"] or "", x["fmt"], x["shots"] or 0,
                             x["variant"] != "—", x["variant"] or "", _stage_key(x["stage"])))
    return rows, pairs


# ------------------------------------------------------------------------------------ throughput


def throughput_tables(path) -> dict:
    """Per phase: rows by seq_len with tokens/s and speedup vs base for each variant; memory rows."""
    rows = _read_csv(path)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    device_name = next((r.get("device_name") for r in rows if r.get("device_name")), "")
    by = {(r["variant"], r["phase"], int(r["seq_len"])): r for r in rows}
    phases = {}
    for phase in ("prefill", "decode"):
        lens = sorted({int(r["seq_len"]) for r in rows if r["phase"] == phase})
        table = []
        for L in lens:
            base = by.get(("base", phase, L))
            cells = []
            for v in variants:
                r = by.get((v, phase, L))
                if r is None:
                    cells.append("")
                    continue
                if r.get("status", "ok") != "ok":
                    cells.append(r.get("status", ""))
                    continue
                tps = _num(r["tokens_per_s"])
                cell = f"{tps:,.1f}"
                if base is not None and v != "base" and base.get("status", "ok") == "ok":
                    cell += f" ({tps / _num(base['tokens_per_s']):.2f}×)"
                cells.append(cell)
            table.append({"seq_len": L, "cells": cells})
        phases[phase] = table
    memory = []
    for L in sorted({int(r["seq_len"]) for r in rows}):
        cells = []
        for v in variants:
            r = by.get((v, "decode", L)) or by.get((v, "prefill", L))
            if r is None or r.get("status", "ok") != "ok":
                cells.append("" if r is None else r.get("status", ""))
            else:
                cells.append(f"{_bytes(r.get('peak_mem_bytes'))} / {_bytes(r.get('cache_bytes'))}")
        memory.append({"seq_len": L, "cells": cells})
    return {"variants": variants, "device_name": device_name, "phases": phases, "memory": memory}


# ------------------------------------------------------------------------------------ quality


def quality_tables(perplexity_csv, passkey_csv) -> dict:
    ppl = _read_csv(perplexity_csv) if perplexity_csv else []
    pk = _read_csv(passkey_csv) if passkey_csv else []
    stages = sorted({r["stage"] for r in ppl + pk}, key=_stage_key)
    nll = {(r["stage"], int(r["context_len"])): r for r in ppl}
    ppl_rows = []
    for L in sorted({int(r["context_len"]) for r in ppl}):
        cells = []
        for s in stages:
            r = nll.get((s, L))
            cells.append(f"{_fmt(r['nll'])} ({_fmt(r['ppl'], '.2f')})" if r else "")
        ppl_rows.append({"context_len": L, "cells": cells})
    acc = defaultdict(list)
    for r in pk:
        acc[r["stage"], int(r["context_len"])].append((_num(r["depth"]), _num(r["accuracy"]), int(_num(r["n"]))))
    pk_rows = []
    for L in sorted({int(r["context_len"]) for r in pk}):
        cells = []
        for s in stages:
            cell = sorted(acc.get((s, L), []))
            if not cell:
                cells.append("")
                continue
            mean = sum(a for _, a, _ in cell) / len(cell)
            detail = " / ".join(f"{a:.2f}" for _, a, _ in cell)
            cells.append(f"{mean:.2f} [{detail}]")
        pk_rows.append({"context_len": L, "cells": cells})
    depths = sorted({_num(r["depth"]) for r in pk})
    return {
        "stages": [STAGE_LABELS.get(s, s) for s in stages],
        "perplexity": ppl_rows,
        "passkey": pk_rows,
        "depths": ", ".join(f"{d:g}" for d in depths),
        "ppl_rows_raw": [{**r} for r in ppl],
        "pk_rows_raw": [{**r} for r in pk],
    }


# ------------------------------------------------------------------------------------ provenance


def git_info(repo: str | Path) -> dict:
    def run(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
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
        data = _read_csv_tsv(path)
        if not data:
            continue
        rows.append({
            "job": str(path.relative_to(directory).with_suffix("")),
            "s": _num(data[-1].get("s")),
            "max_rss_mb": _num(data[-1].get("max_rss")),
        })
    return rows


def _read_csv_tsv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def manifest_summary(path) -> dict:
    """A manifest without its long per-document hash list (the count stays)."""
    data = _read_json(path)
    out = {}
    for key, value in data.items():
        if key == "doc_hashes":
            out["doc_hashes"] = f"{len(value)} document sha256 hashes"
        else:
            out[key] = value
    return {"path": str(path), "items": out}


# ------------------------------------------------------------------------------------ report


def _parse_plot(path: Path) -> dict:
    return {"name": path.stem, "src": embed_image(path)}


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
    benchmarks_dir: str | Path = "logs/benchmarks",
    repo_dir: str | Path = ".",
) -> dict:
    """Everything the template shows, as plain strings/lists (no file access in the template)."""
    from hybrid_llama.report.summary import summarize

    mmlu_table, pairs = mmlu_rows(mmlu)
    plots_by_path = {Path(p).as_posix(): _parse_plot(Path(p)) for p in plots}

    def plot(name: str, **wildcards) -> dict | None:
        """The embedded plot of artifact ``name`` (a PATHS key), if it was an input."""
        want = path(name, **wildcards)
        return next((v for k, v in plots_by_path.items() if k == want or k.endswith("/" + want)), None)

    qual = defaultdict(dict)
    for p in quality:
        w = parse_result_path(p, ["quality"])[1]
        qual[w["model"], w["variant"], w["device"]][w["kind"]] = Path(p)
    quality_sections, summary = [], []
    for (model, variant, device), files in sorted(qual.items()):
        tables = quality_tables(files.get("perplexity"), files.get("passkey"))
        sentences = summarize(tables["ppl_rows_raw"], tables["pk_rows_raw"], None)
        summary += [f"{model}/{variant} on {device}: {s}" for s in sentences]
        quality_sections.append({
            "model": model, "variant": variant, "device": device, **tables,
            "nll_plot": plot("plot_nll", model=model, variant=variant, device=device),
            "passkey_plot": plot("plot_passkey", model=model, variant=variant, device=device),
        })
    summary += summarize(None, None, pairs)

    throughput_sections = []
    for p in throughput:
        w = parse_result_path(p, ["throughput"])[1]
        model, device = w["model"], w["device"]
        throughput_sections.append({
            "model": model, "device": device, **throughput_tables(p),
            "plot": plot("plot_throughput", model=model, device=device),
            "memory_plot": plot("plot_memory", model=model, device=device),
        })

    transfer_sections = []
    for p in transfer_metrics:
        w = parse_result_path(p, ["transfer_metrics"])[1]
        model, variant = w["model"], w["variant"]
        m = _read_json(p)
        before, after = m.get("mse_before") or {}, m.get("mse_after") or {}
        layers = sorted(set(before) | set(after), key=lambda x: int(x) if str(x).isdigit() else 0)
        transfer_sections.append({
            "model": model, "variant": variant,
            "layers": [{"layer": k, "before": _fmt(before.get(k), ".4g"), "after": _fmt(after.get(k), ".4g"),
                        "ratio": _fmt(_num(after.get(k)) / _num(before.get(k)), ".3f")} for k in layers],
            "facts": {k: m.get(k) for k in ("steps", "train_tokens", "tokens_per_s", "wall_time_s",
                                            "trainable", "num_trainable_params") if k in m},
            "plot": plot("plot_transfer_loss", model=model, variant=variant),
        })

    lora_sections = []
    for p in lora_metrics:
        w = parse_result_path(p, ["lora_metrics"])[1]
        model, slot = w["model"], w["variant"]
        m = _read_json(p)
        lora_sections.append({
            "model": model, "variant": slot,
            "facts": {k: m.get(k) for k in ("val_loss_before", "val_loss_after", "train_loss_final", "steps",
                                            "tokens_per_s", "wall_time_s") if k in m},
            "plot": plot("plot_lora_loss", model=model, variant=slot),
        })

    gens = defaultdict(lambda: defaultdict(dict))
    for p in generations:
        g = _read_json(p)
        label = STAGE_LABELS.get(g.get("stage"), g.get("stage"))
        if g.get("stage") in ("transfer", "transfer_lora"):
            label += f" [{g.get('variant')}]"
        for s in g.get("samples", []):
            gens[g.get("model")][s["prompt"]][(_stage_key(g.get("stage")), label)] = s["completion"]
    generation_sections = [
        {"model": model, "prompts": [
            {"prompt": prompt, "stages": [{"label": lab, "text": txt} for (_, lab), txt in sorted(by_stage.items())]}
            for prompt, by_stage in prompts.items()]}
        for model, prompts in gens.items()
    ]

    devices = set()
    for p in mmlu:
        r = _read_json(p)
        devices.add((_device(r), r.get("device_name")))
    for t in throughput_sections:
        devices.add((t["device"], t["device_name"]))
    result_versions = set()
    for p in mmlu:
        r = _read_json(p)
        result_versions.add(tuple((k, r.get(k)) for k in ("lm_eval_version", "torch_version", "transformers_version")))

    bench = benchmark_rows(benchmarks_dir)
    variants_cfg = [
        {"name": v["name"], "description": v.get("description", ""),
         **{k: v["hybrid"].get(k) for k in ("layers", "window", "formulation", "feature_map", "backend")},
         "transfer": v.get("transfer") or {}, "lora": v.get("lora") or {}}
        for v in config.get("variants", [])
    ]
    return {
        "title": "hybrid-llama results",
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "models": [m.get("name") for m in config.get("models", [])],
        "summary": summary,
        "config_yaml": yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100),
        "variants": variants_cfg,
        "mmlu": mmlu_table,
        "mmlu_plots": [v for k, v in sorted(plots_by_path.items()) if parse_result_path(k)[0] == "plot_mmlu"],
        "chance": CHANCE,
        "throughput": throughput_sections,
        "transfer": transfer_sections,
        "lora": lora_sections,
        "quality": quality_sections,
        "generations": generation_sections,
        "git": git_info(repo_dir),
        "packages": package_versions(),
        "result_versions": [dict(v) for v in sorted(result_versions, key=repr)],
        "devices": sorted(devices, key=repr),
        "manifests": [manifest_summary(p) for p in manifests],
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


def write_report(out_path: str | Path, **inputs: Any) -> Path:
    """Render the report from the workflow's result files (see build_context) to out_path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(render(build_context(**inputs)), encoding="utf-8")
    tmp.replace(out_path)
    return out_path
