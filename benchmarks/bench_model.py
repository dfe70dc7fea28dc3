"""Model-level throughput of the hybrid vs its base model, side by side in one process.

    python benchmarks/bench_model.py                              # GPU: Llama-3.2-1B architecture
    python benchmarks/bench_model.py --json results/bench_model.json
    python benchmarks/bench_model.py --device cpu --dtype float32 --model-dir resources/weights/smollm2 \
        --formulation lolcats --feature-map hedgehog --sparse-cache 128 --sinks 4 \
        --prefill-lens 4096,8192 --decode-context 8192 --decode-batch 1 --decode-tokens 16 \
        --base-softmax-layers                                            # CPU, real weights
    python benchmarks/bench_model.py --preset tiny --device cpu --dtype float32 --backends chunked \
        --prefill-lens 64,256 --decode-context 256 --decode-batch 2     # a CPU smoke run
    python benchmarks/bench_model.py --preset smollm2-135m --layers 0,1,2,6,8,10,11,13,14,16,18,20,22,24,29 \
        --formulation lolcats --feature-map hedgehog --sparse-cache 128 --sinks 4 \
        --hybrid '{"decay": 0.9995, "softmax_heads": [[18, 2], [20, 1]]}' --prefill-lens 1024,4096,8192 \
        --decode-context 8192                                   # the default run's recommended variant

The model is ``--model-dir`` (a model directory such as the pipeline's SmolLM2 weights) or a randomly
initialised model of ``--preset``'s architecture (default ``llama-3.2-1b``: 16 layers, 32 query / 8
KV heads, D = 64); speed does not depend on the weights. The hybrid variants convert ``--layers``
(default every even layer, the published recipe) with ``--formulation`` and ``--feature-map`` for each
named backend (``hybrid_<backend>``); with ``--sparse-cache N`` the same layers with a sparse cache of
N keys per KV head and ``--sinks`` sinks are measured as well (``sparse_<backend>``). ``base`` is the
unconverted model with SDPA and transformers' own KV cache. The hybrids' softmax layers
(``SoftmaxLlamaAttention``) append their keys in place and, on a CPU, decode one token over 1024 or
more keys with the native ``softmax_decode`` kernel; ``--base-softmax-layers`` adds
``base_softmax_layers``, base with every layer such a layer, so that the hybrid's ratio to it is what
linearization alone gives. Everything goes through
the pipeline's own throughput evaluation
(``hybrid_llama.eval.throughput``): the variants are interleaved round by round, prefill keeps the
last position's logits only, decode runs greedy steps from the prefill's cache.

Two sweeps:
- prefill at batch 1 over ``--prefill-lens`` (default 2^10 .. 2^15);
- decode at ``--decode-batch`` (16) with ``--decode-context`` (32768) tokens already in the cache.
  At batch 1 with a context among the prefill lengths, the prefill sweep's own decode rows serve.

It prints both tables and, for each hybrid variant, the three ratios the goals are set on: prefill
tokens/s at the longest length vs base, decode tokens/s at the decode context and batch vs base,
and cache bytes vs base at that context. The goals depend on the device (``GOALS``): on a GPU the
model-level goals of docs/triton.md, on a CPU those of docs/performance.md at 8192 tokens. A ratio
is ``nan`` where either side did not finish (status oom/error/skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from functools import partial
from pathlib import Path

GOALS = {
    "cuda": {"prefill_speedup": (">=", 1.3), "decode_speedup": (">=", 1.5), "cache_ratio": ("<=", 0.55)},
    "cpu": {"prefill_speedup": (">=", 1.25), "decode_speedup": (">=", 1.4), "cache_ratio": ("<=", 0.55)},
}


def _value(frame, variant: str, phase: str, seq_len: int, column: str) -> float:
    row = frame[(frame.variant == variant) & (frame.phase == phase) & (frame.seq_len == seq_len)]
    if len(row) != 1 or row.status.iloc[0] != "ok":
        return math.nan
    return float(row[column].iloc[0])


def _speedup(frame, variant: str, phase: str, seq_len: int) -> tuple[float, float, float]:
    """(median, min, max) of the per-round paired speed-up over base, or the ratio of tokens/s for
    frames without it (no spread then)."""
    if "speedup" in frame:
        got = tuple(_value(frame, variant, phase, seq_len, c) for c in ("speedup", "speedup_min", "speedup_max"))
        if not math.isnan(got[0]):
            return got
    r = _value(frame, variant, phase, seq_len, "tokens_per_s") / _value(frame, "base", phase, seq_len, "tokens_per_s")
    return r, r, r


def model_ratios(prefill, decode, *, prefill_len: int, decode_context: int) -> dict[str, dict[str, float]]:
    """Per hybrid variant: prefill/decode speed-ups and the cache-bytes ratio against ``base``, with
    the speed-ups' spread over the repeats."""
    out = {}
    for name in sorted(set(prefill.variant) | set(decode.variant)):
        if name == "base":
            continue
        pre = _speedup(prefill, name, "prefill", prefill_len)
        dec = _speedup(decode, name, "decode", decode_context)
        out[name] = {
            "prefill_speedup": pre[0],
            "decode_speedup": dec[0],
            "cache_ratio": _value(decode, name, "decode", decode_context, "cache_bytes")
            / _value(decode, "base", "decode", decode_context, "cache_bytes"),
            "prefill_spread": [pre[1], pre[2]],
            "decode_spread": [dec[1], dec[2]],
        }
    return out


