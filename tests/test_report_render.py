"""results/report.html renders in headless Chromium: the screenshot is not blank, the tables are
in the DOM with the numbers computed from fixture results, and the page needs no other file."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hybrid_llama.pipeline import path
from hybrid_llama.report.html import write_report

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
N_Q = 40


def _mmlu(path: Path, *, stage: str, variant: str, correct: set[int]) -> Path:
    """An eval/mmlu.py-style result: N_Q questions of one subject, `correct` answered right."""
    questions = [{"subject": "marketing", "doc_id": i, "gold": "A", "pred": "A" if i in correct else "B",
                  "loglikelihoods": [0.0, -1.0, -2.0, -3.0], "correct": i in correct} for i in range(N_Q)]
    acc = len(correct) / N_Q
    se = (acc * (1 - acc) / (N_Q - 1)) ** 0.5
    result = {
        "schema": "hybrid_llama.mmlu/1", "fmt": "mc", "shots": 0, "device": "cpu", "device_name": "cpu",
        "lm_eval_version": "0.4.13", "torch_version": "x", "transformers_version": "y", "wall_time_s": 1.5,
        "meta": {"model": "m", "variant": variant, "stage": stage},
        "aggregate": {"n": N_Q, "n_subjects": 1, "acc_weighted": acc, "acc_weighted_stderr": se,
                      "acc_mean": acc, "acc_mean_stderr": se},
        "questions": questions, "chance": 0.25,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return path


def _csv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _plot(path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.plot([1, 2, 4, 8], [3, 1, 4, 1], marker="o")
    ax.set_title(path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("report")
    r = root / "results"
    mmlu = [
        _mmlu(r / "m/base/mmlu/cpu/base/mc_0shot.json", stage="base", variant="base", correct=set(range(20))),
        # 10 more right, none lost: +25 points on the same questions
        _mmlu(r / "m/v1/mmlu/cpu/transfer_lora/mc_0shot.json", stage="transfer_lora", variant="v1",
              correct=set(range(30))),
    ]
    tp_header = ["variant", "backend", "phase", "seq_len", "batch", "tokens_per_s", "s_per_token", "peak_mem_bytes",
                 "cache_bytes", "device", "device_name", "dtype", "repeats", "decode_tokens", "status"]
    tp_rows = []
    for L in (256, 1024):
        for variant, tps in (("base", 100.0), ("v1/hybrid_chunked", 300.0 if L == 1024 else 50.0)):
            for phase in ("prefill", "decode"):
                tp_rows.append([variant, "sdpa", phase, L, 1, tps, 1 / tps, 2**30, 2**20, "cpu", "Fixture CPU",
                                "float32", 3, 8, "ok"])
    throughput = _csv(r / "m/throughput/cpu.csv", tp_header, tp_rows)
    stages = ("base", "transfer", "transfer_lora", "base_lora")
    ppl = _csv(r / "m/v1/quality/cpu/perplexity.csv", ["stage", "context_len", "nll", "ppl", "n_tokens"],
               [[s, L, 3.0 + i / 10 - L / 4096, 20.0, 64] for i, s in enumerate(stages) for L in (64, 256, 1024)])
    pk = _csv(r / "m/v1/quality/cpu/passkey.csv", ["stage", "context_len", "depth", "accuracy", "n"],
              [[s, L, d, 1.0 if s == "base" else 0.25, 20] for s in stages for L in (256, 512) for d in (0.1, 0.5)])
    plots = [_plot(root / path(name, model="m", variant="v1", device="cpu", fmt="mc")) for name in
             ("plot_mmlu", "plot_throughput", "plot_memory", "plot_transfer_loss", "plot_lora_loss", "plot_nll",
              "plot_passkey")]
    tm = r / "m/v1/transfer/metrics.json"
    tm.parent.mkdir(parents=True)
    tm.write_text(json.dumps({"mse_before": {"0": 0.5, "2": 0.4}, "mse_after": {"0": 0.05, "2": 0.1},
                              "steps": 10, "wall_time_s": 12.3456789}))
    lm = r / "m/v1/lora/metrics.json"
    lm.parent.mkdir(parents=True)
    lm.write_text(json.dumps({"val_loss_before": 2.5, "val_loss_after": 2.1, "steps": 5}))
    gen = r / "m/base/generations/base.json"
    gen.parent.mkdir(parents=True)
    gen.write_text(json.dumps({"model": "m", "variant": "base", "stage": "base", "device_name": "cpu",
                               "samples": [{"prompt": "The capital of France is", "completion": " Paris <b>"}]}))
    man = root / "resources/data/transfer/m.json"
    man.parent.mkdir(parents=True)
    man.write_text(json.dumps({"source": {"kind": "local"}, "token_count": 4096, "inputs_sha256": "ab" * 32,
                               "doc_hashes": ["cd" * 32] * 3}))
    bench = root / "logs/benchmarks/transfer/m/v1.tsv"
    bench.parent.mkdir(parents=True)
    bench.write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t321.0\n")
    config = {"models": [{"name": "m", "kind": "random", "preset": "tiny"}],
              "variants": [{"name": "v1", "hybrid": {"layers": [0, 2], "window": 64, "formulation": "hybrid",
                                                    "feature_map": "elu1", "backend": "auto"}}]}
    return write_report(
        root / "results/report.html", config=config, mmlu=mmlu, quality=[ppl, pk], throughput=[throughput],
        generations=[gen], plots=plots, transfer_metrics=[tm], lora_metrics=[lm], manifests=[man],
        benchmarks_dir=root / "logs/benchmarks", repo_dir=root,
    )


def test_report_is_self_contained(report):
    html = report.read_text()
    srcs = re.findall(r'(?:src|href)="([^"#]*)"', html)
    assert srcs and all(s.startswith("data:") for s in srcs), [s[:40] for s in srcs if not s.startswith("data:")]
    assert "<link" not in html and "<script" not in html
    assert html.count("data:image/png;base64,") == 7
    # text from results is escaped, not interpreted
    assert " Paris &lt;b&gt;" in html


def test_report_numbers(report):
    html = report.read_text()
    row = re.search(r"<tr[^>]*>(?:(?!</tr>).)*transfer \+ LoRA(?:(?!</tr>).)*</tr>", html, re.S).group(0)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
    assert "75.0 ± 6.9" in cells          # 30/40 with stderr sqrt(.75*.25/39)
    assert "+25.0" in cells and "yes" in cells   # 10 of 40 flipped right: 25 points > 2 paired stderr (6.9)
    assert "300.0 (3.00×)" in html and "50.0 (0.50×)" in html   # speedup vs base at each length
    assert "0.1 / " not in html  # passkey cells show accuracies, not depths
    assert "1.00 [1.00 / 1.00]" in html and "0.25 [0.25 / 0.25]" in html
    assert "3 document sha256 hashes" in html and "cd" * 32 not in html
    assert "transfer/m/v1" in html and "12.5" in html


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium); .ci/run installs it")
def test_report_renders_in_chromium(report, tmp_path):
    from PIL import Image, ImageStat

    shot = tmp_path / "shot.png"
    url = report.resolve().as_uri()
    out = subprocess.run([CHROMIUM, *FLAGS, "--window-size=1280,2000", f"--screenshot={shot}", url],
                         capture_output=True, text=True, timeout=180)
    assert shot.is_file(), out.stderr[-2000:]
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 2000)
    stddev = ImageStat.Stat(image).stddev[0]
    assert stddev > 20, f"screenshot looks blank (pixel stddev {stddev:.1f})"
    # a dark header band and white page: both extremes are present
    low, high = image.getextrema()
    assert low < 80 and high > 230

    dom = subprocess.run([CHROMIUM, *FLAGS, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    for table_id in ("mmlu-table", "variants-table", "devices-table", "packages-table", "benchmarks-table"):
        assert f'id="{table_id}"' in dom, table_id
    for cls in ("throughput-table", "memory-table", "perplexity-table", "passkey-table", "transfer-table",
                "lora-table", "generations-table"):
        assert f'class="{cls}"' in dom, cls
    assert dom.count("<img") == 7
