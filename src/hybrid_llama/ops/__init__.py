"""Hybrid attention: sliding-window softmax + linear attention over the keys that left the window.

Public API (contract in docs/design.md, section "ops"):

- ``hybrid_attention(q, k, v, window_logit, linear_logit, *, window, backend, formulation,
  feature_map, key_padding_mask, output_final_state)``: the parallel (prefill / training) op; like
  every backend it returns ``(o, final_state)``, the state only when asked for (from the same pass).
- ``hybrid_attention_step(q, k, v, state, window_logit, linear_logit, *, ...)``: one decode step.
- ``prefill_state``, ``window_prompt_state``, ``init_state``, ``HybridState``: the recurrent state for decoding.

Backends: ``reference`` (readable, O(T^2)), ``chunked`` (on the CPU without autograd the native
recurrence of ``cpu_prefill`` where it applies, else PyTorch ops, O(T*w*D + T*D^2); ``torch`` forces
the PyTorch ops),
``triton`` (CUDA kernels, loaded lazily from ``triton_prefill`` / ``triton_decode``), ``auto``
(triton on CUDA when it imports and supports the options, else chunked; a fallback on CUDA is
logged once with its reason), and ``seed_naive`` (the
published recreation's O(T*D^2)-memory style, a benchmark baseline: prefill only, elu1 + hybrid
formulation without padding; its decode step is the torch step).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import cpu_prefill, cpu_sparse, cpu_step, sparse_batched
from .decode import hybrid_attention_step_torch
from .feature_maps import FeatureMap, HedgehogFeatureMap, elu1, is_elu1, resolve_qk_maps
from .gqa import expand_kv
from .reference import check_inputs, hybrid_attention_reference
from .sparse_cache import CACHE_SCORES, SparseCacheConfig, hybrid_attention_sparse, softmax_prompt_state
from .sparse_decode import hybrid_attention_step_sparse, init_sparse_state
from .sparse_reference import hybrid_attention_sparse_reference
from .state import HybridState, init_state, prefill_state, window_prompt_state

__all__ = [
    "hybrid_attention",
    "causal_softmax",
    "is_softmax_prompt",
    "SOFTMAX_PROMPT_BACKENDS",
    "expand_kv",
    "hybrid_attention_step",
    "native_step_in_place",
    "prefill_state",
    "window_prompt_state",
    "softmax_prompt_state",
    "init_state",
    "HybridState",
    "HedgehogFeatureMap",
    "elu1",
    "BACKENDS",
    "CACHE_SCORES",
    "SparseCacheConfig",
    "init_sparse_state",
]

BACKENDS = ("auto", "reference", "chunked", "triton", "seed_naive")
logger = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


def _load_triton(module: str, attr: str) -> tuple[Callable | None, str]:
    """Import a triton entry point lazily; return (function or None, reason it is missing)."""
    try:
        mod = importlib.import_module(f"{__name__}.{module}")
        return getattr(mod, attr), ""
    except Exception as exc:  # ImportError, missing triton, no CUDA driver, missing attribute...
        return None, f"{type(exc).__name__}: {exc}"


def _fall_back(op: str, reason: str) -> None:
    """Say once per (op, reason) that ``auto`` did not take the triton kernels, and why."""
    if (op, reason) not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add((op, reason))
        logger.warning("hybrid_attention%s: backend 'auto' falls back to torch on CUDA: %s", op, reason)


def _triton_or_fallback(module: str, attr: str, backend: str, op: str) -> Callable | None:
    """The triton entry point for ``backend`` 'triton' (raises if missing) or 'auto' (None, logged)."""
    fn, why = _load_triton(module, attr)
    if fn is None:
        if backend == "triton":
            raise RuntimeError(f"backend='triton' is unavailable{op and ' for ' + op.strip('_')} ({why})")
        _fall_back(op, why)
    return fn


def _check_backend(backend: str) -> None:
    # besides BACKENDS: "torch", the chunked backend's PyTorch ops with the native kernels left out
    if backend not in BACKENDS + ("torch",):
        raise ValueError(f"backend must be one of {BACKENDS + ('torch',)}, got {backend!r}")


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    window: int = 64,
    backend: str = "auto",
    formulation: str = "hybrid",
    feature_map: FeatureMap = "elu1",
    key_padding_mask: Tensor | None = None,
    output_final_state: bool = False,
    sparse_cache: int = 0,
    sinks: int = 0,
    cache_score: str = "sre",
) -> tuple[Tensor, HybridState | None]:
    """Hybrid attention: q ``[B, H, T, D]``, k/v ``[B, H_kv, T, D]`` (GQA, H % H_kv == 0, or H_kv = H).

    ``sparse_cache`` (λ keys per KV head), ``sinks`` (pinned first positions) and ``cache_score``
    add the third memory of ``sparse_cache`` (``lolcats`` formulation only); 0 and 0 leave the op
    as it is. Its triton path falls back to torch, and says so.

    Returns ``(o, final_state)``: o ``[B, H, T, D]`` in q's dtype, and with ``output_final_state``
    the ``HybridState`` after the T tokens (what ``hybrid_attention_step`` continues from), else
    None. The triton kernels and the chunked backend read the KV heads in place; reference repeats
    them itself, seed_naive gets them repeated here."""
    kwargs = dict(window=window, formulation=formulation, feature_map=feature_map, key_padding_mask=key_padding_mask,
                  output_final_state=output_final_state)
    _check_backend(backend)
    cache = sparse_cache_config(sparse_cache, sinks, cache_score, formulation)
    if (backend in SOFTMAX_PROMPT_BACKENDS and key_padding_mask is None and is_softmax_prompt(q.shape[2], window, cache)
            and not (output_final_state and cache.state_needs_queries)):
        check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask)
        resolve_qk_maps(feature_map)  # rejects unknown maps, as the other paths do
        return _softmax_only(q, k, v, window=window, feature_map=feature_map, cache=cache,
                             output_final_state=output_final_state)
    if cache.active:
        return _sparse(q, k, v, window_logit, linear_logit, cache, backend, **kwargs)
    if backend == "reference":
        return hybrid_attention_reference(q, k, v, window_logit, linear_logit, **kwargs)
    if backend == "seed_naive":
        if formulation != "hybrid" or not is_elu1(feature_map) or key_padding_mask is not None:
            raise ValueError("backend='seed_naive' supports only formulation='hybrid', feature_map='elu1', no padding")
        from .seed_naive import hybrid_attention_seed_naive

        o, _ = hybrid_attention_seed_naive(q, *expand_kv(q, k, v), window_logit, linear_logit, window=window)
        # The decode state stays at the KV heads, as the step reads it.
        return o, prefill_state(k, v, window=window) if output_final_state else None
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        fn = _triton_or_fallback("triton_prefill", "hybrid_attention_triton", backend, "")
        if fn is not None:
            if backend == "triton":
                return fn(q, k, v, window_logit, linear_logit, **kwargs)
            try:
                return fn(q, k, v, window_logit, linear_logit, **kwargs)
            except NotImplementedError as exc:  # an option the kernel does not cover
                _fall_back("", f"{exc}")
    if backend in ("auto", "chunked") and cpu_prefill.covers(q, k, window, formulation, key_padding_mask):
        check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask)
        done = cpu_prefill.hybrid_attention_cpu(q, k, v, window_logit, linear_logit, window=window,
                                                formulation=formulation, feature_map=feature_map,
                                                output_final_state=output_final_state)
        if done is not None:
            return done
    from .chunked import hybrid_attention_chunked

    # GQA k/v go in as they are: chunked reads the KV heads in place (and expands them itself for a
    # per-head callable feature map).
    return hybrid_attention_chunked(q, k, v, window_logit, linear_logit, **kwargs)


# Backends whose prompts inside the window are torch's causal SDPA (``causal_softmax``).
SOFTMAX_PROMPT_BACKENDS = ("auto", "chunked", "torch")


def causal_softmax(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The op on a prompt of T <= window tokens without padding, q ``[B, H, T, D]``, k/v ``[B, H_kv, T,
    D]``: no key has left the window, so every formulation is causal softmax attention (the linear
    part, the sparse cache and the mixing gates cancel out), which torch's SDPA computes."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def is_softmax_prompt(T: int, window: int, cache: SparseCacheConfig) -> bool:
    """Whether a prompt of T real tokens is causal softmax (``causal_softmax``): inside the window, or,
    at inference, within the sparse cache's ``softmax_prompt_len``. Under autograd only the window
    counts: past it the sparse op's exact zero gradients for the mixing logits and maps are its own
    rounding, which an optimizer would still act on, so training keeps what it computed before."""
    return T <= window or (T <= cache.softmax_prompt_len(window) and not torch.is_grad_enabled())


def _softmax_only(q: Tensor, k: Tensor, v: Tensor, *, window: int, feature_map: FeatureMap, cache: SparseCacheConfig,
                  output_final_state: bool) -> tuple[Tensor, HybridState | None]:
    """``causal_softmax`` and, on request, the state after the prompt."""
    o = causal_softmax(q, k, v)
    if not output_final_state:
        return o, None
    return o, softmax_prompt_state(k, v, window=window, cache=cache, feature_map=feature_map)


def sparse_cache_config(size: int, sinks: int, score: str, formulation: str) -> SparseCacheConfig:
    """The sparse cache's settings, checked; it is defined for the shared normalizer only."""
    cache = SparseCacheConfig(size, sinks, score)
    if cache.active and formulation != "lolcats":
        raise ValueError(
            f"sparse_cache/sinks need formulation='lolcats' (one normalizer shared by the exact keys and the linear "
            f"state); got formulation={formulation!r}"
        )
    return cache


