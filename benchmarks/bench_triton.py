"""GPU benchmark of the triton backend: layer-level prefill and decode.

    python benchmarks/bench_triton.py                       # T = 2^10 .. 2^15, fwd and fwd+bwd, decode
    python benchmarks/bench_triton.py --tmax 13 --json results/bench_triton.json
    python benchmarks/bench_triton.py --no-decode --impls triton,sdpa
    python benchmarks/bench_triton.py --impls triton,triton_hedgehog,chunked_hedgehog --tmax 13
    python benchmarks/bench_triton.py --impls triton_hedgehog --no-decode --block 64   # try a block size

Prefill: B=1, H=32 query heads over 8 KV heads, D=64, bf16, window 64. Implementations:
- ``triton``: ``hybrid_attention_triton`` (reads the 8 KV heads directly);
- ``chunked``: the pure-PyTorch backend (k/v expanded to 32 heads, as its contract requires);
- ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True)`` (FlashAttention backend on H100);
- ``seed_naive``: the published recreation's unfold/cumsum style, skipped where its O(T*D^2)
  tensors would not fit in free memory;
- ``triton_hedgehog``: the triton backend with learned Hedgehog maps as a (query_map, key_map) pair
  (query map at 32 heads, key map at the 8 KV heads, F = 2 * D = 128): the maps run in torch, the
  kernels read their features; the time includes the maps (and, fwd+bwd, their parameter gradients);
- ``chunked_hedgehog`` (not in the default list): the same maps on the chunked backend;
- ``triton_decay``: ``triton`` with a decaying linear state (gamma 0.9995 per KV head, trained in the
  backward), and ``triton_recipe``: the default run's layer, the Hedgehog pair with the ``lolcats``
  formulation and that decay (neither in the default list).
Reported per case: median ms (``triton.testing.do_bench``), achieved GB/s and TFLOP/s from the
models below, and the fraction of the memory roofline: (minimal bytes / peak bandwidth) / time.
Minimal bytes = read q, k, v and write o (fwd); plus read q, k, v, o, dO and write dq, dk, dv (bwd),
with k/v at their stored head count (8 for triton, 32 for the others). Useful FLOPs of the hybrid
op = per query head and token 4*w*D (window) + 2*F*D (linear readout), plus 2*F*D per KV head and
token (state), F = D for elu1; Hedgehog adds its projections, 2*D*(F/2) per head and token for the
query and the key map; SDPA causal = 2*T^2*D per head; backward counted as 2.5x forward. The
Hedgehog rows keep the elu1 byte model (q, k, v, o), so their roofline fraction is against the
same target.
Peak bandwidth is looked up from the device name (H100 SXM 3.35 TB/s, H100 PCIe 2.0 TB/s,
H200 4.8 TB/s); an unknown device gets no roofline column and a flag in the output.

Decode: batch 64 (and 1), context 1K and 32K: the triton step (in place, as a generation loop
would run it, and functional) vs a softmax layer with a KV cache (append to a preallocated cache +
SDPA of one query over the context, GQA), and the triton step with the Hedgehog pair (F = 128;
its maps applied in torch to the new query and the evicted key). Tokens/s = batch / step time.

It needs CUDA; on a machine without it, it exits with a message and status 2. The one exception is
``--compile-only``: it compiles the bf16 kernels (elu1 at D = 64 and 128, and the feature-reading
variants at D = 64, F = 128; ``--features-only`` for those alone; ``--decay-only`` for the
decaying-state variants, ``DECAY`` on, of both) for sm_90 with triton's bundled ptxas, no GPU
needed, and prints their shared memory and register spills (a check that the kernels build for an
H100, not a measurement of speed). No numbers here are
made up: docs/triton.md records what a run printed, with the device name.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

PEAK_BW = {"H100 SXM": 3.35e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H200": 4.8e12, "GH200": 4.0e12}


def peak_bandwidth(name: str) -> float | None:
    for key in ("GH200", "H200", "H100 PCIe", "H100 SXM", "H100 80GB HBM3"):
        if key in name:
            return PEAK_BW[key]
    if "H100" in name:  # NVL / unknown H100 variant: assume SXM-class
        return PEAK_BW["H100 SXM"]
    return None


def prefill_bytes(T: int, H: int, HKV: int, D: int, elem: int, backward: bool) -> float:
    tok = T * D * elem
    fwd = (2 * H + 2 * HKV) * tok  # q, k, v in, o out
    if not backward:
        return fwd
    return fwd + (3 * H + 2 * HKV) * tok + (H + 2 * HKV) * tok  # q, o, dO, k, v in; dq, dk, dv out


def uses_hedgehog(impl: str) -> bool:
    """Whether the implementation runs the Hedgehog pair (F = 2 D features, maps trained in fwd+bwd)."""
    return impl.endswith("_hedgehog") or impl == "triton_recipe"


def prefill_flops(impl: str, T: int, H: int, HKV: int, D: int, w: int, backward: bool) -> float:
    if impl == "sdpa":
        f = 2.0 * T * T * D * H  # causal: half of 4 T^2 D
    else:
        hedgehog = uses_hedgehog(impl)
        F = 2 * D if hedgehog else D
        f = H * T * (4.0 * w * D + 2.0 * F * D) + HKV * T * 2.0 * F * D
        if hedgehog:
            f += (H + HKV) * T * 2.0 * D * (F // 2)  # the maps' projections
    return f * (3.5 if backward else 1.0)


def seed_naive_bytes(T: int, H: int, D: int, elem: int) -> float:
    # phi(k) v^T per position, its cumsum and the autograd copies: ~3 [B, H, T, D, D] tensors
    return 3.0 * H * T * D * D * elem


def compile_only(arch: int = 90) -> int:
    """Compile every kernel offline for ``sm_<arch>`` and report shared memory and ptxas spills."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from hybrid_llama.ops.triton import decode as dec
    from hybrid_llama.ops.triton import prefill as pre

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    f32 = "*fp32"
    io = {
        "q_ptr",
        "k_ptr",
        "v_ptr",
        "o_ptr",
        "do_ptr",
        "dq_ptr",
        "dk_ptr",
        "dv_ptr",
        "kw_ptr",
        "vw_ptr",
        "kw_new",
        "vw_new",
        "fq_ptr",
        "fk_ptr",
        "dfq_ptr",
        "dfk_ptr",
    }
    special = {"km_ptr": "*i8", "valid_ptr": "*i8", "ev_ptr": "*i8", "idx_ptr": "*i32", "sm_scale": "fp32"}

    def build(fn, consts: dict, warps: int, stages: int) -> None:
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in special:
                sig[name] = special[name]
            elif name in io:
                sig[name] = "*bf16"
            elif name.endswith(("_ptr", "_new")):
                sig[name] = f32
            else:
                sig[name] = "i32"
        k = triton_compile(
            ASTSource(fn, sig, constexprs=consts),
            target=GPUTarget("cuda", arch, 32),
            options=dict(num_warps=warps, num_stages=stages),
        )
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
            fh.write(k.asm["ptx"])
        r = subprocess.run(
            [ptxas, f"-arch=sm_{arch}a", "-v", fh.name, "-o", os.devnull], capture_output=True, text=True
        )
        os.unlink(fh.name)
        regs = re.findall(r"Used (\d+) registers", r.stdout + r.stderr)
        spill = re.findall(r"(\d+) bytes spill stores", r.stdout + r.stderr)
        print(
            f"{fn.__name__:17s} {consts}: warps={warps} stages={stages} shared={k.metadata.shared} B "
            f"registers={regs[0] if regs else '?'} spill_stores={spill[0] if spill else '?'} B",
            flush=True,
        )

    # (D, F, features): elu1 at D = 64 and 128, Hedgehog's F = 2 * D read as features at D = 64 (and
    # with --features-only, only those).
    variants = [(64, 64, False), (128, 128, False), (64, 128, True)]
    if "--features-only" in sys.argv[1:]:
        variants = [x for x in variants if x[2]]
    decay = "--decay-only" in sys.argv[1:]
    if decay:  # the decaying state at D = 64: elu1 and Hedgehog's features
        variants = [x for x in variants if x[0] == 64]
    for D, F, feats in variants:
        block = pre.default_block(D, F)
        launch = pre._launch(block, max(D, F))
        for lol in (False, True):
            c = dict(BLOCK=block, D=D, F=F, HAS_MASK=lol, LOLCATS=lol, FEATURES=feats, LINEAR=True, PREC="tf32",
                     DECAY=decay)
            for fn in (pre._fwd_kernel, pre._bwd_q_kernel, pre._bwd_kv_kernel):
                build(fn, c, launch["num_warps"], launch["num_stages"])
        c = dict(BLOCK=block, D=D, F=F, HAS_MASK=True, FEATURES=feats, PREC="tf32", DECAY=decay, AGED=decay)
        build(pre._kv_state_kernel, c, launch["num_warps"], launch["num_stages"])
        c = dict(BLOCK=block, D=D, F=F, FEATURES=feats, PREC="tf32", DECAY=decay)
        build(pre._q_state_kernel, c, launch["num_warps"], launch["num_stages"])
        c = dict(W=64, WP=64, D=D, F=F, EVICT=True, INPLACE=False, LOLCATS=False, FEATURES=feats, LINEAR=True,
                 DECAY=decay)
        build(dec._step_kernel, c, 8, 3)
    if decay:
        for aged in (False, True):
            build(pre._decay_scan_kernel, dict(REVERSE=not aged, AGED=aged, BLOCK_E=1024), 4, 3)
    return 0


