"""The evaluations' result tables and the statistics read off them, shared by every eval and the report.

- CSV: ``write_rows`` / ``read_rows`` and, per kind of quality table, its columns, writer and reader
  (``perplexity.csv``, ``passkey.csv``, ``components.csv``, ``books.csv``, ``niah.csv``).
- Paired statistics: ``paired_difference`` (MMLU accuracy of two results over the same questions; its
  arithmetic is ``paired_scores``, for any two {item: score} maps, as the zero-shot suite's) and
  ``paired_nll_difference`` (NLL of two stages over the same windows). Two models scored on the same
  items make correlated errors, so the paired standard error is the honest (and usually smaller) one.

No torch here: the report reads these tables without it.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hybrid_llama.eval.paired_stats import bootstrap_mean_ci, mcnemar_exact
from hybrid_llama.files import atomic_path

PERPLEXITY_COLUMNS = ("stage", "context_len", "nll", "ppl", "n_tokens", "window_nlls")
# One row per trial: accuracy is 0/1 and n is 1, so older aggregate rows read the same way.
PASSKEY_COLUMNS = ("stage", "context_len", "trial", "depth", "key", "needle_distance", "method", "accuracy", "n",
                   "needle_in_cache", "needle_in_cache_layers")
BEYOND_WINDOW = 128  # needles further than this before the question are outside any window + pending block
COMPONENT_COLUMNS = ("stage", "layer", "context_len", "window_share", "linear_share", "n_queries", "cache_share")
# Multi-key needle in a haystack (eval/niah.py): one row per trial, scored by generation.
NIAH_COLUMNS = ("stage", "haystack", "context_len", "trial", "n_keys", "depth", "key", "value", "needle_distance",
                "answer", "answered_key", "answered_distance", "accuracy", "n")


# --------------------------------------------------------------------------- CSV


def write_rows(rows: Iterable[dict], path: str | Path, columns: Sequence[str]) -> Path:
    """A CSV of ``rows`` with exactly ``columns`` (extra keys are dropped), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for row in rows:
            # lists (a perplexity row's per-window NLLs) become one space-separated cell
            w.writerow(
                {c: " ".join(f"{x:.6g}" for x in row[c]) if isinstance(row[c], list) else row[c] for c in columns}
            )
    return path


def read_rows(path: str | Path, types: dict[str, Callable[[str], Any]], *, delimiter: str = ",") -> list[dict]:
    """The rows of a CSV (or, with ``delimiter="\\t"``, TSV), each column converted by ``types`` (default str)."""
    with Path(path).open(newline="", encoding="utf-8") as f:
        return [{k: types.get(k, str)(v) for k, v in row.items()} for row in csv.DictReader(f, delimiter=delimiter)]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split()]


def write_perplexity_csv(rows: Iterable[dict], path: str | Path) -> Path:
    """perplexity.csv: stage,context_len,nll,ppl,n_tokens,window_nlls"""
    return write_rows(rows, path, PERPLEXITY_COLUMNS)


def read_perplexity_csv(path: str | Path) -> list[dict]:
    return read_rows(path, {"context_len": int, "nll": float, "ppl": float, "n_tokens": int, "window_nlls": _floats})


def write_passkey_csv(rows: Iterable[dict], path: str | Path) -> Path:
    """passkey.csv: one row per trial (``PASSKEY_COLUMNS``); accuracy is 0 or 1 and n is 1."""
    return write_rows(rows, path, PASSKEY_COLUMNS)


def read_passkey_csv(path: str | Path) -> list[dict]:
    return read_rows(path, {"context_len": int, "depth": float, "accuracy": float, "n": int, "trial": int,
                            "needle_distance": int, "needle_in_cache": _float_or_none})


def _float_or_none(text: str) -> float | None:
    return float(text) if text not in ("", None) else None


