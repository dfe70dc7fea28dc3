"""The headline table: what linearization bought and what it cost, one row per model that matters.

One table per (model, device). Rows: the base model, the base + LoRA control, and every variant at
its final stage. Columns: speed and cache relative to base at the longest length every variant was
measured at, NLL difference to base at the window length and at the longest context (paired stderr over the
scored windows), passkey accuracy at the longest length every row has, and the MMLU difference to base per
(format, shots) with the paired 2-stderr rule. Every cell links to the section it comes from; a
number that is not in the result files is a visible "not measured" cell.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from hybrid_llama.eval.tables import BEYOND_WINDOW
from hybrid_llama.names import SHARED_STAGES, STAGE_LABELS
from hybrid_llama.pipeline import Pipeline
from hybrid_llama.report.formatting import byte_size, plus_minus
from hybrid_llama.report.results import (
    Results,
    longest_common_length,
    mmlu_delta,
    mmlu_metric,
    nll_delta,
    num,
    paired_speedup,
    passkey_at,
    speed_table,
    within_noise,
)
from hybrid_llama.report.zeroshot import headline_cell as zeroshot_headline_cell

NOT_MEASURED = "not measured"


def anchor(*parts: str) -> str:
    """An HTML id from parts (device names such as 'cuda:0-h100' keep only safe characters)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", "-".join(parts))


@dataclass
class Cell:
    text: str
    href: str
    title: str = ""
    css: str = ""
    note: str = ""  # a second, smaller line (the backend, the significance verdict)
    value: float | None = None  # the number behind the text (tests and the summary read it)
    extra: dict = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return self.text != NOT_MEASURED


def missing(href: str, why: str = "") -> Cell:
    return Cell(NOT_MEASURED, href, title=why or "no result file for this cell", css="missing")


@dataclass
class Row:
    model: str
    device: str
    slot: str  # the result slot: a variant's name, or 'base' / 'base_lora'
    stage: str
    label: str
    cells: list[Cell]
    window: int | None = None
    formulation: str | None = None


@dataclass
class Headline:
    model: str
    device: str
    device_name: str
    columns: list[str]
    rows: list[Row]
    lengths: dict[str, int | None]  # throughput / nll / passkey lengths the columns are measured at
    window: int | None
    mmlu_headers: list[tuple[str, str]]  # (setting, metric) of each MMLU column
    zeroshot: bool = False  # whether the last column is the zero-shot suite's average

    @property
    def id(self) -> str:
        return anchor("glance", self.model, self.device)

    def cell(self, slot: str, column: str) -> Cell:
        row = next(r for r in self.rows if r.slot == slot)
        return row.cells[self.columns.index(column)]


def row_specs(pipe: Pipeline) -> list[tuple[str, str]]:
    """(slot, stage) of the headline rows: base, base + LoRA, each variant at its final stage."""
    rows = [(s, s) for s in SHARED_STAGES if s in pipe.stages]
    return rows + [(v, pipe.variant_stages(v)[-1]) for v in pipe.variants if pipe.variant_stages(v)]


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}×" if x / base < 10 else f"{x / base:.1f}×"


def _speedup_cell(row: dict, base: dict, href: str, note: str = "") -> Cell:
    """The median paired speed-up with its min-max spread over the repeats; "within noise" when that
    spread covers 1.0x, so a reader does not take a wobble for a gain or a loss."""
    ratio, lo, hi = paired_speedup(row, base)
    tps, ref = num(row["tokens_per_s"]), num(base["tokens_per_s"])
    rounds = f"{int(num(row.get('repeats')))} interleaved repeats" if not math.isnan(num(row.get("repeats"))) else ""
    title = (f"{tps:,.1f} vs base {ref:,.1f} tokens/s ({row['backend']} backend); median of per-repeat ratios "
             f"{ratio:.2f}×, spread {lo:.2f}–{hi:.2f}× {('over ' + rounds) if rounds else ''}").strip()
    if lo == hi:
        return Cell(_ratio(ratio, 1.0), href, title, css="better" if ratio > 1 else "worse", value=ratio, note=note)
    spread = f"{lo:.2f}–{hi:.2f}×"
    if within_noise(lo, hi):
        return Cell(f"{ratio:.2f}× within noise", href, title, value=ratio,
                    note=" · ".join(x for x in (spread, note) if x), extra={"spread": (lo, hi)})
    return Cell(_ratio(ratio, 1.0), href, title, css="better" if ratio > 1 else "worse", value=ratio,
                note=" · ".join(x for x in (spread, note) if x), extra={"spread": (lo, hi)})