def main() -> int:
    if "--compile-only" in sys.argv[1:]:
        return compile_only()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tmin", type=int, default=10, help="log2 of the smallest T")
    ap.add_argument("--tmax", type=int, default=15, help="log2 of the largest T")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--block", type=int, default=None, help="block_size of the triton prefill (default: the op's)")
    ap.add_argument(
        "--impls",
        default="triton,triton_hedgehog,chunked,sdpa,seed_naive",
        help="of triton, triton_hedgehog, triton_decay, triton_recipe, chunked, chunked_hedgehog, sdpa, seed_naive",
    )
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--json", default=None, help="also write all rows to this JSON file")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 offline (no GPU needed)")
    ap.add_argument(
        "--features-only", action="store_true", help="with --compile-only: only the Hedgehog-feature kernels"
    )
    ap.add_argument(
        "--decay-only", action="store_true", help="with --compile-only: only the decaying-state kernels (D = 64)"
    )
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print(
            "bench_triton.py needs a CUDA GPU (triton kernels); none is available here. Nothing measured.",
            file=sys.stderr,
        )
        return 2

    import torch.nn.functional as F
    import triton

    from hybrid_llama.ops import HedgehogFeatureMap
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked
    from hybrid_llama.ops.hybrid.seed_naive import hybrid_attention_seed_naive
    from hybrid_llama.ops.state import HybridState
    from hybrid_llama.ops.triton.decode import hybrid_attention_step_triton
    from hybrid_llama.ops.triton.prefill import hybrid_attention_triton

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    bw = peak_bandwidth(name)
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}")
    if bw is None:
        print(f"FLAG: unknown peak bandwidth for {name!r}: no roofline fraction reported")
    else:
        print(f"peak memory bandwidth assumed: {bw / 1e12:.2f} TB/s")
    B, H, HKV, D, w = 1, args.heads, args.kv_heads, args.head_dim, args.window
    dt = torch.bfloat16
    elem = 2
    rep = H // HKV
    impls = args.impls.split(",")
    rows: list[dict] = []
    # Hedgehog (query_map, key_map) pair as the model builds it: queries at H heads, keys at the KV heads.
    pair = (HedgehogFeatureMap(H, D).to(dev), HedgehogFeatureMap(HKV, D).to(dev))
    pair_params = [p for m in pair for p in m.parameters()]
    log_decay = torch.full((HKV,), math.log(0.9995), device=dev, requires_grad=True)

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100)

    def sdpa(q, k, v):
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError):
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
            )

    print("\n| impl | T | pass | ms | GB/s | TFLOP/s | roofline frac |")
    print("|---|---|---|---|---|---|---|")
    for lt in range(args.tmin, args.tmax + 1):
        T = 2**lt
        g = torch.Generator(device=dev).manual_seed(lt)
        q = torch.randn(B, H, T, D, device=dev, dtype=dt, generator=g)
        k = torch.randn(B, HKV, T, D, device=dev, dtype=dt, generator=g)
        v = torch.randn(B, HKV, T, D, device=dev, dtype=dt, generator=g)
        wl = torch.zeros(H, device=dev)
        ll = torch.zeros(H, device=dev)
        for impl in impls:
            kv_heads = HKV if impl.startswith("triton") or impl in ("sdpa", "chunked_hedgehog") else H
            if impl == "triton":
                fn = lambda q, k, v, wl, ll: hybrid_attention_triton(  # noqa: E731
                    q, k, v, wl, ll, window=w, block_size=args.block
                )[0]
            elif impl == "triton_hedgehog":
                fn = lambda q, k, v, wl, ll: hybrid_attention_triton(  # noqa: E731
                    q, k, v, wl, ll, window=w, feature_map=pair, block_size=args.block
                )[0]
            elif impl == "triton_decay":
                fn = lambda q, k, v, wl, ll: hybrid_attention_triton(  # noqa: E731
                    q, k, v, wl, ll, window=w, log_decay=log_decay, block_size=args.block
                )[0]
            elif impl == "triton_recipe":
                fn = lambda q, k, v, wl, ll: hybrid_attention_triton(  # noqa: E731
                    q, k, v, wl, ll, window=w, feature_map=pair, formulation="lolcats", log_decay=log_decay,
                    block_size=args.block,
                )[0]
            elif impl == "chunked_hedgehog":  # GQA k/v in place: the key map runs at the KV heads
                fn = lambda q, k, v, wl, ll: hybrid_attention_chunked(  # noqa: E731
                    q, k, v, wl, ll, window=w, feature_map=pair
                )[0]
            elif impl == "chunked":
                fn = lambda q, k, v, wl, ll: hybrid_attention_chunked(  # noqa: E731
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), wl, ll, window=w
                )[0]
            elif impl == "sdpa":
                fn = lambda q, k, v, wl, ll: sdpa(q, k, v)  # noqa: E731
            elif impl == "seed_naive":
                free, _ = torch.cuda.mem_get_info()
                if seed_naive_bytes(T, H, D, elem) > 0.8 * free:
                    print(
                        f"| seed_naive | {T} | - | does not fit "
                        f"({seed_naive_bytes(T, H, D, elem) / 2**30:.0f} GiB) | | | |"
                    )
                    continue
                fn = lambda q, k, v, wl, ll: hybrid_attention_seed_naive(  # noqa: E731
                    q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), wl, ll, window=w
                )[0]
            else:
                raise SystemExit(f"unknown impl {impl!r}")
            for backward in (False, True) if not args.no_backward else (False,):
                label = "fwd+bwd" if backward else "fwd"
                try:
                    if backward:
                        qg, kg, vg, wg, lg = (x.detach().requires_grad_() for x in (q, k, v, wl, ll))
                        do = torch.randn_like(q)

                        wrt = (qg, kg, vg, wg, lg) if impl != "sdpa" else (qg, kg, vg)
                        if uses_hedgehog(impl):
                            wrt = wrt + tuple(pair_params)  # training updates the maps too
                        if impl in ("triton_decay", "triton_recipe"):
                            wrt = wrt + (log_decay,)  # and the decay

                        def step():
                            out = fn(qg, kg, vg, wg, lg)
                            torch.autograd.grad(out, wrt, do)
                    else:

                        def step():
                            with torch.no_grad():
                                fn(q, k, v, wl, ll)

                    ms = bench(step)
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    print(f"| {impl} | {T} | {label} | OOM | | | |")
                    continue
                nbytes = prefill_bytes(T, H, kv_heads, D, elem, backward)
                flops = prefill_flops(impl, T, H, HKV, D, w, backward)
                frac = (nbytes / bw) / (ms * 1e-3) if bw else None
                row = dict(
                    kind="prefill",
                    impl=impl,
                    T=T,
                    pass_=label,
                    ms=ms,
                    gbps=nbytes / (ms * 1e-3) / 1e9,
                    tflops=flops / (ms * 1e-3) / 1e12,
                    roofline_frac=frac,
                )
                rows.append(row)
                fr = f"{frac:.2f}" if frac is not None else "n/a"
                print(f"| {impl} | {T} | {label} | {ms:.3f} | {row['gbps']:.0f} | {row['tflops']:.1f} | {fr} |")
        torch.cuda.empty_cache()

    if not args.no_decode:
        print("\n| decode impl | batch | context | ms/step | tokens/s |")
        print("|---|---|---|---|---|")
        for Bd in (int(x) for x in args.decode_batches.split(",")):
            for ctx in (1024, 32768):
                g = torch.Generator(device=dev).manual_seed(ctx + Bd)
                q1 = torch.randn(Bd, H, 1, D, device=dev, dtype=dt, generator=g)
                k1 = torch.randn(Bd, HKV, 1, D, device=dev, dtype=dt, generator=g)
                v1 = torch.randn(Bd, HKV, 1, D, device=dev, dtype=dt, generator=g)
                wl = torch.zeros(H, device=dev)
                ll = torch.zeros(H, device=dev)
                # The hybrid state's size does not depend on the context; only `seen` does.
                state = HybridState(
                    torch.randn(Bd, HKV, w, D, device=dev, dtype=dt, generator=g),
                    torch.randn(Bd, HKV, w, D, device=dev, dtype=dt, generator=g),
                    torch.ones(Bd, w, device=dev, dtype=torch.bool),
                    torch.rand(Bd, HKV, D, D, device=dev, generator=g) * ctx,
                    torch.rand(Bd, HKV, D, device=dev, generator=g) * ctx,
                    ctx,
                )
                for mode in ("inplace", "functional"):
                    inplace = mode == "inplace"
                    ms = bench(lambda: hybrid_attention_step_triton(q1, k1, v1, state, wl, ll, inplace=inplace))
                    rows.append(
                        dict(kind="decode", impl=f"triton-{mode}", batch=Bd, context=ctx, ms=ms, tok_s=Bd / (ms * 1e-3))
                    )
                    print(f"| triton step ({mode}) | {Bd} | {ctx} | {ms:.4f} | {Bd / (ms * 1e-3):.0f} |")
                if "triton_hedgehog" in impls:
                    # Hedgehog pair: state [F = 2D, D]; the maps run in torch on the query and the evicted key.
                    state_hh = HybridState(
                        state.k_window.clone(),
                        state.v_window.clone(),
                        state.window_valid.clone(),
                        torch.rand(Bd, HKV, 2 * D, D, device=dev, generator=g) * ctx,
                        torch.rand(Bd, HKV, 2 * D, device=dev, generator=g) * ctx,
                        ctx,
                    )
                    with torch.no_grad():  # the maps' parameters require grad; the step is inference-only
                        ms = bench(
                            lambda: hybrid_attention_step_triton(
                                q1, k1, v1, state_hh, wl, ll, feature_map=pair, inplace=True
                            )
                        )
                    rows.append(
                        dict(
                            kind="decode",
                            impl="triton-hedgehog-inplace",
                            batch=Bd,
                            context=ctx,
                            ms=ms,
                            tok_s=Bd / (ms * 1e-3),
                        )
                    )
                    print(
                        f"| triton step, Hedgehog pair (inplace) | {Bd} | {ctx} | {ms:.4f} | {Bd / (ms * 1e-3):.0f} |"
                    )
                try:
                    kc = torch.randn(Bd, HKV, ctx + 1, D, device=dev, dtype=dt, generator=g)
                    vc = torch.randn(Bd, HKV, ctx + 1, D, device=dev, dtype=dt, generator=g)

                    def softmax_step():
                        kc[:, :, ctx : ctx + 1].copy_(k1)  # append to the preallocated cache
                        vc[:, :, ctx : ctx + 1].copy_(v1)
                        return F.scaled_dot_product_attention(q1, kc, vc, enable_gqa=True)

                    ms = bench(softmax_step)
                    rows.append(
                        dict(
                            kind="decode", impl="softmax-kv-cache", batch=Bd, context=ctx, ms=ms, tok_s=Bd / (ms * 1e-3)
                        )
                    )
                    print(f"| softmax KV cache (SDPA) | {Bd} | {ctx} | {ms:.4f} | {Bd / (ms * 1e-3):.0f} |")
                    del kc, vc
                except torch.OutOfMemoryError:
                    print(f"| softmax KV cache (SDPA) | {Bd} | {ctx} | OOM | |")
                torch.cuda.empty_cache()

    _goals(rows, bw, args.tmax)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(device=name, peak_bw=bw, torch=torch.__version__, triton=triton.__version__, rows=rows),
                fh,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


