"""Prefill and decode throughput, and peak memory, versus prompt length.

For each variant and each prompt length L (an exact token count of random ids):

- prefill: ``model(ids[B, L], use_cache=True, logits_to_keep=1)``: builds the cache (KV for softmax
  layers, the constant-size ``HybridState`` for hybrid layers) and only the last position's logits;
- decode: from that cache, ``decode_tokens`` greedy steps of one token each.

Each repeat runs a fresh prefill then the decode; ``warmup`` untimed repeats come first; the median
over ``repeats`` is reported. GPU timings use CUDA events (the decode loop never syncs with the host,
the argmax token stays on the device); CPU timings use ``time.perf_counter``.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` before each
phase. On CPU the process's resident-set high-water mark ``VmHWM`` from ``/proc/self/status``, reset to
the current RSS before each phase by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0); where that
is not permitted, ``ru_maxrss`` (lifetime peak, cannot be reset: only the first growth shows). Both
include the weights and whatever else the process holds; the column ``mem_method`` says which was used.

Out-of-memory at a length gives rows with ``status="oom"``; longer lengths of that variant are
``"skipped"``. Any other exception gives ``status="error"`` with the message in ``error``.
"""

from __future__ import annotations

import gc
import logging
import re
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybrid_llama.runtime import device_name, resolve_dtype

log = logging.getLogger(__name__)

COLUMNS = [
    "variant", "backend", "phase", "seq_len", "batch", "tokens_per_s", "s_per_token", "time_s", "time_s_min",
    "time_s_max",
    "peak_mem_bytes", "cache_bytes", "mem_method", "device", "device_name", "dtype", "repeats",
    "decode_tokens", "status", "error",
]

Variant = tuple[Any, Any, str]  # (model, tokenizer or None, backend label)


# ---------------------------------------------------------------- memory


def _read_hwm() -> int | None:
    try:
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        return int(m.group(1)) * 1024 if m else None
    except OSError:
        return None


class PeakMemory:
    """Resettable peak-memory probe: CUDA max allocated, or the CPU RSS high-water mark."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.method = "cuda_max_allocated"
        else:
            self.method = "rss_hwm" if self._clear_refs() and _read_hwm() is not None else "ru_maxrss"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # 5 = reset the peak RSS to the current RSS
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.method == "cuda_max_allocated":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == "rss_hwm":
            self._clear_refs()

    def peak(self) -> int:
        if self.method == "cuda_max_allocated":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.method == "rss_hwm":
            return int(_read_hwm())
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux


# ---------------------------------------------------------------- timing


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> _Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.seconds = self.start.elapsed_time(self.end) / 1000.0
        else:
            self.seconds = time.perf_counter() - self.t0


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a generation cache (KV tensors and hybrid states)."""
    from hybrid_llama.models import hybrid_cache_nbytes

    return int(hybrid_cache_nbytes(cache))


