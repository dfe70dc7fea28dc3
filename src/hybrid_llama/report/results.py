"""The workflow's result files, read once and indexed by their path wildcards, and the few derived
numbers the headline table, the summary and the plots share (so each is computed in one place).

Files are found with ``hybrid_llama.pipeline.parse_result_path``. A file that is listed but absent
is recorded in ``Results.missing`` and otherwise ignored: every lookup then returns None and the
report shows "not measured" instead of failing.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from hybrid_llama.eval.tables import (
    QUALITY_READERS,
    paired_difference,
    paired_nll_difference,
    passkey_summary,
    read_rows,
)
from hybrid_llama.names import SHARED_STAGES, STAGES
from hybrid_llama.pipeline import parse_result_path

THROUGHPUT_TYPES = {"seq_len": int, "tokens_per_s": float, "cache_bytes": float, "peak_mem_bytes": float,
                    "speedup": float, "speedup_min": float, "speedup_max": float}


def num(x: Any) -> float:
    """``x`` as a float; NaN for blanks and text (CSV cells of failed measurements)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def mmlu_metric(fmt: str) -> str:
    """The headline metric of a format: letters -> acc; answer texts -> acc_norm (lm-eval's usual)."""
    return "acc" if fmt == "mc" else "acc_norm"


def _throughput_rows(file: Path) -> list[dict]:
    types = {k: (num if k != "seq_len" else int) for k in THROUGHPUT_TYPES}
    rows = read_rows(file, types)
    for r in rows:
        r.setdefault("status", "ok")
        r["status"] = r["status"] or "ok"
        # labels are "base" or "<variant>/hybrid_<backend>" (eval/throughput.py)
        r["slot"] = r["variant"].split("/", 1)[0]
    return rows


@dataclass
class Results:
    """Result rows keyed by wildcards. Quality tables: (model, variant, device) -> rows; throughput:
    (model, device) -> rows; MMLU: (model, slot, device, stage, fmt, shots) -> result dict."""

    perplexity: dict[tuple, list[dict]] = field(default_factory=dict)
    passkey: dict[tuple, list[dict]] = field(default_factory=dict)
    components: dict[tuple, list[dict]] = field(default_factory=dict)
    books: dict[tuple, list[dict]] = field(default_factory=dict)  # NLL vs context on the held-out books
    niah: dict[tuple, list[dict]] = field(default_factory=dict)  # multi-key needle in a haystack
    throughput: dict[tuple, list[dict]] = field(default_factory=dict)
    mmlu: dict[tuple, dict] = field(default_factory=dict)
    mmlu_files: dict[tuple, Path] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, files: Iterable[str | Path]) -> Results:
        out = cls()
        for file in map(Path, files):
            name, w = parse_result_path(file, ["quality", "throughput", "mmlu"])
            if not file.is_file():
                out.missing.append(file.as_posix())
                continue
            if name == "quality" and w["kind"] in QUALITY_READERS:
                getattr(out, w["kind"])[w["model"], w["variant"], w["device"]] = QUALITY_READERS[w["kind"]](file)
            elif name == "throughput":
                out.throughput[w["model"], w["device"]] = _throughput_rows(file)
            elif name == "mmlu":
                key = (w["model"], w["variant"], w["device"], w["stage"], w["fmt"], int(w["shots"]))
                out.mmlu[key] = json.loads(file.read_text())
                out.mmlu_files[key] = file
        return out

    # ---- quality

    def quality_rows(self, kind: str, model: str, device: str, stage: str, variant: str | None) -> list[dict]:
        """The rows of one stage: a variant stage from its variant's table, a shared stage (variant
        None) from the first table that holds it (every variant's table repeats the shared stages)."""
        tables = getattr(self, kind)
        if variant is not None:
            return [r for r in tables.get((model, variant, device), []) if r["stage"] == stage]
        for (m, _, d), rows in sorted(tables.items()):
            if m == model and d == device and any(r["stage"] == stage for r in rows):
                return [r for r in rows if r["stage"] == stage]
        return []

    def context_lens(self, kind: str, model: str, device: str) -> list[int]:
        return sorted({int(r["context_len"]) for (m, _, d), rows in getattr(self, kind).items()
                       if m == model and d == device for r in rows})


def stage_rows(tables: dict[str, list[dict]]) -> list[tuple[str | None, str, list[dict]]]:
    """(variant, stage, rows) of quality tables keyed by variant: the shared stages once (variant
    None, from the first table holding them), then every stage of every variant."""
    out, seen = [], set()
    for variant, rows in tables.items():
        for stage in sorted({r["stage"] for r in rows}, key=STAGES.index):
            own = [r for r in rows if r["stage"] == stage]
            if stage not in SHARED_STAGES:
                out.append((variant, stage, own))
            elif stage not in seen:
                seen.add(stage)
                out.insert(len(seen) - 1, (None, stage, own))
    return out