def _int_or_none(text: str) -> int | None:
    return int(text) if text not in ("", None) else None


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for z = 1.96); (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def passkey_summary(rows: list[dict], context_len: int, *, beyond: int | None = None,
                    method: str = "teacher_forced") -> dict | None:
    """Accuracy of the trials at ``context_len`` scored by ``method`` (older files without a method
    column count as teacher-forced), only needles more than ``beyond`` tokens before the question
    when given: {accuracy, found, trials, ci_low, ci_high}; None without trials."""
    cells = [r for r in rows if int(r["context_len"]) == context_len and r.get("method", method) in (method, "")
             and (beyond is None or (r.get("needle_distance") is not None and int(r["needle_distance"]) > beyond))]
    trials = sum(int(r["n"]) for r in cells)
    if not trials:
        return None
    found = sum(round(float(r["accuracy"]) * int(r["n"])) for r in cells)
    lo, hi = wilson_interval(found, trials)
    return {"accuracy": found / trials, "found": found, "trials": trials, "ci_low": lo, "ci_high": hi}


def write_components_csv(rows: Iterable[dict], path: str | Path) -> Path:
    """components.csv: stage,layer,context_len,window_share,linear_share,n_queries,cache_share"""
    return write_rows(rows, path, COMPONENT_COLUMNS)


def read_components_csv(path: str | Path) -> list[dict]:
    return read_rows(path, {"layer": int, "context_len": int, "window_share": float, "linear_share": float,
                            "n_queries": int, "cache_share": float})


def write_niah_csv(rows: Iterable[dict], path: str | Path) -> Path:
    """niah.csv: one row per trial and haystack (``NIAH_COLUMNS``); accuracy is 0 or 1."""
    return write_rows(rows, path, NIAH_COLUMNS)


def read_niah_csv(path: str | Path) -> list[dict]:
    return read_rows(path, {"context_len": int, "trial": int, "n_keys": int, "depth": float,
                            "needle_distance": int, "answered_distance": _int_or_none, "accuracy": float, "n": int})


def niah_summary(rows: list[dict], context_len: int, *, haystack: str | None = None,
                 beyond: int | None = None) -> dict | None:
    """``passkey_summary`` of the multi-key needle trials at ``context_len`` (of one ``haystack``
    when given, else all); None without trials."""
    cells = [r for r in rows if haystack is None or r.get("haystack") == haystack]
    return passkey_summary(cells, context_len, beyond=beyond)


def niah_misses(rows: list[dict], context_len: int, *, haystack: str | None = None) -> dict | None:
    """What the missed multi-key needle trials at ``context_len`` answered: {misses, other_needle (the
    value of another needle), nearer (of those, a needle nearer the question than the one asked)};
    None without misses, or for files written before ``answered_distance`` was recorded."""
    cells = [r for r in rows if int(r["context_len"]) == context_len and float(r["accuracy"]) < 1
             and (haystack is None or r.get("haystack") == haystack)]
    if not cells or any("answered_distance" not in r for r in cells):
        return None
    other = [r for r in cells if r["answered_key"] and r["answered_distance"] is not None]
    nearer = [r for r in other if int(r["answered_distance"]) < int(r["needle_distance"])]
    return {"misses": len(cells), "other_needle": len(other), "nearer": len(nearer)}


# the quality tables by kind (the workflow's {kind} wildcard); "books" is NLL vs context on the
# held-out books, in the perplexity table's format
QUALITY_WRITERS = {"perplexity": write_perplexity_csv, "passkey": write_passkey_csv,
                   "components": write_components_csv, "books": write_perplexity_csv, "niah": write_niah_csv}
QUALITY_READERS = {"perplexity": read_perplexity_csv, "passkey": read_passkey_csv,
                   "components": read_components_csv, "books": read_perplexity_csv, "niah": read_niah_csv}


# --------------------------------------------------------------------------- paired statistics


def mean_sd(xs: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN for a single value)."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else float("nan")
    return mean, math.sqrt(var)


def _per_question(result: dict, metric: str) -> dict[tuple[str, Any], float]:
    """{(subject, doc_id): 0/1} from an eval/mmlu.py result JSON (its `questions` list).

    acc: pred == gold; acc_norm (cloze): pred_norm == gold.
    """
    if "questions" not in result:
        raise KeyError("MMLU result has no per-question 'questions' list (eval/mmlu.py schema hybrid_llama.mmlu/1)")
    field = {"acc": "pred", "acc_norm": "pred_norm"}.get(metric)
    if field is None:
        raise ValueError(f"metric must be 'acc' or 'acc_norm', got {metric!r}")
    out = {}
    for q in result["questions"]:
        if field not in q:
            raise KeyError(f"question {q.get('subject')}/{q.get('doc_id')} has no {field!r} (fmt {result.get('fmt')})")
        out[(q["subject"], q["doc_id"])] = float(q[field] == q["gold"])
    return out


def paired_difference(result_a: dict, result_b: dict, *, metric: str = "acc") -> dict:
    """Accuracy of a minus b over the questions both answered, with paired significance.

    stderr_a, stderr_b: sample sd of the per-question 0/1 scores / sqrt(n) (lm-eval's stderr).
    stderr_paired: sd of the per-question differences / sqrt(n). This is the "combined stderr" of
    the rule: the two models answer the same questions, so their errors are correlated and the
    paired stderr is the right (usually smaller) one; stderr_unpaired = sqrt(se_a^2 + se_b^2) is
    given for reference only. significant = |diff| > 2 * stderr_paired.
    """
    a, b = _per_question(result_a, metric), _per_question(result_b, metric)
    settings = {k: (result_a.get(k), result_b.get(k)) for k in ("fmt", "shots") if result_a.get(k) != result_b.get(k)}
    if settings:
        raise ValueError(f"results differ in {settings}: not the same questions/prompts")
    if not set(a) & set(b):
        raise ValueError("the two results share no questions")
    stats = paired_scores(a, b)
    return {"metric": metric, **stats, "fmt": result_a.get("fmt"), "shots": result_a.get("shots")}


def paired_scores(a: dict[Any, float], b: dict[Any, float]) -> dict:
    """Mean score of a minus b over the keys (items) both scored, with the paired statistics of
    ``paired_difference`` (n, acc_a, acc_b, diff, stderr_a/b/paired/unpaired, n_discordant,
    significant: |diff| > 2 paired stderr), the paired bootstrap's 95 % interval of diff (``ci95``)
    and, for right/wrong scores, McNemar's exact p-value (``p_mcnemar``, else None); raises
    ValueError when they share no item."""
    common = sorted(set(a) & set(b), key=repr)
    if not common:
        raise ValueError("the two results share no items")
    xa = [a[k] for k in common]
    xb = [b[k] for k in common]
    d = [x - y for x, y in zip(xa, xb)]
    n = len(common)
    acc_a, sd_a = mean_sd(xa)
    acc_b, sd_b = mean_sd(xb)
    diff, sd_d = mean_sd(d)
    se_a, se_b, se_d = sd_a / math.sqrt(n), sd_b / math.sqrt(n), sd_d / math.sqrt(n)
    return {
        "n": n,
        "acc_a": acc_a,
        "acc_b": acc_b,
        "diff": diff,
        "stderr_a": se_a,
        "stderr_b": se_b,
        "stderr_paired": se_d,
        "stderr_unpaired": math.sqrt(se_a**2 + se_b**2),
        "n_discordant": sum(1 for x in d if x != 0),  # items exactly one of the two got right
        "significant": bool(abs(diff) > 2 * se_d) if not math.isnan(se_d) else False,
        "ci95": bootstrap_mean_ci([d]),
        # right/wrong scores: McNemar's exact test on the discordant items
        "p_mcnemar": (mcnemar_exact(sum(1 for x in d if x > 0), sum(1 for x in d if x < 0))
                      if set(xa) | set(xb) <= {0.0, 1.0} else None),
    }


def paired_nll_difference(rows: list[dict], stage_a: str, stage_b: str, context_len: int) -> dict | None:
    """NLL of ``stage_a`` minus ``stage_b`` at ``context_len`` (perplexity rows of both), with the
    standard error of the mean paired difference over windows: both stages score the same tokens of
    the same windows. None if either is missing; ``stderr`` is NaN with fewer than two windows."""
    by = {(r["stage"], int(r["context_len"])): r for r in rows}
    a, b = by.get((stage_a, context_len)), by.get((stage_b, context_len))
    if a is None or b is None:
        return None
    wa, wb = a.get("window_nlls") or [], b.get("window_nlls") or []
    diff = float(a["nll"]) - float(b["nll"])
    if len(wa) != len(wb) or len(wa) < 2:
        return {"diff": diff, "stderr": float("nan"), "n_windows": len(wa)}
    _, sd_d = mean_sd([x - y for x, y in zip(wa, wb)])
    return {"diff": diff, "stderr": sd_d / math.sqrt(len(wa)), "n_windows": len(wa)}
