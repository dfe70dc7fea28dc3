"""What a decaying linear state (``log_decay``) costs the op, side by side in one process.

    python benchmarks/bench_decay.py                      # 512, 2048, 8192 tokens, 2 threads
    python benchmarks/bench_decay.py --lens 1024 --rounds 20 --threads 1 --log-decay -0.0005

Calls ``hybrid_attention`` (the dispatcher, so on the CPU the native prefill kernels) on one problem
at SmolLM2-135M's attention shape (9 query and 3 KV heads of 64, window 64, trained-looking Hedgehog
maps, fp32, no autograd), without and with the decay, alternating call by call and swapping the
order every round; without and with the sparse cache (128 keys, 4 sinks). Prints the median time of
each (the first round dropped) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from op_inputs import trained_maps  # noqa: E402

from hybrid_llama.ops import SparseCacheConfig, hybrid_attention  # noqa: E402

H, HK, D, W = 9, 3, 64, 64


def time_pair(q, k, v, maps, sparse: SparseCacheConfig | None, log_decay: torch.Tensor,
              rounds: int) -> tuple[float, float]:
    """Median seconds per call without and with ``log_decay`` (rounds alternate the order)."""
    wl, ll = torch.zeros(H), torch.zeros(H)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad():
        for r in range(rounds):
            for decayed in ((False, True) if r % 2 else (True, False)):
                t0 = time.perf_counter()
                hybrid_attention(q, k, v, wl, ll, window=W, formulation="lolcats", feature_map=maps, sparse=sparse,
                                 log_decay=log_decay if decayed else None)
                times[decayed].append(time.perf_counter() - t0)
    return statistics.median(times[False][1:]), statistics.median(times[True][1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="512,2048,8192", help="comma-separated prompt lengths")
    ap.add_argument("--rounds", type=int, default=12, help="alternations per length (6 at 8192 and beyond)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-decay", type=float, default=-1e-3, help="log gamma of every KV head")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    maps = trained_maps(H, HK, D)
    log_decay = torch.full((HK,), args.log_decay)
    for sparse in (None, SparseCacheConfig(128, 4)):
        for T in (int(x) for x in args.lens.split(",")):
            g = torch.Generator().manual_seed(T)
            q, k, v = (torch.randn(1, n, T, D, generator=g) for n in (H, HK, HK))
            plain, decayed = time_pair(q, k, v, maps, sparse, log_decay, args.rounds if T < 8192 else args.rounds // 2)
            print(f"{'sparse cache' if sparse else 'no cache    '} T={T}: {plain * 1e3:.2f} ms without the decay, "
                  f"{decayed * 1e3:.2f} ms with it ({decayed / plain:.3f}x)")


if __name__ == "__main__":
    main()
