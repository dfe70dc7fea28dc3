"""Which layers lose least when their attention keeps only the 64-token window: a ranking for
choosing the hybrid layers by measurement instead of taking every other layer.

    export PYTHONPATH=src
    nice -n 5 .venv/bin/python benchmarks/probe_layer_choice.py --out results/probe_layer_choice

For each layer alone, base with that layer converted to window-only attention (the pipeline's
`window_only` control, one layer) scores the last ``--tail`` tokens of ``--length``-token windows cut
from training books (never the held-out ones, so the choice is not fitted to the evaluation); the
gap to base on the same targets says how much that layer reads from beyond the window. The layers
with the smallest gaps are the cheapest to linearize. Writes ``layers.json`` (per-layer gaps, sorted)
and prints the ``--pick`` cheapest as a `hybrid.layers` list.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybrid_llama.books import read_books
from hybrid_llama.eval.perplexity import window_nll
from hybrid_llama.layers import HybridConfig
from hybrid_llama.stages import load_stage


def tail_nll(model, ids: torch.Tensor, tail: int) -> float:
    """Mean NLL of the last ``tail`` tokens of one window (the perplexity evaluation's scoring)."""
    return float(window_nll(model, ids[None], tail).mean())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="resources/weights/smollm2")
    ap.add_argument("--books-dir", default="../shared/data/gutenberg")
    ap.add_argument("--books", default="pg11,pg98,pg2701", help="training books (not data.books.heldout)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--windows", type=int, default=1, help="windows per book, evenly spaced through it")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--pick", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/probe_layer_choice")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    base, tok = load_stage(args.model_dir, "base", dtype=dtype)
    n_layers = base.config.num_hidden_layers
    spans = []
    for text in read_books(args.books_dir, args.books.split(",")):
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        for i in range(args.windows):
            end = args.length + (len(ids) - args.length) * (i + 1) // (args.windows + 1)
            spans.append(ids[end - args.length:end])
    ref = [tail_nll(base, s, args.tail) for s in spans]
    del base

    rows = []
    for layer in range(n_layers):
        t0 = time.perf_counter()
        cfg = HybridConfig(layers=[layer], window=args.window, formulation="window")
        model, _ = load_stage(args.model_dir, "converted", hybrid=cfg, dtype=dtype)
        gaps = [tail_nll(model, s, args.tail) - r for s, r in zip(spans, ref)]
        rows.append({"layer": layer, "gap": sum(gaps) / len(gaps), "gaps": gaps})
        print(f"layer {layer:2d}: gap {rows[-1]['gap']:+.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
        del model

    rows.sort(key=lambda r: r["gap"])
    picked = sorted(r["layer"] for r in rows[: args.pick])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layers.json").write_text(json.dumps({"length": args.length, "tail": args.tail, "books": args.books,
                                                  "windows": args.windows, "base_nll": ref, "layers": rows,
                                                  "picked": picked}, indent=1) + "\n")
    print("cheapest", args.pick, "layers:", picked)


if __name__ == "__main__":
    main()
