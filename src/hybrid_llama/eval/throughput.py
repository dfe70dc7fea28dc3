"""Prefill and decode throughput, and peak memory, versus prompt length.

For each variant and each prompt length L (an exact token count of random ids):

- prefill: ``model(ids[B, L], use_cache=True, logits_to_keep=1)``: builds the cache (KV for softmax
  layers, the constant-size ``HybridState`` for hybrid layers) and only the last position's logits;
- decode: from that cache, ``decode_tokens`` greedy steps of one token each.

Each repeat (a round) runs a fresh prefill then the decode; ``warmup`` untimed rounds come first;
the median over ``repeats`` is reported with its min and max. Within a round a phase counts its median
call (a decode phase: its median step, times the steps), so a call the machine interrupted neither
slows that round's time nor pulls its ratio to base towards 1. In a round every variant prefills the
same prompt in turn (several times over for prompts whose prefill takes less than
``prefill_min_s``), then the variants take turns at each decode step, so base and hybrid are
timed milliseconds apart; each variant's speed-up over base is the median of per-round ratios: on a
machine whose speed drifts, a ratio taken within one round is what can be trusted. GPU timings use
CUDA events read at the end of the round (the decode loop never syncs with the host, the argmax
token stays on the device); CPU timings use ``time.perf_counter``.

Peak memory: see ``hybrid_llama.eval.memory``; decoding: ``hybrid_llama.eval.decoding``; the
models compared: ``hybrid_llama.eval.throughput_variants``.

Out-of-memory at a length gives rows with ``status="oom"``; longer lengths of that variant are
``"skipped"``. Any other exception gives ``status="error"`` with the message in ``error``.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from hybrid_llama.eval.decoding import decode_step, decode_steps, greedy_decode, prefill
from hybrid_llama.eval.memory import PeakMemory
from hybrid_llama.eval.throughput_variants import (
    Variant,
    build_throughput_variants,
    seed_naive_available,
    triton_available,
)
from hybrid_llama.runtime import device_name, resolve_dtype

# re-exported: callers time and check decoding through this module
__all__ = ["COLUMNS", "PeakMemory", "build_throughput_variants", "decode_step", "decode_steps",
           "greedy_decode", "measure_throughput", "prefill", "seed_naive_available", "share_measurements",
           "triton_available", "write_csv"]

log = logging.getLogger(__name__)

# What one (variant, phase, length) measures; ``speedup*`` are paired with base round by round.
_MEASURED = ["tokens_per_s", "s_per_token", "time_s", "time_s_min", "time_s_max", "speedup", "speedup_min",
             "speedup_max", "peak_mem_bytes", "cache_bytes"]
COLUMNS = [
    "variant", "backend", "phase", "seq_len", "batch", *_MEASURED, "mem_method", "device", "device_name",
    "dtype", "repeats", "prefill_calls", "decode_tokens", "status", "error",
]

MAX_PREFILL_CALLS = 16  # per variant and round, for the shortest prompts (``prefill_min_s``)


# ---------------------------------------------------------------- timing


class _Clock:
    """Many short timed spans, read at the end of a round: on CUDA a pair of events per span on the
    stream (no host sync per decode step), on CPU ``time.perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list = []

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started) -> int:
        """Close the span ``start`` opened; its index, for :meth:`seconds`."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((started, end))
        else:
            self.spans.append(time.perf_counter() - started)
        return len(self.spans) - 1

    def seconds(self, index: int) -> float:
        span = self.spans[index]
        if self.cuda:
            span[1].synchronize()
            return span[0].elapsed_time(span[1]) / 1000.0
        return span


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

# ---------------------------------------------------------------- measurement


def _weights_nbytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _rotated(names: list[str], by: int) -> list[str]:
    """``names`` starting from its ``by``-th (mod its length): who goes first changes turn by turn."""
    shift = by % len(names) if names else 0
    return names[shift:] + names[:shift]


def _interleaved_round(models: dict[str, Any], ids: torch.Tensor, decode_tokens: int, device: torch.device,
                       mem: PeakMemory, prefill_calls: int = 1) -> tuple[dict[str, dict], dict[str, BaseException]]:
    """One round over ``models``, in their order: their prefills in turn (``prefill_calls`` times
    over, for prompts too short to time once), then the decode steps with the models taking turns at
    every step (who goes first rotates). A slow spell of the machine then lands on all of them within
    one call's time, instead of on whichever ran during it. Decode continues from the last prefill.

    Returns ``({name: {"prefill": (median s per prefill, growth), "decode": (median s per step x
    steps, growth), "cache_bytes": n}},
    {name: exception})``. A phase's growth is the most one of its calls raised the memory above its
    level just before the call (other models' caches are alive meanwhile and do not count)."""
    clock = _Clock(device)
    live: dict[str, list] = {}  # name -> [next token, cache]
    marks: dict[str, dict] = {}
    failed: dict[str, BaseException] = {}

    def timed(name: str, phase: str, call, *args):
        mem.reset()
        started = clock.start()
        try:
            result = call(*args)
        except Exception as exc:
            failed[name] = exc
            live.pop(name, None)
            _free(device)
            return None
        mark = marks.setdefault(name, {"prefill": [], "decode": [], "growth": dict.fromkeys(("prefill", "decode"), 0)})
        mark[phase].append(clock.stop(started))
        mark["growth"][phase] = max(mark["growth"][phase], mem.growth())
        return result

    for call in range(prefill_calls):
        for name in _rotated([name for name in models if name not in failed], call):
            live.pop(name, None)  # the previous call's cache goes before this one is built
            done = timed(name, "prefill", prefill, models[name], ids)
            if done is not None:
                live[name] = list(done)
                marks[name]["cache_bytes"] = cache_nbytes(done[1])
    for step in range(decode_tokens):
        for name in _rotated(list(live), step):
            done = timed(name, "decode", decode_step, models[name], *live[name])
            if done is not None:
                live[name] = list(done)
    # A phase's time in the round is its median call (a decode phase: the median step times its steps).
    # Whatever else the machine runs lands on single calls and only adds time: a sum would carry it
    # into both variants' times and pull their ratio towards 1, a median leaves it out.
    per_phase = {"prefill": 1, "decode": decode_tokens}
    results = {
        name: {**{phase: (statistics.median([clock.seconds(i) for i in mark[phase]]) * per_phase[phase],
                          mark["growth"][phase])
                  for phase in ("prefill", "decode")}, "cache_bytes": mark["cache_bytes"]}
        for name, mark in marks.items() if name in live
    }
    return results, failed


def _summarise(runs: list[dict], base_runs: list[dict] | None, *, n_tokens: dict[str, int], batch: int,
               weights: int) -> dict[str, dict]:
    """Median time per phase, its min/max, and the speed-up over base paired round by round."""
    out = {}
    for phase, n_tok in n_tokens.items():
        times = [r[phase][0] for r in runs]
        t = statistics.median(times)
        if base_runs is None:
            ratios = [1.0] * len(times)
        else:  # base ran in the same round, right before or after: a ratio per round, then its spread
            ratios = [b[phase][0] / r[phase][0] for r, b in zip(runs, base_runs)]
        out[phase] = {
            "tokens_per_s": batch * n_tok / t if t > 0 else float("nan"),
            "s_per_token": t / n_tok,
            "time_s": t,
            "time_s_min": min(times),
            "time_s_max": max(times),
            "speedup": statistics.median(ratios),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "peak_mem_bytes": weights + max(r[phase][1] for r in runs),
            "cache_bytes": runs[0]["cache_bytes"],
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
    prefill_min_s: float = 0.5,
    long_from: int | None = None,
    long_repeats: int | None = None,
    long_warmup: int = 0,
    long_variants: Collection[str] | None = None,
):
    """Tidy ``pandas.DataFrame`` (columns ``COLUMNS``), one row per variant x phase x length.

    ``variants`` maps a name to ``(model, tokenizer-or-None, backend label)`` or to a zero-argument
    callable returning it; every variant is built once, up front. The variants are interleaved: at each
    length, every round (``warmup`` untimed, then ``repeats`` timed) runs each variant's prefill on
    the same prompt, in an order that rotates from round to round, then their decode steps in turns
    (``_interleaved_round``), so a slow spell of the machine hits all of them alike. ``speedup`` is
    the median over rounds of base's time / the variant's time in that round (``speedup_min``/``_max``
    its spread), when a variant named ``base`` is measured.

    ``prefill_min_s``: a prompt whose prefill is quicker than this is prefilled several times per
    round (the variants taking turns, at most ``MAX_PREFILL_CALLS``, the count set by the slowest
    variant in the first round and written to ``prefill_calls``), and the time per call is reported:
    a single call of a few milliseconds is at the mercy of whatever else the machine does then.

    ``peak_mem_bytes`` is the variant's own weights plus the most its phase grew the process's memory
    (see :class:`PeakMemory`), so other loaded variants do not count. ``time_budget_s`` bounds each
    variant: once its own timed and untimed runs have taken that long, its longer lengths are
    ``skipped``.

    Long prompts (``long_from`` tokens or more) take ``long_repeats`` timed rounds after
    ``long_warmup`` untimed ones (the shorter lengths warmed the code up already), and only base and
    the ``long_variants`` run them (None: every variant); the others' rows there are ``skipped``.
    The CSV's ``repeats`` column says how many rounds each length took.
    """
    import pandas as pd

    dev = torch.device(device)
    tdtype = resolve_dtype(dtype)
    dname = device_name(dev)
    mem = PeakMemory(dev)
    lens = sorted({int(n) for n in seq_lens})
    rows: list[dict] = []

    def add(name, backend, length, status, phase_vals=None, error="", prefill_calls=1, repeats=repeats):
        for phase in ("prefill", "decode"):
            v = (phase_vals or {}).get(phase, {})
            rows.append({
                "variant": name, "backend": backend, "phase": phase, "seq_len": length, "batch": batch,
                **{c: v.get(c, float("nan")) for c in _MEASURED},
                "mem_method": mem.method, "device": str(dev), "device_name": dname,
                "dtype": str(tdtype).replace("torch.", ""), "repeats": repeats, "prefill_calls": prefill_calls,
                "decode_tokens": decode_tokens, "status": status, "error": error,
            })

    built: dict[str, tuple[Any, str]] = {}
    stopped: dict[str, str] = {}  # name -> why its longer lengths are skipped
    for name, spec in variants.items():
        backend = "?"
        try:
            model, _tok, backend = spec() if callable(spec) else spec
            built[name] = (model.to(device=dev, dtype=tdtype).eval(), backend)
        except Exception as exc:  # a variant that cannot be built must not sink the others
            if not _is_oom(exc):
                log.exception("variant %s could not be built", name)
            for n in lens:
                add(name, backend, n, "oom" if _is_oom(exc) else "error", error=f"{type(exc).__name__}: {exc}")
            _free(dev)
    weights = {name: _weights_nbytes(model) for name, (model, _) in built.items()}
    spent = dict.fromkeys(built, 0.0)
    gen = torch.Generator().manual_seed(seed)
    for n in lens:
        ids = torch.randint(0, _vocab(built), (batch, n), generator=gen).to(dev)
        long = long_from is not None and n >= long_from
        n_repeats, n_warmup = (long_repeats or repeats, long_warmup) if long else (repeats, warmup)
        timed = [name for name in built if not long or long_variants is None or name == "base" or name in long_variants]
        runs: dict[str, list[dict]] = {name: [] for name in timed if name not in stopped}
        calls = 1
        for r in range(n_warmup + n_repeats):
            order = _rotated([name for name in runs if name not in stopped], r)
            done, failed = _interleaved_round({name: built[name][0] for name in order}, ids, decode_tokens, dev, mem,
                                              prefill_calls=calls)
            for name, exc in failed.items():
                status = "oom" if _is_oom(exc) else "error"
                if status == "error":
                    log.error("variant %s failed at length %d", name, n, exc_info=exc)
                stopped[name] = f"after {status} at seq_len {n}"
                add(name, built[name][1], n, status, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            for name, once in done.items():
                spent[name] += once["prefill"][0] * calls + once["decode"][0]
                if r >= n_warmup:
                    runs[name].append(once)
            if r == 0 and done and prefill_min_s > 0:
                slowest = max(once["prefill"][0] for once in done.values())
                calls = min(MAX_PREFILL_CALLS, math.ceil(prefill_min_s / slowest)) if slowest > 0 else MAX_PREFILL_CALLS
        base = runs.get("base") if "base" in runs and len(runs.get("base", [])) == n_repeats else None
        for name, done in runs.items():
            if len(done) != n_repeats:
                continue
            paired = None if name == "base" or base is None else base
            vals = _summarise(done, paired, n_tokens={"prefill": n, "decode": decode_tokens}, batch=batch,
                              weights=weights[name])
            if name != "base" and base is None:
                for v in vals.values():
                    v.update(speedup=float("nan"), speedup_min=float("nan"), speedup_max=float("nan"))
            add(name, built[name][1], n, "ok", vals, prefill_calls=calls, repeats=n_repeats)
            log.info("%s L=%d prefill %.1f tok/s decode %.1f tok/s", name, n,
                     vals["prefill"]["tokens_per_s"], vals["decode"]["tokens_per_s"])
            if time_budget_s is not None and spent[name] > time_budget_s and name not in stopped:
                stopped[name] = f"time budget {time_budget_s}s used up"
        for name, reason in stopped.items():
            if name in built and not any(r["variant"] == name and r["seq_len"] == n for r in rows):
                add(name, built[name][1], n, "skipped", error=reason)
        for name in built:
            if name not in runs and name not in stopped:
                add(name, built[name][1], n, "skipped", error=f"lengths from {long_from} are measured for "
                    f"base and {sorted(long_variants or [])} only", repeats=n_repeats)
    rows.sort(key=lambda r: (list(variants).index(r["variant"]), r["seq_len"], r["phase"] != "prefill"))
    built.clear()
    _free(dev)
    return pd.DataFrame(rows, columns=COLUMNS)


def _vocab(built: dict[str, tuple[Any, str]]) -> int:
    return min((m.config.vocab_size for m, _ in built.values()), default=1)


def share_measurements(frame, same_as: dict[str, str]):
    """``frame`` plus a copy of ``source``'s rows for each ``label: source`` in ``same_as``: variants
    whose hybrid layers are the same code with the same settings run at one speed, measured once."""
    import pandas as pd

    copies = []
    for label, source in same_as.items():
        rows = frame[frame["variant"] == source].copy()
        rows["variant"] = label
        copies.append(rows)
    return pd.concat([frame, *copies], ignore_index=True) if copies else frame


def write_csv(df, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path
