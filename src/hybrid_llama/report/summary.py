"""The report's summary: at most eight short sentences per (model, device), each one finding with its
number and uncertainty, generated from the headline table and the result files (nothing is written
by hand, except the published reference point for passkey).
"""

from __future__ import annotations

import math

from hybrid_llama.eval.mmlu import CHANCE
from hybrid_llama.eval.tables import BEYOND_WINDOW
from hybrid_llama.report.formatting import plus_minus
from hybrid_llama.report.headline import Headline, Row
from hybrid_llama.report.results import Results, crossover, nll_delta, speed_ratios, within_noise

MAX_SENTENCES = 8
PASSKEY_REFERENCE = (
    "published LoLCATs models score 0.6 % on RULER passkey at 4K (as reported by LoLA, arXiv 2505.23666), "
    "so a hybrid without an exact memory of older keys is expected to miss them"
)


def _name(row: Row) -> str:
    return "base + LoRA" if row.slot == "base_lora" else row.slot


def _listing(head: Headline, column: str, fmt, skip: tuple[str, ...] = ("base",)) -> list[str]:
    """'name value' for every row but ``skip`` whose cell in ``column`` was measured."""
    parts = []
    for row in head.rows:
        cell = row.cells[head.columns.index(column)]
        if row.slot not in skip and cell.measured and cell.value is not None:
            parts.append(f"{_name(row)} {fmt(cell)}")
    return parts


def _nll_text(cell) -> str:
    return plus_minus(cell.value, cell.extra.get("stderr", math.nan))


def nll_sentences(head: Headline) -> list[str]:
    out = []
    base = head.cell("base", "nll_longest")
    longest = _listing(head, "nll_longest", _nll_text)
    if longest:
        ref = f" ({base.value:.2f} nats/token)" if base.measured else ""
        n = next(r.cells[head.columns.index("nll_longest")].extra.get("n_windows") for r in head.rows
                 if r.slot != "base" and r.cells[head.columns.index("nll_longest")].measured)
        out.append(f"NLL at {head.lengths['nll']} tokens vs base{ref}, each variant at its final stage: "
                   + ", ".join(longest) + f" nats (± paired stderr over {n} windows).")
    window = _listing(head, "nll_window", _nll_text, skip=("base", "base_lora"))
    if window and head.window != head.lengths["nll"]:
        out.append(f"At {head.window} tokens, the window length (no key is older than the window yet), the gap is "
                   + ", ".join(window) + " nats.")
    return out


def control_sentence(head: Headline, res: Results) -> str | None:
    """Whether the best variant beats the window-only control at the longest context (paired over
    the same windows), and the component diagnostic's window share of its layers."""
    col = head.columns.index("nll_longest")
    hybrids = [r for r in head.rows if r.formulation not in (None, "window") and r.cells[col].measured]
    if not hybrids:
        return None
    best = min(hybrids, key=lambda r: r.cells[col].value)
    L = head.lengths["nll"]
    controls = [r for r in head.rows if r.formulation == "window"]
    if not controls:
        text = f"No window-only control is configured, so whether {best.slot}'s linear part is used is untested"
    else:
        ctrl = controls[0]
        rows = [res.quality_rows("perplexity", head.model, head.device, r.stage, r.slot) for r in (best, ctrl)]
        d = nll_delta(*rows, L)
        if d is None:
            text = f"The window-only control {ctrl.slot} has no NLL at {L} tokens to compare {best.slot} with"
        else:
            diff, se = d["diff"], d["stderr"]
            vs = f"{plus_minus(diff, se)} nats at {L} tokens"
            lead = f"{best.slot}, the best variant,"
            if math.isnan(se):
                text = f"{lead} is {vs} from the window-only control (one window, no stderr: undecided)"
            elif diff < -2 * se:
                # say which is better and by how much: a negative difference reads like a loss
                text = (f"{lead} beats the window-only control by {plus_minus(-diff, se)} nats of held-out NLL "
                        f"at {L} tokens (lower is better), so its linear part is used")
            elif diff > 2 * se:
                text = f"{lead} is worse than the window-only control ({vs}), so its linear part hurts"
            else:
                text = (f"{lead} does not beat the window-only control ({vs}, within 2 stderr), "
                        "so its linear part adds nothing measurable")
    shares = [r for r in res.components.get((head.model, best.slot, head.device), []) if r["stage"] == best.stage]
    if shares:
        Lc = max(r["context_len"] for r in shares)
        values = [r["window_share"] for r in shares if r["context_len"] == Lc and not math.isnan(r["window_share"])]
        if values:
            mean = sum(values) / len(values)
            text += (f"; at {Lc} tokens its hybrid layers give the window {mean:.0%} of the attention normalizer "
                     f"on average (layers {min(values):.0%}–{max(values):.0%})")
            if mean > 0.95:
                text += ", so they act almost as window-only attention"
            elif mean < 0.05:
                text += ", so the linear part drowns the window"
    return text + "."


