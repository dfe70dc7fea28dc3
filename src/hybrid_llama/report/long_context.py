"""The report's long-context part: the recommended variant's block under the headline, and the
tables of NLL vs context on the held-out books and of the multi-key needle test.

The recommended variant (config ``recommended``) is the one model the page recommends; its block
gives what it keeps and what it buys at long contexts, each number against base on the same items:
the NLL gap on the books at 2048/4096/8192 tokens (paired over windows), passkey beyond the window at
the long lengths, the multi-key needle test, and the prefill/decode speed-up and cache share at the
longest length it was timed at, with the length from which it stays faster than base.
"""

from __future__ import annotations

import math

from hybrid_llama.eval.tables import BEYOND_WINDOW, niah_misses, niah_summary
from hybrid_llama.pipeline import Pipeline
from hybrid_llama.report.formatting import plus_minus
from hybrid_llama.report.headline import anchor
from hybrid_llama.report.quality_plots import stage_label
from hybrid_llama.report.results import (
    Results,
    crossover,
    nll_delta,
    num,
    paired_speedup,
    passkey_at,
    speed_ratios,
    stage_rows,
)
from hybrid_llama.report.tables import kind_tables, nll_table

NLL_POINTS = 3  # the block quotes the books' NLL gap at the recommended variant's longest lengths (2048-8192)
# the short prompts when no throughput length is long (throughput.long.from_len null)
SHORT_PROMPTS_BELOW = 2048
# goals that bound a number from above; the others bound it from below
AT_MOST = frozenset({"window_nll_gap", "books_nll_gap", "cache_share"})
# how a goal's target and the measured value read in the block
GOAL_FORMATS = {"window_nll_gap": "{:+.3f}", "books_nll_gap": "{:+.3f}", "passkey": "{:.0%}", "niah": "{:.0%}",
                "prefill_speedup": "{:.2f}×", "decode_speedup": "{:.2f}×", "cache_share": "{:.0%}",
                "short_prompt_speedup": "{:.2f}×"}


def _accuracy(p: dict | None) -> str:
    if p is None:
        return ""
    return f"{p['accuracy']:.0%} ({p['found']}/{p['trials']}, {p['ci_low']:.0%}–{p['ci_high']:.0%})"


def _beside_base(mine: dict | None, base: dict | None) -> str:
    """An accuracy with base's on the same trials where base ran them: a goal above base's own
    score is read against it."""
    return _accuracy(mine) + ("" if mine is None or base is None else f"; base {_accuracy(base)}")


def _misses(m: dict | None) -> str:
    """Whose value the missed needle trials gave: a model that reads a needle back without matching
    its key answers with another needle's value, mostly one nearer the question."""
    if m is None:
        return ""
    return (f"; of {m['misses']} misses, {m['other_needle']} gave another needle's value"
            f" ({m['nearer']} of a needle nearer the question)")


def book_tables(res: Results, model: str, device: str) -> dict:
    """NLL on the held-out books per context length and stage, with the paired difference to base."""
    ppl, table = nll_table(res, "books", model, device)
    windows = max((len(r.get("window_nlls") or []) for _, _, rows in ppl for r in rows), default=0)
    return {"columns": [stage_label(v, s) for v, s, _ in ppl], "rows": table, "windows": windows}


def niah_tables(res: Results, model: str, device: str) -> dict:
    """Multi-key needle accuracy per (haystack, length) and stage, the needles beyond the window apart."""
    stages = stage_rows(kind_tables(res, "niah", model, device))
    keys = sorted({(r["haystack"], int(r["context_len"])) for _, _, rows in stages for r in rows})
    table = []
    for hay, L in keys:
        cells = []
        for _, _, rows in stages:
            p, far = niah_summary(rows, L, haystack=hay), niah_summary(rows, L, haystack=hay, beyond=BEYOND_WINDOW)
            cells.append(_accuracy(p) + ("" if far is None else f"; beyond the window: {_accuracy(far)}")
                         + _misses(niah_misses(rows, L, haystack=hay)))
        table.append({"haystack": hay, "context_len": L, "cells": cells})
    n_keys = sorted({int(r["n_keys"]) for _, _, rows in stages for r in rows})
    return {"columns": [stage_label(v, s) for v, s, _ in stages], "rows": table,
            "n_keys": ", ".join(map(str, n_keys))}


# ------------------------------------------------------------------------------------ the recommended variant


