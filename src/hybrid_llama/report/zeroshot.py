"""The zero-shot suite in the report: each stage against base on the same examples, the six-task
average as a percentage of base's (as the linearization papers report it), and the table per task.

Every comparison is paired: both stages scored the same examples (``eval.zeroshot.sample_doc_ids``).
A task's difference is the mean per-example difference (``eval.tables.paired_scores``) with its
paired stderr, its paired-bootstrap 95 % interval, and McNemar's exact test on the examples exactly
one of the two got right; the task's verdict is McNemar's (significant at p < 0.05). The six-task
average is the plain mean of the tasks' scores (LoLCATs' metric per task), so its difference is the
mean of the tasks' differences; its stderr is sqrt(sum of the tasks' squared paired stderrs) / 6
(the tasks are independent samples) and its interval a stratified paired bootstrap (examples
resampled within each task), significant when the interval excludes 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from hybrid_llama.eval.paired_stats import bootstrap_mean_ci
from hybrid_llama.eval.tables import paired_scores
from hybrid_llama.eval.zeroshot import LOLCATS_METRICS, METRICS, SUITE, beyond_window
from hybrid_llama.names import SHARED_STAGES, STAGES
from hybrid_llama.pipeline import parse_result_path
from hybrid_llama.report.formatting import plus_minus

TASK_LABELS = {"piqa": "PIQA", "arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge", "hellaswag": "HellaSwag",
               "winogrande": "WinoGrande", "lambada_openai": "LAMBADA (OpenAI)", "mmlu": "MMLU 5-shot"}

Key = tuple[str, str, str, str]  # model, slot, device, stage


def load(files: Iterable[str | Path], missing: list[str] | None = None) -> dict[Key, dict]:
    """{(model, slot, device, stage): result} of the zero-shot files that exist (the others go to
    ``missing``)."""
    out = {}
    for file in map(Path, files):
        w = parse_result_path(file, ["zeroshot"])[1]
        if not file.is_file():
            if missing is not None:
                missing.append(file.as_posix())
            continue
        out[w["model"], w["variant"], w["device"], w["stage"]] = json.loads(file.read_text())
    return out


def scores(result: dict, task: str, metric: str) -> dict[tuple, float]:
    """{(subtask, doc_id): score} of one task's examples: 0/1 for accuracies, the target's
    loglikelihood for 'perplexity'."""
    field = "loglikelihood" if metric == "perplexity" else metric
    return {(e["subtask"], e["doc_id"]): float(e[field]) for e in result["examples"]
            if e["task"] == task and field in e}


def compare(result: dict, base: dict) -> dict:
    """Per task and metric the paired difference to base; the six-task average of both, its paired
    difference and stderr, and the stage's average as a percentage of base's."""
    tasks: dict[str, dict] = {}
    diffs: dict[tuple[str, str], list[float]] = {}  # per-example differences, for the suite's bootstrap
    for task in SUITE:
        for metric in METRICS[task]:
            if metric == "perplexity":
                continue
            a, b = scores(result, task, metric), scores(base, task, metric)
            if set(a) & set(b):
                diffs[task, metric] = [a[k] - b[k] for k in sorted(set(a) & set(b), key=repr)]
                d = paired_scores(a, b)
                if d["p_mcnemar"] is not None:
                    d["significant"] = d["p_mcnemar"] < 0.05
                tasks.setdefault(task, {})[metric] = d
    six = [tasks.get(t, {}).get(m) for t, m in LOLCATS_METRICS.items()]
    if any(d is None for d in six):
        return {"tasks": tasks, "suite": None}
    k = len(six)
    avg_a, avg_b = sum(d["acc_a"] for d in six) / k, sum(d["acc_b"] for d in six) / k
    se = math.sqrt(sum(d["stderr_paired"] ** 2 for d in six)) / k
    diff = avg_a - avg_b
    lo, hi = bootstrap_mean_ci([diffs[t, m] for t, m in LOLCATS_METRICS.items()])
    suite = {"avg": avg_a, "avg_base": avg_b, "diff": diff, "stderr": se, "n_tasks": k, "ci95": (lo, hi),
             "pct_of_base": 100 * avg_a / avg_b if avg_b else math.nan,
             "pct_stderr": 100 * se / avg_b if avg_b else math.nan,
             "significant": bool(lo > 0 or hi < 0)}
    return {"tasks": tasks, "suite": suite}


def suite_average(result: dict) -> float:
    """Base's six-task average: the mean of lm-eval's scores of the LoLCATs metrics."""
    return sum(result["results"][t][m] for t, m in LOLCATS_METRICS.items()) / len(LOLCATS_METRICS)


def _order(key: Key) -> tuple:
    model, slot, device, stage = key
    return model, device, slot not in SHARED_STAGES, slot, STAGES.index(stage)


def _pct(x: float, se: float | None = None) -> str:
    return f"{100 * x:.1f}" + ("" if se is None or math.isnan(se) else f" ± {100 * se:.1f}")


def tables(results: dict[Key, dict], windows: dict[str, int], default_window: int) -> list[dict]:
    """One table per (model, device): rows = task x metric (then the six-task average), columns =
    base and each measured stage. Base cells give lm-eval's accuracy ± stderr; the others the
    accuracy and the paired difference to base in points, marked "within noise" unless McNemar's
    test (accuracies) or |Δ| > 2 paired stderr (other scores) says otherwise. The last column is the
    share of the task's tokens beyond the softmax window."""
    groups: dict[tuple[str, str], dict[Key, dict]] = {}
    for key in sorted(results, key=_order):
        groups.setdefault((key[0], key[2]), {})[key] = results[key]
    out = []
    for (model, device), group in groups.items():
        base = group.get((model, "base", device, "base"))
        cols = list(group)
        deltas = {k: compare(r, base) if base is not None and k[1] != "base" else None for k, r in group.items()}
        window = windows.get(next((k[1] for k in cols if k[1] not in SHARED_STAGES), ""), default_window)
        any_result = next(iter(group.values()))
        rows = []
        for task in SUITE:
            if task not in any_result["results"]:
                continue
            examples = [e for e in any_result["examples"] if e["task"] == task]
            share = beyond_window(examples, window)
            for metric in METRICS[task]:
                cells = [_cell(group[k], deltas[k], task, metric) for k in cols]
                rows.append({"task": TASK_LABELS[task], "metric": metric, "n": group[cols[0]]["results"][task]["n"],
                             "suite": LOLCATS_METRICS.get(task) == metric, "cells": cells,
                             "beyond": f"{100 * share['token_share']:.0f} % of tokens, "
                                       f"{100 * share['example_share']:.0f} % of examples"})
        avg_cells = []
        for k in cols:
            d = deltas[k]
            if k[1] == "base":
                avg_cells.append({"text": _pct(suite_average(group[k])), "css": "", "title": "six-task average, %"})
            elif d is None or d["suite"] is None:
                avg_cells.append({"text": "–", "css": "", "title": "no base result on the same examples"})
            else:
                avg_cells.append(_suite_cell(d["suite"]))
        out.append({"model": model, "device": device, "window": window,
                    "columns": [k[1] if k[1] in SHARED_STAGES else f"{k[1]}: {k[3]}" for k in cols],
                    "rows": rows, "average": avg_cells,
                    "wall_s": [f"{group[k].get('wall_time_s', math.nan):.0f}" for k in cols]})
    return out