def nll_delta(a_rows: list[dict], b_rows: list[dict], context_len: int) -> dict | None:
    """NLL of the rows ``a_rows`` minus ``b_rows`` (one stage each, possibly from different tables)
    at ``context_len`` with the paired stderr over the windows both scored; None if either lacks it.
    Adds ``nll_a`` and ``nll_b``."""
    rows = [{**r, "stage": "a"} for r in a_rows] + [{**r, "stage": "b"} for r in b_rows]
    d = paired_nll_difference(rows, "a", "b", context_len)
    if d is None:
        return None
    nll = {r["stage"]: r["nll"] for r in rows if int(r["context_len"]) == context_len}
    return {**d, "nll_a": nll["a"], "nll_b": nll["b"]}


def passkey_at(rows: list[dict], context_len: int, *, beyond: int | None = None) -> dict | None:
    """Passkey accuracy of one stage at ``context_len`` (teacher-forced trials; only the needles more
    than ``beyond`` tokens before the question when given), with its Wilson interval."""
    return passkey_summary(rows, context_len, beyond=beyond)


def mmlu_delta(result: dict, base: dict, fmt: str) -> dict | None:
    """``paired_difference`` of a stage's MMLU result against the base model's; None if they share
    no questions or lack the per-question records."""
    try:
        return paired_difference(result, base, metric=mmlu_metric(fmt))
    except (KeyError, ValueError):
        return None


# ---- throughput


def speed_table(rows: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    """{(label, phase): {seq_len: row}} of a throughput CSV's rows."""
    out: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        out[r["variant"], r["phase"]][int(r["seq_len"])] = r
    return out


def longest_base_length(rows: list[dict]) -> int | None:
    """The longest length the base model was measured at in both phases: ratios need its numbers."""
    ok = defaultdict(set)
    for r in rows:
        if r["variant"] == "base" and r["status"] == "ok":
            ok[r["phase"]].add(int(r["seq_len"]))
    common = ok["prefill"] & ok["decode"]
    return max(common) if common else None


def longest_common_length(rows: list[dict]) -> int | None:
    """The longest length every label of a throughput CSV was measured at in both phases (the
    headline compares every variant there); the longest base length when no length is common."""
    ok: dict[str, set] = defaultdict(set)
    labels = {r["variant"] for r in rows}
    for r in rows:
        if r["status"] == "ok":
            ok[r["variant"], r["phase"]].add(int(r["seq_len"]))
    common = set.intersection(*(ok[label, phase] for label in labels for phase in ("prefill", "decode"))) \
        if labels else set()
    return max(common) if common else longest_base_length(rows)


def paired_speedup(row: dict, base: dict) -> tuple[float, float, float]:
    """(median, min, max) of a row's speed-up over base: the per-round paired ratios the throughput
    job wrote, or for files without them (one repeat, older runs) the ratio of tokens/s, no spread."""
    if not math.isnan(num(row.get("speedup"))):
        return num(row["speedup"]), num(row.get("speedup_min")), num(row.get("speedup_max"))
    r = num(row["tokens_per_s"]) / num(base["tokens_per_s"])
    return r, r, r


def within_noise(lo: float, hi: float) -> bool:
    """True when the spread of the paired ratios reaches both sides of 1.0 (or touches it)."""
    return lo <= 1.0 <= hi


def speed_ratios(rows: list[dict], slot: str, phase: str) -> tuple[list[int], list[float]]:
    """(lengths, speed-up of ``slot`` over base) at every length both ran, the slot's fastest backend
    at each length."""
    base = {int(r["seq_len"]): r for r in rows
            if r["variant"] == "base" and r["phase"] == phase and r["status"] == "ok"}
    best: dict[int, float] = {}
    for r in rows:
        n = int(r["seq_len"])
        if r["slot"] == slot and r["variant"] != "base" and r["phase"] == phase and r["status"] == "ok" and n in base:
            best[n] = max(best.get(n, 0.0), paired_speedup(r, base[n])[0])
    lengths = sorted(best)
    return lengths, [best[n] for n in lengths]


def crossover(lengths: list[int], ratio: list[float]) -> float | None:
    """The length from which the variant stays at least as fast as base up to the longest measured
    length: the last point where ``ratio`` (variant / base) rises through 1, interpolated linearly
    in log-log. None if it is slower at the longest length, or never slower (nothing to cross).
    The last crossing, not the first: single-repeat CPU timings wobble around 1 at short lengths."""
    points = [(L, r) for L, r in zip(lengths, ratio) if r > 0 and not math.isnan(r)]
    if not points or points[-1][1] < 1:
        return None
    for (l0, r0), (l1, r1) in reversed(list(pairwise(points))):
        if r0 < 1 <= r1:
            t = -math.log(r0) / (math.log(r1) - math.log(r0))
            return math.exp(math.log(l0) + t * (math.log(l1) - math.log(l0)))
    return None