def _goals(rows: list[dict], bw: float | None, tmax: int) -> None:
    """Print the GPU goals (docs/triton.md) next to what was measured (nothing is asserted)."""
    T = 2**tmax
    pick = lambda **kw: next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)  # noqa: E731
    tri = pick(kind="prefill", impl="triton", T=T, pass_="fwd")
    sd = pick(kind="prefill", impl="sdpa", T=T, pass_="fwd")
    print("\ngoals:")
    if tri and sd:
        print(f"- T={T} fwd speedup vs causal SDPA: {sd['ms'] / tri['ms']:.1f}x (goal >= 20x)")
    if tri and tri["roofline_frac"]:
        print(f"- T={T} fwd time / roofline time: {1 / tri['roofline_frac']:.2f}x (goal <= 2x)")
    for mode in ("inplace", "functional"):
        a = pick(kind="decode", impl=f"triton-{mode}", batch=64, context=1024)
        b = pick(kind="decode", impl=f"triton-{mode}", batch=64, context=32768)
        s = pick(kind="decode", impl="softmax-kv-cache", batch=64, context=32768)
        if a and b:
            print(f"- decode ({mode}) batch 64: 32K / 1K step time {b['ms'] / a['ms']:.2f} (goal <= 1.1)")
        if b and s:
            print(
                f"- decode ({mode}) batch 64, 32K: {b['tok_s'] / s['tok_s']:.1f}x softmax KV-cache tokens/s "
                "(goal >= 5x)"
            )


if __name__ == "__main__":
    sys.exit(main())
