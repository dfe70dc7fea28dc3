"""Retrieval ablations of the sparse cache on a trained hybrid, without retraining.

Loads one stage of a variant (base weights + transferred hybrid layers + LoRA adapter, as the
pipeline builds it), then, for each arm, sets the hybrid layers' third memory (sparse cache size,
sinks, score rule, or a wider plain window) and measures on the same prompts and texts:

- passkey accuracy at each length, teacher-forced (one forward per trial; a hit when greedy
  decoding would emit exactly the key's tokens first), for all needles and for those more than
  128 tokens before the question, with 95 % Wilson intervals;
- held-out NLL at a few context lengths (mean over the last ``--tail`` tokens of each window);
- the decode cache after a prompt of ``--cache-len`` tokens, in bytes, against the base model's.

    python benchmarks/bench_retrieval.py --weights resources/weights/smollm2 \\
        --layers results/smollm2/lolcats/transfer/hybrid_layers.safetensors \\
        --adapter results/smollm2/lolcats/lora --hybrid '{"layers": [0, 2, ...], ...}' \\
        --arms "lam0:0:0:sre,lam128:128:4:sre" --out benchmarks/out/retrieval.csv

An arm is ``name:size:sinks:score[:window]``; every number of a run comes from one process, so arms
compare side by side. Results are written as CSV (one row per arm and metric) and printed as a table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from pathlib import Path

import torch

from hybrid_llama.eval.passkey import needle_trials, teacher_forced_hit
from hybrid_llama.eval.placement import output_cache
from hybrid_llama.eval.tables import BEYOND_WINDOW, wilson_interval
from hybrid_llama.layers import HybridLlamaAttention
from hybrid_llama.models import hybrid_cache_nbytes
from hybrid_llama.stages import load_stage_for_eval


def set_memory(model, size: int, sinks: int, score: str, window: int | None) -> None:
    for m in model.modules():
        if isinstance(m, HybridLlamaAttention):
            changes = dict(sparse_cache=size, sinks=sinks, cache_score=score)
            if window:
                changes["window"] = window
            m.hybrid = dataclasses.replace(m.hybrid, **changes)


@torch.no_grad()
def heldout_nll(model, stream: torch.Tensor, lengths: list[int], tail: int, windows: int) -> dict[int, float]:
    out = {}
    for L in lengths:
        losses = []
        for i in range(windows):
            ids = stream[i * L : (i + 1) * L][None]
            logits = model(input_ids=ids).logits[0, -tail - 1 : -1].float()
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, -tail:]).item())
        out[L] = sum(losses) / len(losses)
    return out


@torch.no_grad()
def cache_bytes(model, tok, length: int) -> int:
    ids = torch.randint(100, tok.vocab_size - 1, (1, length))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    return hybrid_cache_nbytes(output_cache(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--layers", required=True, help="hybrid_layers.safetensors of the variant")
    ap.add_argument("--adapter", default=None, help="LoRA adapter directory (stage transfer_lora)")
    ap.add_argument("--hybrid", required=True, help="the variant's hybrid settings as JSON")
    ap.add_argument("--arms", required=True, help="comma-separated name:size:sinks:score[:window]")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--nll-lengths", default="64,512,2048")
    ap.add_argument("--nll-windows", type=int, default=4)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--heldout", default=None, help="packed tokens (.safetensors) to score NLL on; default: skip NLL")
    ap.add_argument("--cache-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    hybrid = json.loads(args.hybrid)
    stage = "transfer_lora" if args.adapter else "transfer"
    model, tok, _, _ = load_stage_for_eval(args.weights, stage, hybrid=hybrid, hybrid_layers=args.layers,
                                           adapter=args.adapter)
    base, _, _, _ = load_stage_for_eval(args.weights, "base")
    lengths = [int(x) for x in args.lengths.split(",")]
    trials = {L: needle_trials(tok, context_len=L, trials=args.trials, seed=args.seed) for L in lengths}
    stream = None
    if args.heldout:
        from hybrid_llama.data import load_packed

        stream = load_packed(args.heldout).flatten()
    rows = []

    def record(arm: str, metric: str, value: float, **extra) -> None:
        rows.append({"arm": arm, "metric": metric, "value": value, **extra})
        print(f"{arm:>14} {metric:>24} {value:10.4g} {extra if extra else ''}", flush=True)

    arms = [("base", None)] + [(a.split(":")[0], a.split(":")[1:]) for a in args.arms.split(",")]
    for name, spec in arms:
        t0 = time.perf_counter()
        if spec is None:
            m = base
        else:
            size, sinks, score, *window = spec
            set_memory(model, int(size), int(sinks), score, int(window[0]) if window else None)
            m = model
        for L in lengths:
            with torch.no_grad():
                hits = [teacher_forced_hit(m, t)[0] for t in trials[L]]
            for label, keep in (("all", lambda t: True), ("far", lambda t: t["needle_distance"] > BEYOND_WINDOW)):
                sel = [h for h, t in zip(hits, trials[L]) if keep(t)]
                lo, hi = wilson_interval(sum(sel), len(sel))
                record(name, f"passkey_{label}@{L}", sum(sel) / max(1, len(sel)), n=len(sel), ci_low=lo, ci_high=hi)
        if stream is not None:
            for L, nll in heldout_nll(m, stream, [int(x) for x in args.nll_lengths.split(",")], args.tail,
                                      args.nll_windows).items():
                record(name, f"nll@{L}", nll)
        record(name, f"cache_bytes@{args.cache_len}", cache_bytes(m, tok, args.cache_len))
        record(name, "seconds", time.perf_counter() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["arm", "metric", "value", "n", "ci_low", "ci_high"])
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