def _cell(result: dict, delta: dict | None, task: str, metric: str) -> dict:
    res = result["results"].get(task, {})
    if metric not in res:
        return {"text": "–", "css": "", "title": "not measured"}
    value, se = res[metric], res.get(f"{metric}_stderr", math.nan)
    if metric == "perplexity":
        return {"text": f"{value:.2f}", "css": "", "title": f"perplexity ± {se:.2f} (lm-eval)"}
    text = _pct(value, se)
    d = (delta or {}).get("tasks", {}).get(task, {}).get(metric)
    if d is None:
        return {"text": text, "css": "", "title": f"{metric} in %, ± lm-eval's stderr"}
    verdict = "significant" if d["significant"] else "within noise"
    css = ("better sig" if d["diff"] > 0 else "worse sig") if d["significant"] else ""
    test = "" if d["p_mcnemar"] is None else f", McNemar p = {d['p_mcnemar']:.2g}"
    return {"text": f"{text} (Δ {plus_minus(100 * d['diff'], 100 * d['stderr_paired'], 1)}, {verdict})", "css": css,
            "title": f"{d['n']} examples paired with base; {d['n_discordant']} scored differently; "
                     f"95 % paired-bootstrap interval of Δ {_interval(d['ci95'])} points{test}"}


def _interval(ci: tuple[float, float]) -> str:
    return f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def _suite_cell(s: dict) -> dict:
    verdict = "significant" if s["significant"] else "within noise"
    css = ("better sig" if s["diff"] > 0 else "worse sig") if s["significant"] else ""
    return {"text": f"{_pct(s['avg'])} = {s['pct_of_base']:.1f} % of base "
                    f"(Δ {plus_minus(100 * s['diff'], 100 * s['stderr'], 1)} points, 95 % {_interval(s['ci95'])}, "
                    f"{verdict})",
            "css": css, "title": f"six-task average {100 * s['avg']:.2f} vs base {100 * s['avg_base']:.2f}; "
                                 f"± the paired stderr of the average's difference; the interval is a paired "
                                 f"bootstrap stratified by task"}


def headline_cell(results: dict[Key, dict], model: str, device: str, slot: str, stage: str) -> dict | None:
    """The headline's zero-shot cell of one row (text, title, css, note, value), None when the row's
    stage was not measured: base shows its six-task average, a variant its average as % of base's."""
    own = results.get((model, slot, device, stage))
    base = results.get((model, "base", device, "base"))
    if own is None:
        return None
    if slot == "base":
        avg = suite_average(own)
        return {"text": f"{100 * avg:.1f} %", "title": "six-task average (LoLCATs' metrics), lm-eval", "css": "",
                "note": "", "value": avg}
    s = compare(own, base)["suite"] if base is not None else None
    if s is None:
        return {"text": "–", "title": "no base result on the same examples", "css": "", "note": "", "value": None}
    note = (f"Δ {plus_minus(100 * s['diff'], 100 * s['stderr'], 1)} pts, 95 % {_interval(s['ci95'])}"
            + ("" if s["significant"] else ", within noise"))
    css = ("better sig" if s["diff"] > 0 else "worse sig") if s["significant"] else ""
    return {"text": f"{s['pct_of_base']:.1f} % of base", "css": css, "note": note, "value": s["pct_of_base"],
            "title": f"six-task average {100 * s['avg']:.1f} % vs base {100 * s['avg_base']:.1f} %; ± paired stderr "
                     f"of the difference (same examples)"}