def _speed_cells(rows: list[dict] | None, slot: str, length: int | None, href_speed: str,
                 href_cache: str) -> list[Cell]:
    """Prefill tokens/s, decode tokens/s and cache bytes of ``slot`` relative to base at ``length``.
    A variant measured with several backends shows its fastest one and names it."""
    if rows is None or length is None:
        why = "no throughput result" if rows is None else "base has no successful measurement"
        return [missing(href_speed, why), missing(href_speed, why), missing(href_cache, why)]
    if slot == "base_lora":
        why = "LoRA merges into the weights: same speed and cache as base, not measured separately"
        return [Cell("as base", href_speed, why), Cell("as base", href_speed, why), Cell("as base", href_cache, why)]
    table = speed_table(rows)
    labels = sorted({r["variant"] for r in rows if r["slot"] == slot})
    if not labels:
        why = f"'{slot}' is not in the throughput file (untrained controls are not timed; throughput.variants)"
        return [missing(href_speed, why), missing(href_speed, why), missing(href_cache, why)]
    cells = []
    for phase in ("prefill", "decode"):
        base = table[("base", phase)][length]
        runs = [table[(label, phase)].get(length) for label in labels]
        ok = [r for r in runs if r is not None and r["status"] == "ok"]
        if not ok:
            status = next((r["status"] for r in runs if r is not None), "")
            cells.append(missing(href_speed, f"no successful run at {length} tokens ({status or 'not run'})"))
            if status:
                cells[-1].text = status.upper() if status == "oom" else status
            continue
        best = max(ok, key=lambda r: num(r["tokens_per_s"]))
        tps = num(best["tokens_per_s"])
        if slot == "base":
            cells.append(Cell(f"{tps:,.0f} tok/s", href_speed, f"base {phase} at {length} tokens", value=tps))
            continue
        cells.append(_speedup_cell(best, base, href_speed, note=best["backend"] if len(labels) > 1 else ""))
    base_cache = num(table[("base", "prefill")][length]["cache_bytes"])
    own = [table[(label, "prefill")].get(length) for label in labels]
    sizes = [num(r["cache_bytes"]) for r in own if r is not None]
    cache = next((x for x in sizes if not math.isnan(x)), math.nan)
    if math.isnan(cache) or math.isnan(base_cache):
        cells.append(missing(href_cache, f"no cache size at {length} tokens"))
    elif slot == "base":
        cells.append(Cell(byte_size(cache), href_cache, "KV cache after prefill", value=cache))
    else:
        cells.append(Cell(_ratio(cache, base_cache), href_cache, f"{byte_size(cache)} vs base {byte_size(base_cache)}",
                          css="better" if cache < base_cache else "worse", value=cache / base_cache))
    return cells


def _nll_cell(res: Results, model: str, device: str, slot: str, stage: str, length: int | None,
              href: str) -> Cell:
    if length is None:
        return missing(href, "no perplexity result")
    variant = None if slot in SHARED_STAGES else slot
    own = res.quality_rows("perplexity", model, device, stage, variant)
    base = res.quality_rows("perplexity", model, device, "base", None)
    if slot == "base":
        r = next((r for r in base if int(r["context_len"]) == length), None)
        if r is None:
            return missing(href, f"base NLL at {length} tokens is not in the perplexity results")
        return Cell(f"{r['nll']:.3f} nats", href, f"base NLL per token at {length} tokens", value=r["nll"])
    d = nll_delta(own, base, length)
    if d is None:
        return missing(href, f"no NLL of both this stage and base at {length} tokens")
    title = (f"NLL {d['nll_a']:.3f} vs base {d['nll_b']:.3f} nats/token at {length} tokens; "
             f"± paired stderr over {d['n_windows']} windows")
    css = "worse" if d["diff"] > 0 else "better" if d["diff"] < 0 else ""
    return Cell(plus_minus(d["diff"], d["stderr"]), href, title, css=css,
                value=d["diff"], extra=d)


def _passkey_cell(res: Results, model: str, device: str, slot: str, stage: str, length: int | None,
                  href: str) -> Cell:
    if length is None:
        return missing(href, "no passkey result")
    rows = res.quality_rows("passkey", model, device, stage, None if slot in SHARED_STAGES else slot)
    beyond = passkey_at(rows, length, beyond=BEYOND_WINDOW)
    p = beyond or passkey_at(rows, length)
    if p is None:
        return missing(href, f"no passkey trials at {length} tokens")
    where = f"needles > {BEYOND_WINDOW} tokens before the question" if beyond else "all needles"
    return Cell(f"{p['accuracy']:.0%} ({p['found']}/{p['trials']})", href,
                f"key retrieved in {p['found']} of {p['trials']} trials at {length} tokens ({where}); 95 % "
                f"interval {p['ci_low']:.0%}–{p['ci_high']:.0%}",
                value=p["accuracy"], extra=p, note=f"{p['ci_low']:.0%}–{p['ci_high']:.0%}")


def _mmlu_cell(res: Results, model: str, device: str, slot: str, stage: str, fmt: str, shots: int,
               href: str) -> Cell:
    base = res.mmlu.get((model, "base", device, "base", fmt, shots))
    own = res.mmlu.get((model, slot, device, stage, fmt, shots))
    if own is None:
        return missing(href, f"no {shots}-shot {fmt} MMLU result")
    metric = mmlu_metric(fmt)
    if slot == "base":
        agg = own["aggregate"]
        acc, se = num(agg.get(f"{metric}_weighted")), num(agg.get(f"{metric}_weighted_stderr"))
        return Cell(f"{100 * acc:.1f} ± {100 * se:.1f} %", href, f"base {metric} over {agg.get('n')} questions",
                    value=acc)
    d = mmlu_delta(own, base, fmt) if base is not None else None
    if d is None:
        return missing(href, "no base result on the same questions to compare with")
    mark = "significant" if d["significant"] else "n.s."
    title = (f"{100 * d['acc_a']:.1f} % vs base {100 * d['acc_b']:.1f} % over {d['n']} questions; "
             f"± paired stderr; significant = |Δ| > 2 paired stderr")
    # colour only what the paired rule calls a difference
    css = ("better sig" if d["diff"] > 0 else "worse sig") if d["significant"] else ""
    return Cell(plus_minus(100 * d["diff"], 100 * d["stderr_paired"], 1), href, title, css=css, note=mark,
                value=d["diff"], extra=d)


