"""Model-level throughput of the hybrid vs its base model (the model-level GPU goals in docs/triton.md).

    python benchmarks/bench_model.py                              # GPU: Llama-3.2-1B architecture
    python benchmarks/bench_model.py --json results/bench_model.json
    python benchmarks/bench_model.py --preset tiny --device cpu --dtype float32 --backends chunked \\
        --prefill-lens 64,256 --decode-context 256 --decode-batch 2     # a CPU smoke run

A randomly initialised model of the preset's architecture (default ``llama-3.2-1b``: 16 layers,
32 query / 8 KV heads, D = 64) is built once; speed does not depend on the weights. The hybrid
variants convert ``--layers`` (default every even layer: 0, 2, ..., 14 for 16 layers, the published
recipe) with the named
backends; ``base`` is the unconverted model with SDPA. Everything goes through the pipeline's own
throughput evaluation (``hybrid_llama.eval.throughput``): prefill keeps the last position's logits
only, decode runs greedy steps from the prefill's cache.

Two sweeps, measured side by side in one process:
- prefill at batch 1 over ``--prefill-lens`` (default 2^10 .. 2^15);
- decode at ``--decode-batch`` (16) with ``--decode-context`` (32768) tokens already in the cache.

It prints both tables and, for each hybrid backend, the three ratios the issue sets goals for:
prefill tokens/s at the longest length vs base (goal >= 1.3), decode tokens/s at the decode
context and batch vs base (goal >= 1.5), and cache bytes vs base at that context (goal <= 0.55).
A ratio is ``nan`` where either side did not finish (status oom/error/skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile

GOALS = {"prefill_speedup": (">=", 1.3), "decode_speedup": (">=", 1.5), "cache_ratio": ("<=", 0.55)}


def _value(frame, variant: str, phase: str, seq_len: int, column: str) -> float:
    row = frame[(frame.variant == variant) & (frame.phase == phase) & (frame.seq_len == seq_len)]
    if len(row) != 1 or row.status.iloc[0] != "ok":
        return math.nan
    return float(row[column].iloc[0])


def model_ratios(prefill, decode, *, prefill_len: int, decode_context: int) -> dict[str, dict[str, float]]:
    """Per hybrid variant: prefill/decode tokens-per-second and cache-bytes ratios against ``base``."""
    out = {}
    for name in sorted(set(prefill.variant) | set(decode.variant)):
        if name == "base":
            continue
        out[name] = {
            "prefill_speedup": _value(prefill, name, "prefill", prefill_len, "tokens_per_s")
            / _value(prefill, "base", "prefill", prefill_len, "tokens_per_s"),
            "decode_speedup": _value(decode, name, "decode", decode_context, "tokens_per_s")
            / _value(decode, "base", "decode", decode_context, "tokens_per_s"),
            "cache_ratio": _value(decode, name, "decode", decode_context, "cache_bytes")
            / _value(decode, "base", "decode", decode_context, "cache_bytes"),
        }
    return out


def meets(goal: str, value: float) -> str:
    op, bound = GOALS[goal]
    if math.isnan(value):
        return "not measured"
    ok = value >= bound if op == ">=" else value <= bound
    return f"{'meets' if ok else 'misses'} {op} {bound}"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.2-1b", help="random-model preset (hybrid_llama.weights)")
    ap.add_argument("--layers", default="even", help="hybrid layer indices, or 'even' (0, 2, 4, ...)")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--backends", default="triton,chunked", help="hybrid backends to measure")
    ap.add_argument("--prefill-lens", default=",".join(str(2**i) for i in range(10, 16)))
    ap.add_argument("--decode-context", type=int, default=32768)
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None, help="also write tables and ratios to this JSON file")
    args = ap.parse_args(argv)

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
        model_dir = resolve_model({"kind": "random", "preset": args.preset, "seed": 0}, f"{tmp}/model")
        n_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
        layers = list(range(0, n_layers, 2)) if args.layers == "even" else _ints(args.layers)
        hybrid_cfg = {"layers": layers, "window": args.window}
        variants = build_throughput_variants(model_dir, hybrid_cfg, args.device, args.dtype, backends)
        prefill = measure_throughput(variants, seq_lens=prefill_lens, batch=1, **common)
        decode = measure_throughput(variants, seq_lens=[args.decode_context], batch=args.decode_batch, **common)

    ratios = model_ratios(prefill, decode, prefill_len=max(prefill_lens), decode_context=args.decode_context)
    device_name = str(prefill.device_name.iloc[0])
    cols = ["variant", "seq_len", "batch", "tokens_per_s", "cache_bytes", "peak_mem_bytes", "status"]
    print(
        f"device: {device_name}  torch {torch.__version__}  preset {args.preset}  dtype {args.dtype}  "
        f"hybrid layers {layers}"
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
        for goal, value in r.items():
            print(f"{name:16s} {goal:16s} {value:8.3f}  {meets(goal, value)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "device_name": device_name,
                    "torch": torch.__version__,
                    "args": vars(args),
                    "layers": layers,
                    "ratios": ratios,
                    "prefill": prefill.to_dict("records"),
                    "decode": decode.to_dict("records"),
                },
                fh,
                indent=1,
                default=str,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
