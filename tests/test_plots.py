"""Plot functions write real PNG and SVG files from fixture artifacts, with every variant and stage on
one axis, axis labels with units, and the crossover with base where a variant overtakes it."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from hybrid_llama.report import plots, quality_plots
from hybrid_llama.report.results import crossover

DEVICE = "NVIDIA Test GPU 80GB"


def _check(paths, stem, *texts):
    assert [p.name for p in paths] == [stem.name + ".png", stem.name + ".svg"]
    png, svg = paths
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(png)
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert float(np.std(img[..., :3])) > 0.01  # something was drawn
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "</svg>" in text
    for t in texts:
        assert t in text, t


@pytest.fixture
def throughput_csv(tmp_path):
    rows = []
    for variant, backend, oom_at in (("base", "sdpa", 64), ("hybrid_chunked", "chunked", None)):
        for phase in ("prefill", "decode"):
            for n in [2**i for i in range(8)]:
                status = "ok" if oom_at is None or n < oom_at else ("oom" if n == oom_at else "skipped")
                # base decodes slower as its KV cache grows; the hybrid's state is constant
                t = 1e-3 * n if phase == "prefill" else (2e-3 * (1 + n / 8) if variant == "base" else 4e-3)
                ok = status == "ok"
                rows.append({
                    "variant": variant, "backend": backend, "phase": phase, "seq_len": n, "batch": 1,
                    "tokens_per_s": (n if phase == "prefill" else 4) / t if ok else np.nan,
                    "s_per_token": t / (n if phase == "prefill" else 4) if ok else np.nan,
                    "time_s": t if ok else np.nan, "peak_mem_bytes": (1e8 + 1e5 * n) if ok else np.nan,
                    "cache_bytes": (4096 * n if variant == "base" else 65536) if ok else np.nan,
                    "mem_method": "cuda_max_allocated", "device": "cuda", "device_name": DEVICE,
                    "dtype": "bfloat16", "repeats": 3, "decode_tokens": 4, "status": status, "error": ""})
    path = tmp_path / "throughput.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_crossover_interpolates_in_log_log():
    # ratio 0.5 at 4 tokens, 2 at 16: log-linear halfway, at 8 tokens
    assert crossover([4, 16], [0.5, 2.0]) == pytest.approx(8.0)
    assert crossover([1, 2, 4], [0.5, 0.8, 1.0]) == pytest.approx(4.0)
    assert crossover([1, 2], [1.5, 2.0]) is None  # faster everywhere: nothing to cross
    assert crossover([1, 2], [0.5, 0.9]) is None
    # noise around 1 at short lengths: the crossing that lasts to the longest length counts
    assert crossover([1, 2, 4, 8], [0.9, 1.1, 0.5, 2.0]) == pytest.approx(4 * 2 ** 0.5)
    # faster at some lengths but slower at the longest one: no crossover to report
    assert crossover([1, 2, 4], [0.5, 1.2, 0.95]) is None


def test_throughput_plot(throughput_csv, tmp_path):
    stem = tmp_path / "fig" / "throughput"
    # decode: base 4 / (2e-3 (1 + n/8)) vs hybrid 4 / 4e-3 tokens/s: equal at n = 8
    _check(plots.plot_throughput(throughput_csv, stem), stem, DEVICE, "prompt length (tokens, log scale)",
           "throughput (tokens/s, log scale)", "prefill (whole prompt)", "decode (after a prompt of that length)",
           "OOM at 64", "≈8")


def test_memory_plot(throughput_csv, tmp_path):
    stem = tmp_path / "memory"
    _check(plots.plot_memory(throughput_csv, stem), stem, DEVICE, "cache after prefill (bytes, log scale)",
           "peak memory during prefill (MiB)")


def _quality_tables() -> tuple[dict, dict, dict]:
    """{variant: rows} of perplexity, passkey and components tables: two variants, the shared stages
    repeated in both tables as the workflow writes them."""
    lens = (64, 256, 1024)
    stages = {"hyb": ("transfer", "transfer_lora"), "ctl": ("converted",)}
    ppl, pk, comp = {}, {}, {}
    for v, own in stages.items():
        every = ("base", *own, "base_lora")
        ppl[v] = [{"stage": s, "context_len": L, "nll": 3.0 - 0.1 * i + L / 4096, "window_nlls": [3.0, 3.1]}
                  for i, s in enumerate(every) for L in lens]
        pk[v] = [{"stage": s, "context_len": L, "depth": d, "accuracy": 1.0 if s == "base" else 0.2, "n": 5}
                 for s in every for L in lens[1:] for d in (0.1, 0.9)]
        comp[v] = [{"stage": s, "layer": layer, "context_len": L, "window_share": 1.0 if v == "ctl" else 0.3,
                    "linear_share": 0.0, "n_queries": 8} for s in own for layer in (0, 2, 4) for L in (64, 256)]
    return ppl, pk, comp


LABELS = ("base", "base + LoRA (control)", "hyb · after transfer", "hyb · after transfer + LoRA",
          "ctl · as converted (no training)")


def test_nll_plot_puts_every_variant_and_stage_on_one_axis(tmp_path):
    ppl, _, _ = _quality_tables()
    stem = tmp_path / "nll"
    paths = quality_plots.plot_nll(ppl, stem, title="NLL on " + DEVICE, windows={"hyb": 64, "ctl": 64})
    _check(paths, stem, DEVICE, *LABELS, "context length (tokens, log scale)", "(nats/token)", "window 64")
    # both tables repeat the shared stages; the figure draws them once
    assert paths[1].read_text().count("base + LoRA (control)") == 1


def test_passkey_plot(tmp_path):
    _, pk, _ = _quality_tables()
    stem = tmp_path / "passkey"
    _check(quality_plots.plot_passkey(pk, stem, title="passkey on " + DEVICE), stem, DEVICE, *LABELS,
           "passkey retrieved (% of trials, all depths)")


def test_components_plot_has_a_panel_per_hybrid_stage(tmp_path):
    _, _, comp = _quality_tables()
    stem = tmp_path / "components"
    _check(quality_plots.plot_components(comp, stem, title="shares on " + DEVICE), stem, DEVICE, *LABELS[2:],
           "hybrid layer index", "window share of normalizer", "64 tokens", "256 tokens")
    stem = tmp_path / "none"  # no hybrid stage measured: still a figure, saying so
    _check(quality_plots.plot_components({}, stem, title="empty"), stem, "no hybrid stage was measured")


def test_mmlu_plot(tmp_path):
    paths = []
    settings = [("base", "base", 0, "cpu"), ("base", "base", 5, "cpu"), ("hybrid", "transfer", 0, "cpu"),
                ("hybrid", "transfer", 0, DEVICE)]
    for i, (variant, stage, shots, dev) in enumerate(settings):
        res = {"fmt": "mc", "shots": shots, "device_name": dev, "meta": {"variant": variant, "stage": stage},
               "aggregate": {"acc_weighted": 0.25 + 0.03 * i, "acc_weighted_stderr": 0.02,
                             "acc_mean": 0.26, "acc_mean_stderr": 0.02}}
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(res))
        paths.append(p)
    stem = tmp_path / "mmlu"
    _check(plots.plot_mmlu(paths, stem), stem, DEVICE, "chance (25%)", "hybrid / transfer", "5-shot mc, cpu")


def test_loss_plots(tmp_path):
    steps = np.arange(0, 50, 5)
    pd.DataFrame([{"step": s, "layer": l, "mse": 1.0 / (1 + s) / (l + 1)} for s in steps for l in (0, 3)]).to_csv(
        tmp_path / "transfer.csv", index=False)
    stem = tmp_path / "transfer"
    _check(plots.plot_transfer_loss(tmp_path / "transfer.csv", stem, device="cpu"), stem, "layer 3", "cpu")

    lora = tmp_path / "lora"
    lora.mkdir()
    pd.DataFrame([{"step": s, "split": "train", "loss": 3 - 0.01 * s} for s in steps]
                 + [{"step": s, "split": "val", "loss": 3.1 - 0.01 * s} for s in steps[::3]]).to_csv(
        lora / "loss.csv", index=False)
    (lora / "metrics.json").write_text(json.dumps({"device_name": DEVICE}))
    stem = tmp_path / "lora_loss"
    _check(plots.plot_lora_loss(lora / "loss.csv", stem), stem, DEVICE, "val", "cross-entropy loss (nats/token)")