def speed_sentence(head: Headline, res: Results) -> str | None:
    L = head.lengths["throughput"]
    rows = res.throughput.get((head.model, head.device))
    if L is None or not rows:
        return None
    parts = []
    for row in head.rows:
        cells = {c: row.cells[head.columns.index(c)] for c in ("prefill", "decode", "cache")}
        if row.slot in ("base", "base_lora") or not all(c.measured and c.value is not None for c in cells.values()):
            continue
        said = []
        for phase, verb in (("prefill", "prefills"), ("decode", "decodes")):
            said.append(f"{verb} at {cells[phase].value:.2f}×")
            lo, hi = cells[phase].extra.get("spread", (None, None))
            if lo is not None:
                said[-1] += f" ({'within noise, ' if within_noise(lo, hi) else ''}repeats {lo:.2f}–{hi:.2f}×)"
            cross = crossover(*speed_ratios(rows, row.slot, phase))
            if cross is not None:
                said[-1] += f" (faster than base from about {cross:,.0f} tokens)"
        parts.append(f"{row.slot} " + ", ".join(said) + f" and keeps {cells['cache'].value:.2f}× the cache")
    if not parts:
        return None
    return f"At {L} tokens on {head.device_name}, relative to base: " + "; ".join(parts) + "."


def mmlu_sentence(head: Headline) -> str | None:
    cols = [i for i, c in enumerate(head.columns) if c.startswith("mmlu_")]
    found = []
    for row in head.rows:
        for (setting, _), i in zip(head.mmlu_headers, cols):
            c = row.cells[i]
            if row.slot != "base" and c.measured and c.extra:
                found.append((row, setting, c.extra))
    if not found:
        return None
    n = max(d["n"] for _, _, d in found)

    def text(row: Row, setting: str, d: dict) -> str:
        return f"{_name(row)} {setting} {plus_minus(100 * d['diff'], 100 * d['stderr_paired'], 1)} points"

    sig = [text(*f) for f in found if f[2]["significant"]]
    if sig:
        out = f"MMLU ({n} questions per setting) differs significantly from base for " + ", ".join(sig)
    else:
        largest = max(found, key=lambda f: abs(f[2]["diff"]))
        out = (f"MMLU ({n} questions per setting): no difference from base is significant (> 2 paired stderr); "
               f"the largest is {text(*largest)}")
    base = [d for _, _, d in found if abs(d["acc_b"] - CHANCE) <= 2 * d["stderr_b"]]
    if base:
        out += f", and base itself is within 2 stderr of chance ({CHANCE:.0%})"
    return out + "."


def passkey_sentence(head: Headline) -> str | None:
    L = head.lengths["passkey"]
    cells = [(_name(r), r.cells[head.columns.index("passkey")]) for r in head.rows]
    cells = [(n, c) for n, c in cells if c.measured]
    if L is None or not cells:
        return None
    where = f"{L // head.window}× the {head.window}-token window" if head.window else "beyond the window"
    accs = ", ".join(f"{n} {c.value:.0%} ({c.extra['ci_low']:.0%}–{c.extra['ci_high']:.0%})" for n, c in cells)
    prompts = cells[0][1].extra["trials"]  # the needles beyond the window at this length
    return (f"Passkey retrieval at {L} tokens ({where}; {prompts} needles more than {BEYOND_WINDOW} tokens before "
            f"the question each, 95 % intervals): {accs}; {PASSKEY_REFERENCE}.")


def summarize(head: Headline, res: Results) -> list[str]:
    """Sentences for one headline table, in reading order, at most MAX_SENTENCES."""
    out = nll_sentences(head)
    out += [s for s in (control_sentence(head, res), speed_sentence(head, res), mmlu_sentence(head),
                        passkey_sentence(head)) if s]
    return out[:MAX_SENTENCES]
