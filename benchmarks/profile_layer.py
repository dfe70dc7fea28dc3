"""Per-layer cost of one hybrid attention layer against the softmax layer it replaces.

    python benchmarks/profile_layer.py                         # SmolLM2-135M's attention shape
    python benchmarks/profile_layer.py --model-dir resources/weights/smollm2 --layer 14
    python benchmarks/profile_layer.py --ops                   # also list the ops each call runs
    python benchmarks/profile_layer.py --native --sparse-cache 128 --sinks 4   # time each native kernel
    python benchmarks/profile_layer.py --device cuda --dtype bfloat16 --sparse-cache 128 --sinks 4 \
        --decay 0.9995 --prefill-lens 1024,8192 --decode-contexts 8192 --calls 20 --ops   # on a GPU

Both layers get the same weights (the hybrid owns copies, as ``convert_to_hybrid`` makes them) and
are called the way ``generate`` calls them: a prefill of ``T`` tokens into a fresh transformers
``DynamicCache``, then single-token decode steps from a cache holding ``C`` tokens. Calls are
interleaved (softmax, hybrid, softmax, ...) and the median per call is reported with the ratio
hybrid / softmax; a ratio above 1 is overhead the hybrid adds per layer and per call. ``--ops``
prints the number of aten ops per call and the most expensive ones (torch.profiler), which is
where a per-token constant comes from. ``--cold MB`` reads a buffer of that size before every timed
call, so each call starts with the caches holding other data, as in a whole model, where the
other layers' weights (hundreds of MB per decoded token) pass through the caches between two calls
of a layer: a layer that touches more small buffers pays for it there and not in a hot loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="take the config and one layer's weights from here")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--formulation", default="lolcats")
    ap.add_argument("--feature-map", default="hedgehog")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sparse-cache", type=int, default=0)
    ap.add_argument("--sinks", type=int, default=0)
    ap.add_argument("--decay", type=float, default=None, help="a decaying linear state with this gamma at init")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefill-lens", default="1,16,64,256,1024")
    ap.add_argument("--decode-contexts", default="1,32,256,1024,2048")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per case (prefill: a tenth)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ops", action="store_true", help="profile the ops of one call per case")
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="read this many MB before each timed call (evicts the layer's data, as a model does)")
    ap.add_argument("--native", action="store_true",
                    help="also give the time of each native CPU kernel per hybrid call (the rest is torch around them)")
    args = ap.parse_args(argv)

    from hybrid_llama.runtime import keep_freed_memory

    kept = keep_freed_memory()  # the allocator the pipeline's jobs run with (workflow/scripts/common.py)
    native_s: dict[str, float] = {}
    restore = _time_native_kernels(native_s) if args.native else (lambda: None)
    try:
        return _profile(args, kept, native_s)
    finally:
        restore()


def _profile(args, kept: bool, native_s: dict[str, float]) -> int:
    import torch
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from hybrid_llama.layers import HybridConfig
    from hybrid_llama.models import make_hybrid_attention

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model_dir:
        config = LlamaConfig.from_pretrained(args.model_dir)
    else:  # SmolLM2-135M's attention: 9 query heads, 3 KV heads, head_dim 64
        config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=1536, num_hidden_layers=30, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    softmax = LlamaAttention(config, args.layer).eval()
    if args.model_dir:
        from safetensors import safe_open

        prefix = f"model.layers.{args.layer}.self_attn."
        with safe_open(f"{args.model_dir}/model.safetensors", framework="pt") as f:
            softmax.load_state_dict({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    cfg = HybridConfig(layers=[args.layer], window=args.window, formulation=args.formulation,
                       feature_map=args.feature_map, sparse_cache=args.sparse_cache, sinks=args.sinks,
                       decay=args.decay)
    hybrid = make_hybrid_attention(softmax, cfg).eval().to(dev, dtype)
    softmax.to(dev, dtype)
    rope = LlamaRotaryEmbedding(config).to(dev)
    H = config.hidden_size
    layers = {"softmax": softmax, "hybrid": hybrid}

    def call(layer, x, pos, cache):
        pe = rope(x, pos)
        return layer(x, position_embeddings=pe, attention_mask=None, past_key_values=cache)

    def fresh_cache():
        return DynamicCache(config=config)

    def prefill_case(T: int):
        x = torch.randn(1, T, H, device=dev, dtype=dtype)
        pos = torch.arange(T, device=dev)[None]

        def run(layer):
            call(layer, x, pos, fresh_cache())
        return run

    def decode_case(C: int):
        caches = {}
        ctx = torch.randn(1, C, H, device=dev, dtype=dtype)
        for name, layer in layers.items():
            caches[name] = fresh_cache()
            call(layer, ctx, torch.arange(C, device=dev)[None], caches[name])
        x = torch.randn(1, 1, H, device=dev, dtype=dtype)

        def run(layer):
            # Step at position C again and again: the softmax cache grows by one key per call (the
            # step's cost at C + calls keys), the hybrid state stays one size, as in generation.
            name = "softmax" if layer is softmax else "hybrid"
            call(layer, x, torch.tensor([[C]], device=dev), caches[name])
        return run

    flush = torch.ones(args.cold * 2**18, device=dev) if args.cold else None  # MB of fp32
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:  # time the device's work, not only its launch
            torch.cuda.synchronize()

    def time_case(run, calls: int) -> dict[str, float]:
        times = {name: [] for name in layers}
        with torch.inference_mode():
            for layer in layers.values():  # warm up
                for _ in range(3):
                    run(layer)
            native_s.clear()
            for i in range(calls):
                order = list(layers.items()) if i % 2 == 0 else list(layers.items())[::-1]
                for name, layer in order:
                    if flush is not None:
                        flush.sum()
                    sync()
                    t0 = time.perf_counter()
                    run(layer)
                    sync()
                    times[name].append(time.perf_counter() - t0)
        return {name: statistics.median(t) * 1e6 for name, t in times.items()}

    def ops(run) -> str:
        from torch.profiler import ProfilerActivity, profile

        out = []
        with torch.inference_mode():
            for name, layer in layers.items():
                run(layer)
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    run(layer)
                    sync()
                events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
                top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]
                total = sum(e.count for e in events)
                out.append(f"    {name}: {total} aten calls (nested included); top self time: "
                           + ", ".join(f"{e.key[6:]} x{e.count} {e.self_cpu_time_total:.0f}us" for e in top))
                if cuda:  # the kernels: which run longest, and how many launches a call makes
                    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
                    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
                    out.append(f"    {name}: {sum(e.count for e in kernels)} device ops, "
                               f"{sum(e.self_device_time_total for e in kernels):.0f}us on the device; top: "
                               + ", ".join(f"{e.key[:48]} x{e.count} {e.self_device_time_total:.0f}us"
                                           for e in top))
        return "\n".join(out)

    print(f"torch {torch.__version__}, {args.threads} thread(s), freed memory kept in the heap: {kept}; hybrid {cfg}")
    print("\n| phase | tokens | softmax us | hybrid us | hybrid / softmax |\n|---|---|---|---|---|")
    cases = [("prefill", T, prefill_case(T), max(args.calls // 10, 5)) for T in _ints(args.prefill_lens)]
    cases += [("decode", C, decode_case(C), args.calls) for C in _ints(args.decode_contexts)]
    for phase, n, run, calls in cases:
        t = time_case(run, calls)
        print(f"| {phase} | {n} | {t['softmax']:.1f} | {t['hybrid']:.1f} | {t['hybrid'] / t['softmax']:.2f}x |",
              flush=True)
        if native_s:
            print("    hybrid's native kernels per call: "
                  + ", ".join(f"{name} {s / calls * 1e6:.1f}us" for name, s in sorted(native_s.items())), flush=True)
        if args.ops:
            print(ops(run), flush=True)
    return 0


def _time_native_kernels(seconds: dict[str, float]):
    """Make ``native.build.load`` hand out the kernel library with each kernel call timed into ``seconds``
    (summed per kernel name; the caller clears it before the timed calls). Returns what undoes it."""
    from hybrid_llama.ops.native import build

    load = build.load

    class Timed:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            fn = getattr(self._lib, name)
            if not name.startswith(("hybrid_", "softmax_")) or name.endswith(("_workspace", "_threads")):
                return fn

            def timed(*args):
                t0 = time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
            return timed

    build.load = lambda: None if load() is None else Timed(load())
    return lambda: setattr(build, "load", load)


if __name__ == "__main__":
    sys.exit(main())