def check_goal(goals: dict, key: str, value: float | None) -> dict:
    """``goals[key]`` against a measured ``value``: {"goal": its text, "met": True/False, or None
    where nothing was measured}; {} when the config sets no such goal. The point estimate decides:
    the block shows the interval beside it."""
    target = goals.get(key)
    if target is None:
        return {}
    fmt = GOAL_FORMATS[key]
    text = f"{'≤' if key in AT_MOST else '≥'} {fmt.format(target)}"
    if value is None or math.isnan(value):
        return {"goal": text, "met": None}
    # a value equal to its target meets it, whatever the last bit of a float sum
    met = value <= target + 1e-9 if key in AT_MOST else value >= target - 1e-9
    return {"goal": f"{text}: {'met' if met else 'missed'} ({fmt.format(value)})", "met": met}


def _item(label: str, text: str, title: str = "", href: str = "", goal: dict | None = None) -> dict:
    return {"label": label, "text": text or "not measured", "title": title, "href": href, **(goal or {})}


def _nll_gap_item(label: str, d: dict | None, href: str, goals: dict, goal: str) -> dict:
    """A paired NLL difference to base (``nll_delta``) with its stderr, checked against ``goals[goal]``."""
    if d is None:
        return _item(label, "", "", href, check_goal(goals, goal, None))
    return _item(label, f"{plus_minus(d['diff'], d['stderr'])} nats",
                 f"{d['nll_a']:.3f} vs base {d['nll_b']:.3f} nats/token, ± paired stderr over {d['n_windows']} windows",
                 href, check_goal(goals, goal, d["diff"]))


def _unmeasured_speed(why: str, href: str, goals: dict) -> list[dict]:
    """The speed rows when nothing was timed: each with its goal, read as not measured."""
    return [_item(f"{what} vs base", "", why, href, check_goal(goals, key, None))
            for what, key in (("prefill", "prefill_speedup"), ("decode", "decode_speedup"), ("cache", "cache_share"))]


def _speed_items(rows: list[dict] | None, slot: str, href: str, goals: dict) -> list[dict]:
    """Prefill and decode speed-up and cache share at the longest length ``slot`` ran, and where it
    overtakes base."""
    if not rows:
        return _unmeasured_speed("no throughput result", href, goals)
    base = {(int(r["seq_len"]), r["phase"]): r for r in rows if r["variant"] == "base" and r["status"] == "ok"}
    own = [r for r in rows if r["slot"] == slot and r["variant"] != "base" and r["status"] == "ok"
           and (int(r["seq_len"]), r["phase"]) in base]
    if not own:
        return _unmeasured_speed(f"'{slot}' has no successful run beside base", href, goals)
    longest = max(int(r["seq_len"]) for r in own)
    items = []
    for phase in ("prefill", "decode"):
        best = max((r for r in own if int(r["seq_len"]) == longest and r["phase"] == phase),
                   key=lambda r: num(r["tokens_per_s"]), default=None)
        if best is None:
            items.append(_item(f"{phase} at {longest}", "", href=href,
                               goal=check_goal(goals, f"{phase}_speedup", None)))
            continue
        ratio, lo, hi = paired_speedup(best, base[longest, phase])
        spread = f" ({lo:.2f}–{hi:.2f}× over {int(num(best['repeats']))} rounds)" if hi > lo else ""
        over = crossover(*speed_ratios(rows, slot, phase))
        where = f"; faster than base from about {over:,.0f} tokens" if over else ""
        items.append(_item(f"{phase} at {longest} tokens", f"{ratio:.2f}× base{spread}{where}",
                           f"{num(best['tokens_per_s']):,.1f} vs base {num(base[longest, phase]['tokens_per_s']):,.1f}"
                           " tokens/s; median of per-round paired ratios", href,
                           check_goal(goals, f"{phase}_speedup", ratio)))
    cache = next((num(r["cache_bytes"]) for r in own if int(r["seq_len"]) == longest and r["phase"] == "prefill"),
                 math.nan)
    base_cache = num(base.get((longest, "prefill"), {}).get("cache_bytes"))
    share = cache / base_cache if base_cache else math.nan
    items.append(_item(f"cache at {longest} tokens", "" if math.isnan(share) else f"{share:.0%} of base's",
                       f"{cache:,.0f} vs base {base_cache:,.0f} bytes after prefill", href,
                       check_goal(goals, "cache_share", share)))
    return items