def _sparse(q, k, v, window_logit, linear_logit, cache: SparseCacheConfig, backend: str, **kwargs):
    check_inputs(q, k, v, window_logit, linear_logit, kwargs["window"], "lolcats", kwargs["key_padding_mask"])
    kwargs.pop("formulation")
    if backend == "reference":
        if kwargs.pop("output_final_state"):
            raise ValueError("the sparse-cache reference gives no decode state; use backend='chunked'")
        o, _, _ = hybrid_attention_sparse_reference(q, k, v, window_logit, linear_logit, cache=cache, **kwargs)
        return o, None
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        _fall_back("", "the triton kernels have no sparse cache")
    if (backend in ("auto", "chunked") and not kwargs.get("return_shares")
            and cpu_sparse.covers(q, cache, kwargs["key_padding_mask"])):
        done = cpu_sparse.hybrid_attention_sparse_cpu(q, k, v, window_logit, linear_logit, window=kwargs["window"],
                                                      cache=cache, feature_map=kwargs["feature_map"],
                                                      output_final_state=kwargs["output_final_state"])
        if done is not None:
            return done
    if sparse_batched.covers(cache, kwargs["key_padding_mask"], kwargs.get("return_shares")):
        return sparse_batched.hybrid_attention_sparse_batched(
            q, k, v, window_logit, linear_logit, window=kwargs["window"], cache=cache,
            feature_map=kwargs["feature_map"], output_final_state=kwargs["output_final_state"])
    return hybrid_attention_sparse(q, k, v, window_logit, linear_logit, cache=cache, **kwargs)


