"""Report summary sentences generated from the quality numbers (nothing is hard-coded).

Inputs are the rows of perplexity.csv / passkey.csv (see hybrid_llama.eval.quality) and MMLU
comparisons from `hybrid_llama.eval.quality.paired_difference`, each with a `label`.
"""

from __future__ import annotations

import math
from collections import defaultdict

from hybrid_llama.eval.mmlu import CHANCE


def _stages(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["stage"] for r in rows))


def _by_stage(rows: list[dict], key: str, value: str) -> dict[str, dict]:
    out: dict[str, dict] = defaultdict(dict)
    for r in rows:
        out[r["stage"]][int(r[key])] = float(r[value])
    return out


def perplexity_sentences(rows: list[dict], base_stage: str = "base") -> list[str]:
    """Per stage: NLL gap to base at the shortest and longest shared context length, and how much
    of the base model's gain from longer context the stage keeps."""
    nll = _by_stage(rows, "context_len", "nll")
    if base_stage not in nll:
        return [f"Perplexity: no '{base_stage}' stage to compare with ({', '.join(nll) or 'no rows'})."]
    base = nll[base_stage]
    out = []
    for stage in _stages(rows):
        if stage == base_stage:
            continue
        lens = sorted(set(base) & set(nll[stage]))
        if not lens:
            continue
        lo, hi = lens[0], lens[-1]
        gaps = {L: nll[stage][L] - base[L] for L in lens}
        s = (
            f"{stage} is {gaps[lo]:+.3f} nats/token from {base_stage} at {lo} tokens of context "
            f"(perplexity {math.exp(nll[stage][lo]):.2f} vs {math.exp(base[lo]):.2f})"
        )
        if hi != lo:
            s += (
                f" and {gaps[hi]:+.3f} at {hi} tokens "
                f"(perplexity {math.exp(nll[stage][hi]):.2f} vs {math.exp(base[hi]):.2f})"
            )
            worst = max(lens, key=lambda L: gaps[L])
            if worst not in (lo, hi):
                s += f"; the gap is largest at {worst} tokens ({gaps[worst]:+.3f})"
            gain_base = base[lo] - base[hi]
            gain_stage = nll[stage][lo] - nll[stage][hi]
            if gain_base > 1e-3:
                s += (
                    f"; going from {lo} to {hi} tokens lowers its NLL by {gain_stage:.3f} vs {gain_base:.3f} "
                    f"for {base_stage}, so it keeps {gain_stage / gain_base:.0%} of {base_stage}'s gain from longer context"
                )
        out.append(s + ".")
    # headline: at the longest length every stage reached, rank the stages by their gap to base
    others = [st for st in _stages(rows) if st != base_stage]
    shared = sorted(set(base).intersection(*(nll[st] for st in others))) if others else []
    if shared:
        hi = shared[-1]
        ranked = sorted(others, key=lambda st: nll[st][hi] - base[hi])
        parts = [
            f"{st} ({nll[st][hi] - base[hi]:+.3f} nats/token, {math.exp(base[hi] - nll[st][hi]):.0%} of {base_stage}'s per-token probability)"
            for st in ranked
        ]
        lead = f"At {hi} tokens of context, {parts[0]} comes closest to {base_stage}"
        out.insert(0, lead + (", then " + ", ".join(parts[1:]) if parts[1:] else "") + ".")
    return out


def passkey_sentences(rows: list[dict], base_stage: str = "base", threshold: float = 0.5) -> list[str]:
    """Per stage: accuracy (mean over depths) at the longest length, and the longest length where
    the mean accuracy still reaches `threshold`."""
    cells: dict[str, dict[int, list[tuple[float, int]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[r["stage"]][int(r["context_len"])].append((float(r["accuracy"]), int(r["n"])))
    # trial-weighted mean over depths
    acc = {s: {L: sum(a * n for a, n in v) / max(1, sum(n for _, n in v)) for L, v in d.items()} for s, d in cells.items()}
    trials = {s: {L: sum(n for _, n in v) for L, v in d.items()} for s, d in cells.items()}
    out = []
    for stage in _stages(rows):
        lens = sorted(acc[stage])
        hi = lens[-1]
        ok = [L for L in lens if acc[stage][L] >= threshold]
        s = f"Passkey: {stage} retrieves the key in {acc[stage][hi]:.0%} of {trials[stage][hi]} trials at {hi} tokens"
        if stage != base_stage and hi in acc.get(base_stage, {}):
            s += f" ({base_stage}: {acc[base_stage][hi]:.0%})"
        s += (
            f"; its longest context with at least {threshold:.0%} accuracy is {ok[-1]} tokens"
            if ok
            else f"; it stays below {threshold:.0%} at every length tested ({lens[0]}-{hi})"
        )
        out.append(s + ".")
    return out


def mmlu_sentences(pairs: list[dict]) -> list[str]:
    """One sentence per paired comparison (output of paired_difference plus a `label`)."""
    out = []
    for p in pairs:
        label = p.get("label", "a vs b")
        verdict = "significant" if p["significant"] else "not significant"
        s = (
            f"MMLU {label}: {p['acc_a']:.1%} ± {100 * p['stderr_a']:.1f} vs {p['acc_b']:.1%} ± {100 * p['stderr_b']:.1f} (± stderr), "
            f"difference {100 * p['diff']:+.1f} points with paired stderr {100 * p['stderr_paired']:.1f} "
            f"over {p['n']} questions: {verdict} (rule: |difference| > 2 paired stderr)"
        )
        near_chance = [
            name for name, a, se in (("a", p["acc_a"], p["stderr_a"]), ("b", p["acc_b"], p["stderr_b"]))
            if abs(a - CHANCE) <= 2 * se
        ]
        if len(near_chance) == 2:
            s += f"; both are within 2 stderr of chance ({CHANCE:.0%})"
        elif near_chance:
            which = p["acc_a"] if near_chance[0] == "a" else p["acc_b"]
            s += f"; {which:.1%} is within 2 stderr of chance ({CHANCE:.0%})"
        out.append(s + ".")
    return out


def summarize(
    perplexity_rows: list[dict] | None = None,
    passkey_rows: list[dict] | None = None,
    mmlu_pairs: list[dict] | None = None,
    *,
    base_stage: str = "base",
) -> list[str]:
    """Summary sentences: which stage recovers how much of base quality at which length."""
    out: list[str] = []
    if perplexity_rows:
        out += perplexity_sentences(perplexity_rows, base_stage)
    if passkey_rows:
        out += passkey_sentences(passkey_rows, base_stage)
    if mmlu_pairs:
        out += mmlu_sentences(mmlu_pairs)
    return out
