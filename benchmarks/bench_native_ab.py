"""The sparse cache's native prefill with this checkout's kernels against another revision's, side by side.

    python benchmarks/bench_native_ab.py --against f8548e3                  # 512, 1024, 4096 tokens
    python benchmarks/bench_native_ab.py --against HEAD~1 --lens 300,2048 --rounds 20 --threads 1

Builds ``cpu_kernels.c`` as it is at ``--against`` (with its header, the flags and options this
checkout's build uses) next to this checkout's library, and calls ``hybrid_attention_sparse_cpu``
through each in turn, alternating call by call, on one problem at SmolLM2-135M's attention shape (9
query and 3 KV heads of 64, window 64, a cache of 128 keys and 4 sinks, trained-looking Hedgehog
maps, fp32). The revision's library must declare the same interface (``build.bind_declared``
refuses one that does not). Prints, per length, the median time of each and the median and
quartiles of the per-round ratio old / new, with causal SDPA over the same heads for scale; the two
outputs must agree to fp32 rounding.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
KERNELS = "src/hybrid_llama/ops/native"
sys.path.insert(0, str(REPO / "tests"))  # op_inputs: the kernels' tests' trained-looking maps


def build_revision(rev: str, directory: Path) -> ctypes.CDLL:
    """The kernel library as ``rev`` has it, compiled with this checkout's flags and options."""
    from hybrid_llama.ops.native import build

    if build.load() is None:
        raise SystemExit(f"no native kernels here: {build.why_not()}")
    for name in ("cpu_kernels.c", "cpu_kernels.h"):
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{KERNELS}/{name}"], capture_output=True,
                              check=True).stdout
        (directory / name).write_bytes(text)
    target = directory / "cpu_kernels_old.so"
    cmd = ["cc", *build.FLAGS, *build.built_with, "-o", str(target), str(directory / "cpu_kernels.c"), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return build.bind_declared(ctypes.CDLL(str(target)))


def problem(T: int, seed: int = 0):
    from op_inputs import trained_maps

    g = torch.Generator().manual_seed(seed)
    H, Hk, D = 9, 3, 64
    q, k, v = (torch.randn(1, T, h, D, generator=g).transpose(1, 2) for h in (H, Hk, Hk))
    return q, k, v, torch.randn(H, generator=g), torch.randn(H, generator=g), trained_maps(H, Hk, D)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="a git revision whose cpu_kernels.c is the baseline")
    ap.add_argument("--lens", default="512,1024,4096")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hybrid_llama.ops import SparseCacheConfig
    from hybrid_llama.ops.native import build
    from hybrid_llama.ops.native import sparse_prefill as sp

    cache = SparseCacheConfig(128, 4, "sre")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": build_revision(args.against, Path(tmp)), "new": build.load()}
        real_load = sp.build.load
        try:
            for T in (int(x) for x in args.lens.split(",")):
                q, k, v, wl, ll, maps = problem(T)

                def sparse(lib):
                    sp.build.load = lambda: lib
                    return sp.hybrid_attention_sparse_cpu(q, k, v, wl, ll, window=64, cache=cache, feature_map=maps,
                                                          output_final_state=True)[0]

                def sdpa(_):
                    return F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                          is_causal=True)

                runs = {"old": sparse, "new": sparse, "sdpa": sdpa}
                times = {name: [] for name in runs}
                with torch.no_grad():
                    torch.testing.assert_close(sparse(libs["new"]), sparse(libs["old"]), atol=1e-5, rtol=1e-4)
                    for _ in range(args.rounds):
                        for name, run in runs.items():
                            start = time.perf_counter()
                            run(libs.get(name))
                            times[name].append(time.perf_counter() - start)
                ratios = sorted(o / n for o, n in zip(times["old"], times["new"]))
                quart = len(ratios) // 4
                ms = {name: round(1000 * statistics.median(t), 2) for name, t in times.items()}
                print(f"T={T}: median ms {ms}; old/new {statistics.median(ratios):.3f} "
                      f"(quartiles {ratios[quart]:.3f}-{ratios[-1 - quart]:.3f}, {args.rounds} rounds)", flush=True)
        finally:
            sp.build.load = real_load
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
