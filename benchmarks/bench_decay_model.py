"""Model-level: what the decaying linear state costs the recommended layout, side by side with base.

    python benchmarks/bench_decay_model.py                         # 1 .. 1024 tokens, 7 rounds
    python benchmarks/bench_decay_model.py --lens 256,512 --repeats 11

Builds base and the recommended variant's hybrid layout of ``config/config.yaml`` (its layers, window,
sparse cache, exact heads) once with its ``hybrid.decay`` and once without, on the pipeline's SmolLM2
weights (``resources/weights/smollm2``; speed does not depend on trained weights; ranked exact heads
from the run's ``results/smollm2/retrieval_heads.json``), and times all
three round by round with the pipeline's own throughput code (``measure_throughput``, fp32, batch
1, 16 decode steps). Prints each layout's prefill and decode ratio to base with the rounds' spread.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml
from snakemake.utils import validate

from hybrid_llama.config import SCHEMA_PATH
from hybrid_llama.eval.retrieval_heads import ranked_softmax_heads
from hybrid_llama.eval.throughput import build_throughput_variants, measure_throughput
from hybrid_llama.pipeline import Pipeline, path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="1,64,256,512,1024", help="comma-separated prompt lengths")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default=str(REPO / "resources/weights/smollm2"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    validate(cfg, str(SCHEMA_PATH))
    pipeline = Pipeline(cfg, REPO)
    # ranked heads (softmax_heads: {top: N}) come from the default run's ranking
    ranking = REPO / path("retrieval_heads", model="smollm2")
    hybrid = ranked_softmax_heads(pipeline.hybrid(pipeline.recommended()), ranking if ranking.is_file() else None)
    if not hybrid.get("decay"):
        raise SystemExit(f"the recommended variant {pipeline.recommended()} has no hybrid.decay to compare")
    layouts = {"decay": hybrid, "no_decay": {k: v for k, v in hybrid.items() if k != "decay"}}
    variants = {}
    for name, settings in layouts.items():
        for label, make in build_throughput_variants(args.weights, settings, "cpu", "float32",
                                                     backends=("chunked",)).items():
            variants["base" if label == "base" else f"{name}/{label}"] = make
    frame = measure_throughput(variants, seq_lens=[int(x) for x in args.lens.split(",")], decode_tokens=16,
                               repeats=args.repeats, warmup=1, prefill_min_s=1.0, device="cpu", dtype="float32",
                               batch=1, time_budget_s=1800, seed=0)
    print(frame[["variant", "phase", "seq_len", "speedup", "speedup_min", "speedup_max"]].to_string())


if __name__ == "__main__":
    main()