# ---------------------------------------------------------------- decode


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor):
    """Cache-building forward that keeps only the last position's logits: (next token [B, 1], cache)."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1), out.past_key_values


@torch.inference_mode()
def decode_steps(model, token: torch.Tensor, cache, n: int) -> torch.Tensor:
    """``n`` greedy steps from ``cache``, feeding ``token`` first; returns the n fed tokens [B, n]."""
    fed = []
    for _ in range(n):
        fed.append(token)
        out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    return torch.cat(fed, dim=1)


@torch.inference_mode()
def greedy_decode(model, input_ids: torch.Tensor, n: int, *, use_cache: bool = True) -> torch.Tensor:
    """``n`` greedily generated tokens [B, n]: with the cache (the benchmarked path) or by
    recomputing the whole sequence at every step (no cache), for checking one against the other."""
    if use_cache:
        token, cache = prefill(model, input_ids)
        return decode_steps(model, token, cache, n)
    seq = input_ids
    for _ in range(n):
        logits = model(input_ids=seq, use_cache=False).logits
        seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
    return seq[:, input_ids.shape[1] :]


# ---------------------------------------------------------------- measurement


def _measure_length(model, seq_len: int, *, batch: int, decode_tokens: int, repeats: int, warmup: int,
                    device: torch.device, mem: PeakMemory, gen: torch.Generator) -> dict[str, dict]:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)
    times = {"prefill": [], "decode": []}
    peaks = {"prefill": 0, "decode": 0}
    cache_bytes = None
    for r in range(warmup + repeats):
        timed = r >= warmup
        mem.reset()
        with _Timer(device) as tp:
            token, cache = prefill(model, ids)
        peak_p = mem.peak()
        if cache_bytes is None:
            cache_bytes = cache_nbytes(cache)
        mem.reset()
        with _Timer(device) as td:
            decode_steps(model, token, cache, decode_tokens)
        peak_d = mem.peak()
        del cache, token
        if timed:
            times["prefill"].append(tp.seconds)
            times["decode"].append(td.seconds)
            peaks["prefill"] = max(peaks["prefill"], peak_p)
            peaks["decode"] = max(peaks["decode"], peak_d)
    out = {}
    for phase, n_tok in (("prefill", seq_len), ("decode", decode_tokens)):
        t = statistics.median(times[phase])
        out[phase] = {
            "tokens_per_s": batch * n_tok / t if t > 0 else float("nan"),
            "s_per_token": t / n_tok,
            "time_s": t,
            # the spread of the timed repeats: how far a single median can be trusted
            "time_s_min": min(times[phase]),
            "time_s_max": max(times[phase]),
            "peak_mem_bytes": peaks[phase],
            "cache_bytes": cache_bytes,
        }
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_throughput(
    variants: dict[str, Variant | Callable[[], Variant]],
    *,
    seq_lens: list[int],
    decode_tokens: int = 32,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    batch: int = 1,
    time_budget_s: float | None = None,
    seed: int = 0,
):
    """Tidy ``pandas.DataFrame`` (columns ``COLUMNS``), one row per variant x phase x length.

    ``variants`` maps a name to ``(model, tokenizer-or-None, backend label)`` or to a zero-argument
    callable returning it; callables are built just before their variant is measured and released
    afterwards, so peak memory reflects one model at a time. ``time_budget_s`` bounds each variant:
    once its measurements have taken that long, longer lengths are ``skipped``.
    """
    import pandas as pd

    dev = torch.device(device)
    tdtype = resolve_dtype(dtype)
    dname = device_name(dev)
    mem = PeakMemory(dev)
    lens = sorted({int(n) for n in seq_lens})
    rows: list[dict] = []

    def add(name, backend, length, status, phase_vals=None, error=""):
        for phase in ("prefill", "decode"):
            v = (phase_vals or {}).get(phase, {})
            rows.append({
                "variant": name, "backend": backend, "phase": phase, "seq_len": length, "batch": batch,
                "tokens_per_s": v.get("tokens_per_s", float("nan")),
                "s_per_token": v.get("s_per_token", float("nan")),
                "time_s": v.get("time_s", float("nan")),
                "time_s_min": v.get("time_s_min", float("nan")),
                "time_s_max": v.get("time_s_max", float("nan")),
                "peak_mem_bytes": v.get("peak_mem_bytes", float("nan")),
                "cache_bytes": v.get("cache_bytes", float("nan")),
                "mem_method": mem.method, "device": str(dev), "device_name": dname,
                "dtype": str(tdtype).replace("torch.", ""), "repeats": repeats,
                "decode_tokens": decode_tokens, "status": status, "error": error,
            })

    for name, spec in variants.items():
        backend = "?"
        try:
            model, _tok, backend = spec() if callable(spec) else spec
            model = model.to(device=dev, dtype=tdtype).eval()
        except Exception as exc:  # a variant that cannot be built must not sink the others
            if not _is_oom(exc):
                log.exception("variant %s could not be built", name)
            for n in lens:
                add(name, backend, n, "oom" if _is_oom(exc) else "error", error=f"{type(exc).__name__}: {exc}")
            _free(dev)
            continue
        gen = torch.Generator().manual_seed(seed)
        started, stop = time.perf_counter(), None
        for n in lens:
            if stop is not None:
                add(name, backend, n, "skipped", error=stop)
                continue
            try:
                vals = _measure_length(model, n, batch=batch, decode_tokens=decode_tokens, repeats=repeats,
                                       warmup=warmup, device=dev, mem=mem, gen=gen)
                add(name, backend, n, "ok", vals)
                log.info("%s L=%d prefill %.1f tok/s decode %.1f tok/s", name, n,
                         vals["prefill"]["tokens_per_s"], vals["decode"]["tokens_per_s"])
            except Exception as exc:
                status = "oom" if _is_oom(exc) else "error"
                if status == "error":
                    log.exception("variant %s failed at length %d", name, n)
                add(name, backend, n, status, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                stop = f"after {status} at seq_len {n}"
                _free(dev)
            if stop is None and time_budget_s is not None and time.perf_counter() - started > time_budget_s:
                stop = f"time budget {time_budget_s}s used up"
        if callable(spec):
            del model
        _free(dev)
    return pd.DataFrame(rows, columns=COLUMNS)


def write_csv(df, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


# ---------------------------------------------------------------- variants


def triton_available(device: str | torch.device) -> bool:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401

        from hybrid_llama.ops import triton_prefill  # noqa: F401
    except Exception:
        return False
    return True


def seed_naive_available() -> bool:
    """True once the ops dispatcher accepts ``backend="seed_naive"`` (not just once the module exists)."""
    try:
        from hybrid_llama import ops
    except Exception:
        return False
    return "seed_naive" in getattr(ops, "BACKENDS", ())


def build_throughput_variants(
    model_dir: str | Path,
    hybrid_cfg: dict,
    device: str,
    dtype: str | torch.dtype,
    backends: tuple[str, ...] = ("chunked", "triton", "seed_naive"),
) -> dict[str, Callable[[], Variant]]:
    """Lazy variants for :func:`measure_throughput`: ``base`` (SDPA) and ``hybrid_<backend>``.

    Each is loaded fresh from ``model_dir`` (a plain Llama directory) when measured, converted with
    ``convert_to_hybrid(..., backend=<backend>)`` using ``hybrid_cfg`` (HybridConfig fields; ``layers``
    defaults to every layer). ``triton`` is left out without CUDA/triton, ``seed_naive`` while
    ``hybrid_llama.ops.BACKENDS`` does not list it.
    """
    from hybrid_llama.models import convert_to_hybrid, load_model

    tdtype = resolve_dtype(dtype)
    cfg = {k: v for k, v in dict(hybrid_cfg).items() if k != "backend"}

    def base() -> Variant:
        model, tok = load_model(model_dir, dtype=tdtype, device=device)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("sdpa")
        return model, tok, "sdpa"

    def hybrid(backend: str) -> Callable[[], Variant]:
        def build() -> Variant:
            model, tok = load_model(model_dir, dtype=tdtype, device=device)
            layers = cfg.get("layers") or list(range(model.config.num_hidden_layers))
            convert_to_hybrid(model, layers, **{k: v for k, v in cfg.items() if k != "layers"}, backend=backend)
            return model.to(device=device, dtype=tdtype).eval(), tok, backend
        return build

    out: dict[str, Callable[[], Variant]] = {"base": base}
    for b in backends:
        if b == "triton" and not triton_available(device):
            log.info("throughput: no triton variant (needs CUDA and triton)")
            continue
        if b == "seed_naive" and not seed_naive_available():
            log.warning("throughput: no seed_naive variant (hybrid_llama.ops does not accept backend='seed_naive')")
            continue
        recipe = (cfg.get("formulation", "hybrid"), cfg.get("feature_map", "elu1"))
        if b == "seed_naive" and recipe != ("hybrid", "elu1"):
            log.info("throughput: seed_naive implements only the recreation's formulation (hybrid, elu1)")
            continue
        out[f"hybrid_{b}"] = hybrid(b)
    return out