def _short_prompt_item(rows: list[dict] | None, slot: str, below: int, href: str, goals: dict) -> dict:
    """The slowest and fastest prefill and decode speed-up over base at the timed lengths below
    ``below`` (the short prompts, where a hybrid has little to gain and must not lose)."""
    spans, lengths = {}, set()
    for phase in ("prefill", "decode"):
        short = [(n, r) for n, r in zip(*speed_ratios(rows or [], slot, phase)) if n < below]
        if short:
            spans[phase] = (min(r for _, r in short), max(r for _, r in short))
            lengths |= {n for n, _ in short}
    if not spans:
        return _item("speed at short prompts", "", href=href, goal=check_goal(goals, "short_prompt_speedup", None))
    text = ", ".join(f"{phase} {lo:.2f}–{hi:.2f}×" for phase, (lo, hi) in spans.items()) + " base"
    return _item(f"speed at prompts of {min(lengths)}–{max(lengths)} tokens", text,
                 "slowest–fastest of the lengths' medians of per-round paired ratios", href,
                 check_goal(goals, "short_prompt_speedup", min(lo for lo, _ in spans.values())))


def recommended_blocks(pipe: Pipeline, res: Results) -> list[dict]:
    """Per (model, device): the recommended variant at its final stage against base, at long contexts."""
    slot = pipe.recommended()
    if slot is None or not pipe.variant_stages(slot):
        return []
    stage = pipe.variant_stages(slot)[-1]
    goals = {k: v for k, v in (pipe.config.get("goals") or {}).items() if v is not None}
    window = pipe.hybrid(slot)["window"]
    out = []
    for model in pipe.models:
        for device in pipe.devices:
            href = {k: "#" + anchor(k, model, device) for k in ("nll", "books", "passkey", "niah", "throughput")}
            items = []
            if "window_nll_gap" in goals:
                d = nll_delta(res.quality_rows("perplexity", model, device, stage, slot),
                              res.quality_rows("perplexity", model, device, "base", None), window)
                items.append(_nll_gap_item(f"NLL gap to base inside the window (fineweb-edu, {window} tokens)", d,
                                           href["nll"], goals, "window_nll_gap"))
            books, base = (res.quality_rows("books", model, device, s, v) for s, v in ((stage, slot), ("base", None)))
            for L in sorted({int(r["context_len"]) for r in books})[-NLL_POINTS:]:
                items.append(_nll_gap_item(f"NLL gap to base on the held-out books at {L}", nll_delta(books, base, L),
                                           href["books"], goals, "books_nll_gap"))
            passkey = res.quality_rows("passkey", model, device, stage, slot)
            base_passkey = res.quality_rows("passkey", model, device, "base", None)
            start = pipe.config["quality"]["long_context"]["from_len"] or 0
            lens = sorted({int(r["context_len"]) for r in passkey})
            for L in [n for n in lens if n >= start] or lens[-1:]:
                far = passkey_at(passkey, L, beyond=BEYOND_WINDOW)  # None for files without needle distances
                beyond = BEYOND_WINDOW if far else None
                mine = far or passkey_at(passkey, L)
                items.append(_item(f"passkey {'beyond the window ' if far else ''}at {L}",
                                   _beside_base(mine, passkey_at(base_passkey, L, beyond=beyond)),
                                   (f"needles more than {BEYOND_WINDOW} tokens before the question" if far else
                                    "all needles") + "; 95 % Wilson interval", href["passkey"],
                                   check_goal(goals, "passkey", (mine or {}).get("accuracy"))))
            niah = res.quality_rows("niah", model, device, stage, slot)
            base_niah = res.quality_rows("niah", model, device, "base", None)
            for hay, L in sorted({(r["haystack"], int(r["context_len"])) for r in niah}):
                mine = niah_summary(niah, L, haystack=hay)
                items.append(_item(f"multi-key needles ({hay} haystack) at {L}",
                                   _beside_base(mine, niah_summary(base_niah, L, haystack=hay)),
                                   "answer by greedy generation; another needle's value scores 0", href["niah"],
                                   check_goal(goals, "niah", (mine or {}).get("accuracy"))))
            speed = res.throughput.get((model, device))
            items += _speed_items(speed, slot, href["throughput"], goals)
            if "short_prompt_speedup" in goals:
                below = pipe.config["throughput"]["long"]["from_len"] or SHORT_PROMPTS_BELOW
                items.append(_short_prompt_item(speed, slot, below, href["throughput"], goals))
            checked = [i["met"] for i in items if "met" in i]
            out.append({"model": model, "device": device, "variant": slot, "stage": stage, "entries": items,
                        "goals": {"met": sum(m is True for m in checked), "checked": len(checked),
                                  "unmeasured": sum(m is None for m in checked)}})
    return out
