"""Plot functions write real PNG and SVG files from fixture artifacts."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread

from hybrid_llama.report import plots

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
                slow = 2.0 if variant == "base" else 1.0
                t = slow * (1e-3 * n if phase == "prefill" else 1e-2 * (1 + n / 64))
                ok = status == "ok"
                rows.append(dict(variant=variant, backend=backend, phase=phase, seq_len=n, batch=1,
                                 tokens_per_s=(n if phase == "prefill" else 4) / t if ok else np.nan,
                                 s_per_token=t / (n if phase == "prefill" else 4) if ok else np.nan,
                                 time_s=t if ok else np.nan, peak_mem_bytes=(1e8 + 1e5 * n) if ok else np.nan,
                                 cache_bytes=(4096 * n if variant == "base" else 65536) if ok else np.nan,
                                 mem_method="cuda_max_allocated", device="cuda", device_name=DEVICE,
                                 dtype="bfloat16", repeats=3, decode_tokens=4, status=status, error=""))
    path = tmp_path / "throughput.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_throughput_plot(throughput_csv, tmp_path):
    stem = tmp_path / "fig" / "throughput"
    _check(plots.plot_throughput(throughput_csv, stem), stem, DEVICE, "prompt length (tokens)",
           "throughput (tokens/s)", "latency (s/token)", "OOM at 64")


def test_memory_plot(throughput_csv, tmp_path):
    stem = tmp_path / "memory"
    _check(plots.plot_memory(throughput_csv, stem), stem, DEVICE, "peak memory (MiB)")


def test_mmlu_plot(tmp_path):
    paths = []
    for i, (variant, stage, shots, dev) in enumerate([("base", "base", 0, "cpu"), ("base", "base", 5, "cpu"),
                                                       ("hybrid", "transfer", 0, "cpu"), ("hybrid", "transfer", 0, DEVICE)]):
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
    pd.DataFrame([dict(step=s, layer=l, mse=1.0 / (1 + s) / (l + 1)) for s in steps for l in (0, 3)]).to_csv(
        tmp_path / "transfer.csv", index=False)
    stem = tmp_path / "transfer"
    _check(plots.plot_transfer_loss(tmp_path / "transfer.csv", stem, device="cpu"), stem, "layer 3", "cpu")

    lora = tmp_path / "lora"
    lora.mkdir()
    pd.DataFrame([dict(step=s, split="train", loss=3 - 0.01 * s) for s in steps]
                 + [dict(step=s, split="val", loss=3.1 - 0.01 * s) for s in steps[::3]]).to_csv(
        lora / "loss.csv", index=False)
    (lora / "metrics.json").write_text(json.dumps({"device_name": DEVICE}))
    stem = tmp_path / "lora_loss"
    _check(plots.plot_lora_loss(lora / "loss.csv", stem), stem, DEVICE, "val", "cross-entropy loss (nats/token)")
