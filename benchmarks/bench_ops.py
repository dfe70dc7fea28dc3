"""Benchmark the hybrid attention op on CPU: time and peak memory per backend, plus decode steps.

    python benchmarks/bench_ops.py                      # T = 2^10 .. 2^15, B=1, H=9, D=64, fp32
    python benchmarks/bench_ops.py --tmin 10 --tmax 13 --threads 2 --mem-budget-gb 4

Every (backend, T) case runs in a fresh subprocess so that memory is measured alone:
- peak memory = the process's resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before the call) minus the resident set right before the call,
  i.e. the extra RAM the forward needed at its peak, the output included. The inputs are
  allocated before; a warm-up call on a small T runs first so that paging in library code and
  starting thread pools are not counted, and freed heap is returned (``malloc_trim``);
- time = median wall time of the following calls (forward only, ``torch.no_grad``); the first
  call is the memory measurement and serves as warm-up. The process CPU time of the same calls is
  recorded too: on a shared machine it is less sensitive to other processes than wall time.
A case is skipped (with the reason printed) when its estimated memory exceeds ``--mem-budget-gb``
or when the previous T of the same backend took longer than ``--max-call-s``.

Decode: states are prefilled with a context of 1K and of 32K tokens, then
``hybrid_attention_step`` (in place, as a generation cache runs it) is timed over ``--decode-steps``
tokens each (median per step), as a model runs it on the CPU (``backend="auto"``: the native step of
``ops/native/cpu_kernels.c``) and as the torch ops' step (``backend="torch"``); the paths and
contexts are interleaved in rounds of 10 steps so that load changes hit both alike). A softmax
KV-cache step (one query over the whole context, cache not grown) is timed alongside for contrast,
as SDPA and as the hybrid model's softmax layers run it (``ops/native/softmax_decode.py``, native), the two
alternating step by step.

The matmul floor: the best rate of an fp32 product of two 2048 x 2048 matrices on the same threads,
and for each T the op's FLOPs (``op_flops``: the window's and the linear state's work that any
algorithm must do) divided by it. ``chunked / floor`` is how far the backend is from doing only
that work at the machine's best matmul rate. ``chunked`` is the backend as a model runs it on the
CPU without autograd (the native recurrence of ``ops/native/prefill.py`` where it applies), ``torch``
the same backend's torch ops alone (what training runs).

GQA (``--gqa-kv-heads N``, replaces the runs above): the chunked backend on k/v with N KV heads,
native (phi(k), chunk states and carry once per KV head) against expand-then-chunked (k/v repeated
to H heads by ``expand_kv`` first, the former dispatcher path, the repeat timed too). Both run in
one process, interleaved call by call (order alternating), forward (``no_grad``) and
forward+backward, for each T of ``--gqa-ts``; medians over ``--gqa-reps`` calls:

    python benchmarks/bench_ops.py --gqa-kv-heads 3 --heads 9 --gqa-ts 2048,8192 --omp-wait-policy passive
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

BACKENDS = ("chunked", "torch", "reference", "sdpa", "seed_naive")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M).group(1))


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


def estimate_bytes(backend: str, B: int, H: int, T: int, D: int, window: int) -> float:
    """Rough peak of each backend (fp32), used only to skip cases that cannot fit."""
    if backend == "reference":  # several [B, H, T, T] tensors alive at once
        return 6 * 4.0 * B * H * T * T
    if backend == "seed_naive":  # phi(k) v^T per position and its cumsum: [B, H, T, D, D] twice
        return 2.5 * 4.0 * B * H * T * D * D
    return 12 * 4.0 * B * H * T * (D + window)  # chunked / sdpa: a few tensors of size T*D


def run_case(backend: str, B: int, H: int, T: int, D: int, window: int, threads: int, max_call_s: float) -> dict:
    """Runs inside the child process."""
    import torch
    import torch.nn.functional as F

    from hybrid_llama.ops import hybrid_attention
    from hybrid_llama.ops.hybrid.seed_naive import hybrid_attention_seed_naive

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)

    def make(T):
        q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
        wl, ll = torch.randn(H, generator=g), torch.randn(H, generator=g)
        return {
            # "chunked" is what a model runs on the CPU (the native recurrence of ops/native/prefill.py
            # where it applies), "torch" the chunked backend's torch ops alone
            "chunked": lambda: hybrid_attention(q, k, v, wl, ll, window=window, backend="chunked")[0],
            "torch": lambda: hybrid_attention(q, k, v, wl, ll, window=window, backend="torch")[0],
            "reference": lambda: hybrid_attention(q, k, v, wl, ll, window=window, backend="reference")[0],
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "seed_naive": lambda: hybrid_attention_seed_naive(q, k, v, wl, ll, window=window)[0],
        }[backend]

    with torch.no_grad():
        # Warm up on a small input first: the first call pages in library code and starts thread
        # pools, which would otherwise count as the op's memory. Then hand freed heap back.
        make(min(T, 4 * window))()
        gc.collect()
        _malloc_trim()
        fn = make(T)
        rss0 = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the high-water mark to the current resident set
        t0 = time.perf_counter()
        out = fn()
        first = time.perf_counter() - t0
        peak_kb = _status_kb("VmHWM") - rss0
        del out
        reps = max(1, min(5, int(max_call_s * 2 / max(first, 1e-3))))
        times, cpu = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {
        "ms": 1000 * statistics.median(times),
        "min_ms": 1000 * min(times),
        "cpu_ms": 1000 * statistics.median(cpu),
        "reps": reps,
        "peak_mb": peak_kb / 1024,
        "first_ms": 1000 * first,
    }


def run_decode(B: int, H: int, D: int, window: int, contexts: list[int], steps: int, threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from hybrid_llama.ops import hybrid_attention_step, prefill_state
    from hybrid_llama.ops.native.softmax_decode import softmax_decode

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    wl, ll = torch.randn(H, generator=g), torch.randn(H, generator=g)
    res = {}
    with torch.no_grad():
        states, caches = {}, {}
        # "auto" is what a model runs on the CPU (the native step, ops/native/cpu_kernels.c, where it applies),
        # "torch" the torch ops' in-place step it replaces.
        paths = ("auto", "torch")
        for ctx in contexts:
            k, v = (torch.randn(B, H, ctx, D, generator=g) for _ in range(2))
            for path in paths:
                states[ctx, path] = prefill_state(k, v, window=window)
            caches[ctx] = (k, v)
        times = {(ctx, path): [] for ctx in contexts for path in paths}
        sdpa = {ctx: [] for ctx in contexts}
        native_softmax = {ctx: [] for ctx in contexts}  # the hybrid model's softmax layers' step
        # Interleave the contexts and step paths in rounds of 10 steps so that load drift on a shared
        # machine hits all of them alike; the first round is warm-up.
        for rnd in range(steps // 10 + 1):
            for ctx in contexts:
                for path in paths:
                    for _ in range(10):
                        qt, kt, vt = torch.randn(3, B, H, 1, D, generator=g)
                        t0 = time.perf_counter()
                        # in place, as a generation cache steps (the cache owns its state)
                        _, states[ctx, path] = hybrid_attention_step(qt, kt, vt, states[ctx, path], wl, ll,
                                                                     backend=path, inplace=True)
                        if rnd:
                            times[ctx, path].append(time.perf_counter() - t0)
        # The softmax steps run apart: streaming a 150 MB cache would evict the hybrid state's
        # cache lines and skew the comparison between contexts.
        for ctx in contexts:
            for i in range(steps + 10):
                qt = torch.randn(B, H, 1, D, generator=g)
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(qt, *caches[ctx])
                t1 = time.perf_counter()
                softmax_decode(qt, *caches[ctx], D**-0.5)
                if i >= 10:
                    sdpa[ctx].append(t1 - t0)
                    native_softmax[ctx].append(time.perf_counter() - t1)
        for ctx in contexts:
            state, (k, _) = states[ctx, "auto"], caches[ctx]
            state_bytes = sum(x.numel() * x.element_size() for x in (state.k_window, state.v_window, state.S, state.z))
            res[ctx] = {
                "step_us": 1e6 * statistics.median(times[ctx, "auto"]),
                "torch_step_us": 1e6 * statistics.median(times[ctx, "torch"]),
                "sdpa_us": 1e6 * statistics.median(sdpa[ctx]),
                "native_softmax_us": 1e6 * statistics.median(native_softmax[ctx]),
                "state_kb": state_bytes / 1024,
                "kv_cache_kb": 2 * k.numel() * k.element_size() / 1024,
            }
    return res


def run_gqa(B: int, H: int, kv_heads: int, D: int, window: int, Ts: list[int], reps: int, backward: bool,
            threads: int) -> list[dict]:
    """Native GQA chunked vs expand-then-chunked, interleaved in one process (see the docstring)."""
    import torch

    from hybrid_llama.ops import expand_kv
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in Ts:
        q = torch.randn(B, H, T, D, generator=g)
        k, v = (torch.randn(B, kv_heads, T, D, generator=g) for _ in range(2))
        wl, ll = torch.randn(H, generator=g), torch.randn(H, generator=g)
        grad_out = torch.randn(B, H, T, D, generator=g)
        variants = {
            "native": lambda q, k, v: hybrid_attention_chunked(q, k, v, wl, ll, window=window)[0],
            "expanded": lambda q, k, v: hybrid_attention_chunked(q, *expand_kv(q, k, v), wl, ll, window=window)[0],
        }
        modes = ["fwd"] + (["fwd+bwd"] if backward else [])
        for mode in modes:
            def call(name):
                if mode == "fwd":
                    with torch.no_grad():
                        return variants[name](q, k, v)
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                out = variants[name](*leaves)
                out.backward(grad_out)
                return out

            # Check they agree, and warm up (first calls page in code and grow the heap).
            torch.testing.assert_close(call("native"), call("expanded"), atol=1e-5, rtol=1e-4)
            times = {name: [] for name in variants}
            cpu = {name: [] for name in variants}
            for r in range(reps):
                for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                    t0, c0 = time.perf_counter(), time.process_time()
                    call(name)
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
            row = {"T": T, "mode": mode}
            for name, ts in times.items():
                row[f"{name}_ms"] = 1000 * statistics.median(ts)
                row[f"{name}_min_ms"] = 1000 * min(ts)
                row[f"{name}_cpu_ms"] = 1000 * statistics.median(cpu[name])
            rows.append(row)
            print(f"  T={T:6d} {mode:8s} native {row['native_ms']:9.1f} ms (best {row['native_min_ms']:9.1f},"
                  f" cpu {row['native_cpu_ms']:9.1f})  expanded {row['expanded_ms']:9.1f} ms (best"
                  f" {row['expanded_min_ms']:9.1f}, cpu {row['expanded_cpu_ms']:9.1f})"
                  f"  expanded/native {row['expanded_ms'] / row['native_ms']:.2f}x", flush=True)
    return rows


def op_flops(B: int, H: int, T: int, D: int, window: int) -> float:
    """The op's own work, as matmul FLOPs (multiply-add = 2), elu1 (feature dim F = D): each query
    against its ``window`` keys (scores and weighted values, 4 D w), and the linear part's state
    update phi(k)^T [v, 1] plus the query's read phi(q)^T [S | z] (2 F (D + 1) each). Any algorithm
    must do this much; it is what the floor below is computed from."""
    F = D
    return B * H * T * (4.0 * D * window + 4.0 * F * (D + 1))


def chunked_flops(B: int, H: int, T: int, D: int, window: int, chunk: int = 64, slab: int = 1024) -> float:
    """The matmul FLOPs the ``chunked`` backend executes (ops/hybrid/chunked.py): each block of w queries
    against 2 w keys under a band mask (twice the window's work), and per chunk of C keys the
    increment phi(K)^T [V, 1], the prefix-sum matmul over a slab's chunks, the query's read of the
    state, and the intra-chunk causal product (C F + C (D + 1) per query)."""
    F, C = D, chunk
    per_token = 8.0 * D * window + 2 * F * (D + 1) * 2 + 2.0 * C * F + 2.0 * C * (D + 1)
    per_token += 2.0 * (min(slab, T) // C) * F * (D + 1) / C  # [nc, nc] @ [nc, F (D+1)] per slab of nc C keys
    return B * H * T * per_token


def run_matmul_floor(n: int, reps: int, threads: int) -> dict:
    """This CPU's fp32 matmul rate: the best of ``reps`` products of two n x n matrices."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.mm(a, b)  # warm-up: thread pools, page-in
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "best_s": best, "gflops": 2.0 * n**3 / best / 1e9}