def _window(pipe: Pipeline) -> int | None:
    """The softmax window the ΔNLL column is measured at: the variants' (most common) window."""
    windows = Counter(pipe.hybrid(v)["window"] for v in pipe.variants)
    return windows.most_common(1)[0][0] if windows else None


def _zeroshot_cell(zeroshot: dict, model: str, device: str, slot: str, stage: str, href: str) -> Cell:
    c = zeroshot_headline_cell(zeroshot, model, device, slot, stage)
    if c is None:
        return missing(href, "this stage is not in zeroshot.variants (or its job has not run)")
    return Cell(c["text"], href, c["title"], css=c["css"], note=c["note"], value=c["value"])


def _common_passkey_length(pipe: Pipeline, res: Results, model: str, device: str) -> int | None:
    """The longest passkey length of every headline row that has passkey trials."""
    per_row = [{int(r["context_len"]) for r in res.quality_rows("passkey", model, device, stage,
                                                                 None if slot in SHARED_STAGES else slot)}
               for slot, stage in row_specs(pipe)]
    common = set.intersection(*[lens for lens in per_row if lens] or [set()])
    return max(common, default=max(res.context_lens("passkey", model, device), default=None))


def headlines(pipe: Pipeline, res: Results, zeroshot: dict | None = None) -> list[Headline]:
    """One headline table per (model, device) of the config. Given the zero-shot results
    (``report.zeroshot.load``; an empty dict when listed but not there), a last column gives each
    row's six-task average (base) or its percentage of base's."""
    window = _window(pipe)
    mmlu_settings = sorted({(k[4], k[5]) for k in res.mmlu}, key=lambda x: (x[0] != "mc", x[0], x[1]))
    if not mmlu_settings:
        mmlu_settings = [(f, s) for f in pipe.config["mmlu"]["formats"] for s in pipe.config["mmlu"]["shots"]]
    several_formats = len({f for f, _ in mmlu_settings}) > 1
    out = []
    for model in pipe.models:
        for device in pipe.devices:
            speed = res.throughput.get((model, device))
            # the longest lengths every row was measured at (the long ones run for few variants and
            # are the recommended variant's block, hybrid_llama.report.long_context)
            lengths = {
                "throughput": longest_common_length(speed) if speed else None,
                "nll": max(res.context_lens("perplexity", model, device), default=None),
                "passkey": _common_passkey_length(pipe, res, model, device),
            }
            href = {k: "#" + anchor(k, model, device) for k in ("throughput", "memory", "nll", "passkey", "mmlu")}
            columns = ["prefill", "decode", "cache", "nll_window", "nll_longest", "passkey"]
            columns += [f"mmlu_{f}_{s}" for f, s in mmlu_settings] + (["zeroshot"] if zeroshot is not None else [])
            rows = []
            for slot, stage in row_specs(pipe):
                shared = slot in SHARED_STAGES
                cells = _speed_cells(speed, slot, lengths["throughput"], href["throughput"], href["memory"])
                row_window = window if shared else pipe.hybrid(slot)["window"]
                cells.append(_nll_cell(res, model, device, slot, stage, row_window, href["nll"]))
                cells.append(_nll_cell(res, model, device, slot, stage, lengths["nll"], href["nll"]))
                cells.append(_passkey_cell(res, model, device, slot, stage, lengths["passkey"], href["passkey"]))
                cells += [_mmlu_cell(res, model, device, slot, stage, f, s, href["mmlu"]) for f, s in mmlu_settings]
                if zeroshot is not None:
                    cells.append(_zeroshot_cell(zeroshot, model, device, slot, stage,
                                                "#" + anchor("zeroshot", model, device)))
                label = STAGE_LABELS[stage] if shared else f"{slot}: {STAGE_LABELS[stage]}"
                rows.append(Row(model, device, slot, stage, label, cells, None if shared else row_window,
                                None if shared else pipe.hybrid(slot)["formulation"]))
            names = {r.get("device_name") for r in speed or [] if r.get("device_name")}
            names |= {m.get("device_name") for k, m in res.mmlu.items() if k[0] == model and k[2] == device}
            headers = [(f"{s}-shot" + (f" {f}" if several_formats else ""), mmlu_metric(f)) for f, s in mmlu_settings]
            out.append(Headline(model, device, ", ".join(sorted(n for n in names if n)) or device, columns, rows,
                                lengths, window, headers, zeroshot is not None))
    return out