def meets(goal: str, value: float, device: str = "cuda") -> str:
    op, bound = GOALS["cuda" if device.startswith("cuda") else "cpu"][goal]
    if math.isnan(value):
        return "not measured"
    ok = value >= bound if op == ">=" else value <= bound
    return f"{'meets' if ok else 'misses'} {op} {bound}"


def _with_softmax_layers(build_base):
    """Base whose every layer is the hybrid's softmax layer (``SoftmaxLlamaAttention``: KV cache and
    decode step): the hybrid's ratio to it is what linearization gives with the softmax layers held equal."""
    from hybrid_llama.layers import as_softmax_layers
    from hybrid_llama.models.convert import decoder_layers

    model, tok, backend = build_base()
    as_softmax_layers([block.self_attn for block in decoder_layers(model)])
    return model, tok, backend


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b", help="random-model preset (hybrid_llama.weights)")
    ap.add_argument("--model-dir", default=None, help="a model directory to measure instead of a random preset")
    ap.add_argument("--layers", default="even", help="hybrid layer indices, or 'even' (0, 2, 4, ...)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--formulation", default="hybrid", help="hybrid, lolcats or window")
    ap.add_argument("--feature-map", default="elu1", help="elu1 or hedgehog")
    ap.add_argument("--hybrid", default="{}",
                    help="further HybridConfig fields as JSON, e.g. the recommended variant's "
                    "'{\"decay\": 0.9995, \"softmax_heads\": [[18, 2], [20, 1]]}'")
    ap.add_argument("--sparse-cache", type=int, default=0, help="also measure a sparse cache of this many keys")
    ap.add_argument("--sinks", type=int, default=4, help="sink tokens of the sparse-cache variant")
    ap.add_argument("--backends", default="triton,chunked", help="hybrid backends to measure")
    ap.add_argument("--base-softmax-layers", action="store_true",
                    help="also measure base with every layer the hybrid's softmax layer (KV cache appended in "
                    "place, native decode step)")
    ap.add_argument("--prefill-lens", default=",".join(str(2**i) for i in range(10, 16)))
    ap.add_argument("--decode-context", type=int, default=32768)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None, help="also write tables and ratios to this JSON file")
    ap.add_argument("--csv", default=None, help="also write the rows as the pipeline's throughput CSV")
    args = ap.parse_args(argv)

    from hybrid_llama.runtime import keep_freed_memory

    # As every pipeline job does (workflow/scripts/common.py): the same allocator as the DAG's runs.
    print(f"freed memory kept in the heap: {keep_freed_memory()}")
    import torch

    from hybrid_llama.eval.throughput import build_throughput_variants, measure_throughput
    from hybrid_llama.weights import resolve_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_model.py: no CUDA device (use --device cpu with a small --preset for a smoke run)")
        return 2
    prefill_lens = _ints(args.prefill_lens)
    backends = tuple(b for b in args.backends.split(",") if b)
    common = dict(
        decode_tokens=args.decode_tokens, repeats=args.repeats, warmup=1, device=args.device, dtype=args.dtype
    )
    with tempfile.TemporaryDirectory(prefix="bench_model_") as tmp:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            model_dir = resolve_model({"kind": "random", "preset": args.preset, "seed": 0}, f"{tmp}/model")
        n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        layers = list(range(0, n_layers, 2)) if args.layers == "even" else _ints(args.layers)
        hybrid_cfg = {"layers": layers, "window": args.window, "formulation": args.formulation,
                      "feature_map": args.feature_map, **json.loads(args.hybrid)}
        variants = build_throughput_variants(model_dir, hybrid_cfg, args.device, args.dtype, backends)
        if args.sparse_cache:
            sparse = build_throughput_variants(
                model_dir, {**hybrid_cfg, "sparse_cache": args.sparse_cache, "sinks": args.sinks}, args.device,
                args.dtype, backends,
            )
            variants.update({k.replace("hybrid_", "sparse_"): f for k, f in sparse.items() if k != "base"})
        if args.base_softmax_layers:
            variants["base_softmax_layers"] = partial(_with_softmax_layers, variants["base"])
        prefill = measure_throughput(variants, seq_lens=prefill_lens, batch=1, **common)
        if args.decode_batch == 1 and args.decode_context in prefill_lens:
            decode = prefill  # the prefill sweep decoded from that very context already
        else:
            decode = measure_throughput(variants, seq_lens=[args.decode_context], batch=args.decode_batch, **common)

    ratios = model_ratios(prefill, decode, prefill_len=max(prefill_lens), decode_context=args.decode_context)
    device_name = str(prefill.device_name.iloc[0])
    cols = ["variant", "seq_len", "batch", "tokens_per_s", "speedup", "speedup_min", "speedup_max", "cache_bytes",
            "peak_mem_bytes", "status"]
    print(
        f"device: {device_name}  torch {torch.__version__}  model {args.model_dir or args.preset}  dtype {args.dtype}  "
        f"hybrid {hybrid_cfg}"
    )
    print("\nprefill (batch 1, last-position logits):")
    print(prefill[prefill.phase == "prefill"][cols].to_string(index=False))
    print(
        f"\ndecode (batch {args.decode_batch}, {args.decode_context} tokens of context, "
        f"{args.decode_tokens} greedy steps):"
    )
    print(decode[decode.phase == "decode"][cols].to_string(index=False))
    print()
    for name, r in ratios.items():
        for goal in GOALS["cpu"]:
            spread = r.get(goal.replace("speedup", "spread"), None) if goal.endswith("speedup") else None
            extra = f" (repeats {spread[0]:.2f}-{spread[1]:.2f})" if spread else ""
            print(f"{name:16s} {goal:16s} {r[goal]:8.3f}{extra}  {meets(goal, r[goal], args.device)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "device_name": device_name,
                    "torch": torch.__version__,
                    "args": vars(args),
                    "layers": layers,
                    "hybrid": hybrid_cfg,
                    "ratios": ratios,
                    "prefill": prefill.to_dict("records"),
                    "decode": decode.to_dict("records"),
                },
                fh,
                indent=1,
                default=str,
            )
        print(f"wrote {args.json}")
    if args.csv:
        import pandas as pd

        rows = prefill if decode is prefill else pd.concat([prefill, decode], ignore_index=True)
        rows.to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