def child(argv: list[str]) -> None:
    from hybrid_llama.runtime import keep_freed_memory

    keep_freed_memory()  # the allocator the pipeline's jobs run with (workflow/scripts/common.py)
    kind, payload = argv[0], json.loads(argv[1])
    out = {"case": run_case, "decode": run_decode, "gqa": run_gqa, "floor": run_matmul_floor}[kind](**payload)
    print("RESULT " + json.dumps(out))


def spawn(kind: str, payload: dict, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", kind, json.dumps(payload)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{kind} {payload} failed:\n{proc.stderr[-2000:]}")


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tmin", type=int, default=10, help="smallest T as a power of two")
    ap.add_argument("--tmax", type=int, default=15, help="largest T as a power of two")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--mem-budget-gb", type=float, default=4.0, help="skip cases estimated above this")
    ap.add_argument("--max-call-s", type=float, default=20.0, help="skip larger T once one call took longer")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--decode-contexts", default="1024,32768")
    ap.add_argument("--omp-wait-policy", choices=("passive", "active"), default=None,
                    help="set OMP_WAIT_POLICY for the measured processes (default: inherit). On a shared "
                         "machine 'passive' stops idle OpenMP threads from spinning against other processes")
    ap.add_argument("--gqa-kv-heads", type=int, default=None,
                    help="instead of the runs above: native GQA chunked vs expand-then-chunked, this many KV heads")
    ap.add_argument("--gqa-ts", default="2048,8192", help="sequence lengths of the GQA comparison")
    ap.add_argument("--gqa-reps", type=int, default=7, help="timed calls per variant (interleaved)")
    ap.add_argument("--gqa-no-backward", action="store_true", help="GQA comparison: forward only")
    ap.add_argument("--floor-n", type=int, default=2048, help="matrix size of the fp32 matmul floor")
    ap.add_argument("--json", help="also write all results to this file")
    args = ap.parse_args()

    if args.omp_wait_policy:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()  # children read it at start-up
    import torch

    threads = args.threads or torch.get_num_threads()
    B, H, D, w = args.batch, args.heads, args.head_dim, args.window
    backends = args.backends.split(",")
    passes = "forward only"
    if args.gqa_kv_heads:
        passes = "forward" if args.gqa_no_backward else "forward, forward+backward"
    print(f"# bench_ops: B={B} H={H} D={D} window={w} fp32, {passes}, torch {torch.__version__}, "
          f"{threads} threads, {os.cpu_count()} CPUs, {platform.machine()}")
    print(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"# OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print("# load average at start: {:.2f} {:.2f} {:.2f} (other processes share these cores)".format(*os.getloadavg()))
    if args.gqa_kv_heads:
        payload = dict(B=B, H=H, kv_heads=args.gqa_kv_heads, D=D, window=w,
                       Ts=[int(t) for t in args.gqa_ts.split(",") if t], reps=args.gqa_reps,
                       backward=not args.gqa_no_backward, threads=threads)
        print(f"# GQA: H={H} over H_kv={args.gqa_kv_heads}, {args.gqa_reps} interleaved calls per variant")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "gqa", json.dumps(payload)],
                              text=True, stdout=subprocess.PIPE)
        lines = proc.stdout.splitlines()
        rows = next(json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT "))
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("RESULT ")))
        print()
        print(
            "| T | pass | native ms | expand-then-chunked ms | expanded / native | best of calls: native / expanded ms"
            " | CPU time: native / expanded ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['T']} | {r['mode']} | {r['native_ms']:.1f} | {r['expanded_ms']:.1f} | "
                f"{r['expanded_ms'] / r['native_ms']:.2f}x | {r['native_min_ms']:.1f} / {r['expanded_min_ms']:.1f} | "
                f"{r['native_cpu_ms']:.1f} / {r['expanded_cpu_ms']:.1f} |"
            )
        print("\n# load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"gqa": rows}, fh, indent=1)
        return
    results: dict = {"prefill": {}, "decode": {}, "skipped": []}
    too_slow = set()
    for p in range(args.tmin, args.tmax + 1):
        T = 2**p
        row = results["prefill"].setdefault(T, {})
        for be in backends:
            est = estimate_bytes(be, B, H, T, D, w)
            if est > args.mem_budget_gb * 2**30:
                results["skipped"].append(
                    f"{be} T={T}: estimated {est / 2**30:.1f} GB > budget {args.mem_budget_gb} GB"
                )
                continue
            if be in too_slow:
                results["skipped"].append(f"{be} T={T}: T={T // 2} already took > {args.max_call_s} s per call")
                continue
            payload = dict(backend=be, B=B, H=H, T=T, D=D, window=w, threads=threads, max_call_s=args.max_call_s)
            try:
                r = spawn("case", payload, timeout=max(600, 20 * args.max_call_s))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                results["skipped"].append(f"{be} T={T}: failed ({str(exc).splitlines()[0][:200]})")
                continue
            row[be] = r
            if r["first_ms"] / 1000 > args.max_call_s:
                too_slow.add(be)
            print(
                f"  T={T:6d} {be:10s} {r['ms']:10.1f} ms (best {r['min_ms']:10.1f}, cpu {r['cpu_ms']:10.1f} ms)"
                f"  peak {r['peak_mb']:9.1f} MB"
                f"  ({r['reps']} reps)",
                flush=True,
            )

    def get(T, be, key):
        return results["prefill"][T].get(be, {}).get(key)

    print()

    def ratio(T, be, key="ms"):
        c, x = get(T, "chunked", key), get(T, be, key)
        return fmt(x / c, ".2f") + "x" if c and x else "-"

    print("Wall time per forward (median), ratios = other / chunked:")
    print()
    print(
        "| T | "
        + " | ".join(f"{be} ms" for be in backends)
        + " | SDPA / chunked | reference / chunked | seed_naive / chunked | SDPA / chunked (CPU time)"
        + " | SDPA / chunked (best of reps) |"
    )
    print("|---" * (len(backends) + 6) + "|")
    for T in results["prefill"]:
        print(
            f"| {T} | "
            + " | ".join(fmt(get(T, be, "ms")) for be in backends)
            + f" | {ratio(T, 'sdpa')} | {ratio(T, 'reference')} | {ratio(T, 'seed_naive')}"
            + f" | {ratio(T, 'sdpa', 'cpu_ms')} | {ratio(T, 'sdpa', 'min_ms')} |"
        )
    floor = spawn("floor", dict(n=args.floor_n, reps=10, threads=threads), timeout=600)
    results["matmul_floor"] = floor
    rate = floor["gflops"] * 1e9
    print()
    print(f"fp32 matmul floor: {floor['gflops']:.1f} GFLOP/s (best of 10 products of {floor['n']}x{floor['n']} "
          f"matrices, {threads} threads). Floor = the op's FLOPs at that rate; chunked / floor is the goal's ratio "
          "(<= 4x). The native recurrence does the op's FLOPs; the torch ops' own (banded, chunked) FLOPs are "
          "shown beside them:")
    print()
    print("| T | op GFLOP | floor ms | chunked ms | chunked / floor | torch ops ms | torch ops / floor "
          "| torch ops' executed GFLOP | their rate GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in results["prefill"]:
        ms, torch_ms = get(T, "chunked", "ms"), get(T, "torch", "ms")
        need, done = op_flops(B, H, T, D, w), chunked_flops(B, H, T, D, w)
        floor_ms = 1000 * need / rate
        results["prefill"][T]["floor"] = {"op_gflop": need / 1e9, "floor_ms": floor_ms,
                                          "torch_ops_gflop": done / 1e9}
        print(f"| {T} | {need / 1e9:.2f} | {floor_ms:.1f} | {fmt(ms)} | "
              f"{fmt(ms / floor_ms if ms else None, '.2f')}x | {fmt(torch_ms)} | "
              f"{fmt(torch_ms / floor_ms if torch_ms else None, '.2f')}x | {done / 1e9:.2f} | "
              f"{fmt(done / 1e6 / torch_ms if torch_ms else None)} |")
    print()
    print("Peak extra resident memory per forward (output included):")
    print()
    print("| T | " + " | ".join(f"{be} peak MB" for be in backends) + " |")
    print("|---" * (len(backends) + 1) + "|")
    for T in results["prefill"]:
        print(f"| {T} | " + " | ".join(fmt(get(T, be, "peak_mb")) for be in backends) + " |")
    if results["skipped"]:
        print()
        for s in results["skipped"]:
            print(f"- skipped {s}")

    contexts = [int(c) for c in args.decode_contexts.split(",") if c]
    if contexts and args.decode_steps > 0:
        payload = dict(B=B, H=H, D=D, window=w, contexts=contexts, steps=args.decode_steps, threads=threads)
        dec = spawn("decode", payload, timeout=1800)
        results["decode"] = dec
        print()
        print("| context | hybrid step us | torch-ops step us | hybrid state KB | softmax KV-cache step (SDPA) us "
              "| softmax KV-cache step (native) us | KV cache KB |")
        print("|---|---|---|---|---|---|---|")
        for ctx, r in dec.items():
            print(f"| {ctx} | {r['step_us']:.1f} | {r['torch_step_us']:.1f} | {r['state_kb']:.0f} | {r['sdpa_us']:.1f} "
                  f"| {r['native_softmax_us']:.1f} | {r['kv_cache_kb']:.0f} |")
        first, last = dec[str(contexts[0])], dec[str(contexts[-1])]
        print(f"\nhybrid step / softmax KV-cache step at {contexts[0]} context: "
              f"{first['step_us'] / first['sdpa_us']:.2f}x (goal <= 1.0x)")
        print(
            f"\nhybrid step time {contexts[-1]} / {contexts[0]} context: {last['step_us'] / first['step_us']:.2f}x "
            f"(softmax KV-cache step: {last['sdpa_us'] / first['sdpa_us']:.2f}x)"
        )
    print("\n# load average at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