def native_step_in_place(q: Tensor, k: Tensor, v: Tensor, state: HybridState, window_logit: Tensor,
                         linear_logit: Tensor, formulation: str, feature_map: FeatureMap,
                         rope: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """A real token's decode step as one native call on the CPU (``cpu_step``), updating ``state`` in
    place: out ``[B, H, 1, D]``, or None where it does not apply (then nothing has changed). The
    caller gives ``state`` up (a generation cache) and asks for the ``auto``/``chunked`` backend
    without a sparse cache; :func:`hybrid_attention_step` is that call's general form. ``rope``: the
    token's Llama ``(cos, sin)`` when q and k arrive before RoPE (the kernel applies it)."""
    if (q.is_cpu and state.sparse is None and not torch.is_grad_enabled()
            and (state.all_real or bool(state.window_valid[:, : min(state.seen, state.window)].all()))):
        return cpu_step.step_in_place(q, k, v, state, window_logit, linear_logit, formulation,
                                      *resolve_qk_maps(feature_map), rope)
    return None


def hybrid_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: HybridState,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    feature_map: FeatureMap = "elu1",
    formulation: str = "hybrid",
    key_valid: Tensor | None = None,
    backend: str = "auto",
    sparse_cache: int = 0,
    sinks: int = 0,
    cache_score: str = "sre",
    inplace: bool = False,
) -> tuple[Tensor, HybridState]:
    """One decode step: q ``[B, H, 1, D]``, k/v ``[B, H_kv, 1, D]`` with the state's heads equal to
    H_kv (GQA; H_kv = H for expanded k/v); returns (out ``[B, H, 1, D]``, new state).

    ``key_valid``: ``[B]`` bool, False marks the new token as padding. Backends: ``auto`` (triton on
    CUDA when available, else torch), ``torch`` / ``reference`` / ``chunked`` / ``seed_naive`` (all
    the torch step: the recreation had no recurrent decode), ``triton``. ``inplace``: the caller
    gives ``state`` up (a generation cache), so the step may update its buffers in place; on the CPU
    ``auto`` and ``chunked`` then run it as one native call where ``cpu_step`` covers the arguments.
    """
    if inplace and key_valid is None and backend in ("auto", "chunked") and not (sparse_cache or sinks):
        # The common decode step of a generation cache on the CPU (checked first and kept lean: inside a
        # model every line here runs cold).
        out = native_step_in_place(q, k, v, state, window_logit, linear_logit, formulation, feature_map)
        if out is not None:
            return out, state
    if (inplace and key_valid is None and state.sparse is not None and cache_score != "attention"
            and backend in ("auto", "chunked") and q.is_cpu and not torch.is_grad_enabled()):
        # The sparse cache's step in a generation cache: native on the w - 1 of every w steps that close
        # no block (the `attention` score keeps sums the kernel does not update).
        out = cpu_step.sparse_step_in_place(q, k, v, state, window_logit, linear_logit,
                                            resolve_qk_maps(feature_map)[0])
        if out is not None:
            return out, state
    kwargs = dict(feature_map=feature_map, formulation=formulation, key_valid=key_valid)
    _check_backend(backend)
    cache = sparse_cache_config(sparse_cache, sinks, cache_score, formulation)
    if cache.active or state.sparse is not None:
        if backend == "triton" or (backend == "auto" and q.is_cuda):
            _fall_back("_step", "the triton kernels have no sparse cache")
        kwargs.pop("formulation")
        return hybrid_attention_step_sparse(q, k, v, state, window_logit, linear_logit, cache=cache, **kwargs)
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        fn = _triton_or_fallback("triton_decode", "hybrid_attention_step_triton", backend, "_step")
        if fn is not None:
            if backend == "triton":
                return fn(q, k, v, state, window_logit, linear_logit, **kwargs)
            try:
                return fn(q, k, v, state, window_logit, linear_logit, **kwargs)
            except NotImplementedError as exc:
                _fall_back("_step", f"{exc}")
    return hybrid_attention_step_torch(q, k, v, state, window_logit, linear_logit, inplace=inplace, **kwargs)
