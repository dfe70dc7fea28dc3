"""Continuing a cache by a suffix: at once (``hybrid_attention_continue``) vs token by token vs the
whole row recomputed, on an exported model.

    python benchmarks/bench_continuation.py results/smollm2/lolcats_retrieval/model \
        --prefix 550 --suffix 150 --rows 1 --repeats 5

The prefix goes through the model once into a cache; each timed call copies that cache per row
(``batch_repeat_interleave``) and runs the rows' suffixes through it (``at_once``, and ``stepped`` with
the layers' per-token loop forced), against one forward of the whole rows without a cache
(``whole``). It prints the median of ``--repeats`` timed calls of each, their ratios, and the largest
difference of the suffix's logits to the whole rows' (bf16 moves them by its rounding). One thread
unless ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hybrid_llama.eval.placement import cache_keyword
from hybrid_llama.eval.shared_prefix import copy_cache
from hybrid_llama.layers import hybrid_attention as layer_module
from hybrid_llama.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--prefix", type=int, default=550)
    ap.add_argument("--suffix", type=int, default=150)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    key = cache_keyword(model)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (1, args.prefix), generator=g)
    suffix = torch.randint(0, vocab, (args.rows, args.suffix), generator=g)
    whole_rows = torch.cat([prefix.expand(args.rows, -1), suffix], 1)

    with torch.no_grad():
        cache = DynamicCache()
        model(prefix, use_cache=True, **{key: cache})

        def continued() -> torch.Tensor:
            rows = copy_cache(cache, args.rows)
            return model(suffix, use_cache=True, **{key: rows}).logits

        def whole() -> torch.Tensor:
            return model(whole_rows, use_cache=False, logits_to_keep=args.suffix).logits

        def stepped() -> torch.Tensor:
            real = layer_module.continues_at_once
            layer_module.continues_at_once = lambda *a: False
            try:
                return continued()
            finally:
                layer_module.continues_at_once = real

        results = {}
        for name, fn in (("whole", whole), ("at_once", continued), ("stepped", stepped)):
            fn()  # warm-up
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t0)
            results[name] = (statistics.median(times), min(times), max(times), out.float())

    ref = results["whole"][3]
    print(f"{args.model_dir}: prefix {args.prefix}, suffix {args.suffix}, rows {args.rows}, {args.dtype}, "
          f"{args.threads} thread(s), {args.repeats} repeats")
    for name, (med, lo, hi, out) in results.items():
        print(f"  {name:8s} median {med:.3f} s (min {lo:.3f}, max {hi:.3f}); "
              f"{results['whole'][0] / med:.2f}x whole; max |logit - whole| {(out - ref).abs().max():.3f}")


if __name__ == "__main__":
    main()
