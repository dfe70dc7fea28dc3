"""The report's tables behind the figures: MMLU (per result and per subject), throughput and memory,
quality (NLL with the paired difference to base, passkey, the component diagnostic)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from hybrid_llama.eval.tables import BEYOND_WINDOW
from hybrid_llama.names import SHARED_STAGES, STAGES
from hybrid_llama.report.formatting import byte_size, plus_minus
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


def fixed(x: Any, spec: str = ".3f") -> str:
    v = num(x)
    return "–" if math.isnan(v) else format(v, spec)


def pct(x: Any, se: Any = None) -> str:
    v = num(x)
    if math.isnan(v):
        return "–"
    s = f"{100 * v:.1f}"
    return s + (f" ± {100 * num(se):.1f}" if se is not None and not math.isnan(num(se)) else "")


def stage_name(slot: str, stage: str) -> str:
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
            "stage": stage_name(slot, stage),
            "shared": slot in SHARED_STAGES, "fmt": fmt, "shots": shots, "metric": metric, "n": agg.get("n"),
            "weighted": pct(agg.get(f"{metric}_weighted"), agg.get(f"{metric}_weighted_stderr")),
            "mean": pct(agg.get(f"{metric}_mean"), agg.get(f"{metric}_mean_stderr")),
            "wall_time_s": fixed(r.get("wall_time_s"), ".0f"), "vs_base": "", "significant": "", "vs_control": "",
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
            pct((results[c].get("per_subject", {}).get(s) or {}).get(metric)) for c in cols]} for s in subjects]
        tables.append({"model": model, "device": device, "fmt": fmt, "shots": shots, "metric": metric,
                       "columns": [stage_name(*c) for c in cols], "rows": rows})
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


def kind_tables(res: Results, kind: str, model: str, device: str) -> dict[str, list[dict]]:
    """{variant: rows} of one result kind (perplexity, passkey, books, ...) for one (model, device)."""
    return {v: rows for (m, v, d), rows in sorted(getattr(res, kind).items()) if m == model and d == device}


def nll_table(res: Results, kind: str, model: str, device: str) -> tuple[list, list[dict]]:
    """A corpus's NLL by context length (``perplexity`` or ``books``): the stages (``stage_rows``) and one
    row per length whose cells give each stage's NLL and its paired difference to base."""
    stages = stage_rows(kind_tables(res, kind, model, device))
    base = next((rows for _, s, rows in stages if s == "base"), [])
    table = []
    for L in res.context_lens(kind, model, device):
        cells = []
        for _, stage, rows in stages:
            r = next((r for r in rows if int(r["context_len"]) == L), None)
            d = nll_delta(rows, base, L) if stage != "base" else None
            delta = f" ({plus_minus(d['diff'], d['stderr'])})" if d else ""
            cells.append("" if r is None else f"{r['nll']:.3f}{delta}")
        table.append({"context_len": L, "cells": cells})
    return stages, table


def quality_tables(res: Results, model: str, device: str) -> dict:
    """The tables behind the quality figures of one (model, device): NLL with the paired difference
    to base, passkey accuracy, and the component diagnostic."""
    ppl, nll = nll_table(res, "perplexity", model, device)

    pk = stage_rows(kind_tables(res, "passkey", model, device))
    passkey = []
    for L in res.context_lens("passkey", model, device):
        cells = []
        for _, _, rows in pk:
            p, far = passkey_at(rows, L), passkey_at(rows, L, beyond=BEYOND_WINDOW)
            text = "" if p is None else passkey_text(p)
            cells.append(text + ("" if far is None else f"; beyond the window: {passkey_text(far)}"))
        passkey.append({"context_len": L, "cells": cells})

    comp = stage_rows(kind_tables(res, "components", model, device))
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
        return pct(None)
    cache = row.get("cache_share")
    if cache:  # absent in older files, 0 for layers without the cache
        return f"{pct(row['window_share'])} / {pct(cache)}"
    return pct(row["window_share"])


def passkey_text(p: dict) -> str:
    """'75% (12/16, 51–90%)': accuracy, trials and the 95 % Wilson interval."""
    return f"{p['accuracy']:.0%} ({p['found']}/{p['trials']}, {p['ci_low']:.0%}–{p['ci_high']:.0%})"
