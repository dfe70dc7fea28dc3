"""The one place that decides which path computes a call of the op.

``hybrid_attention`` (a prompt, or training), ``hybrid_attention_step`` (one decode token) and
``layer_prompt`` (a hybrid layer's first prompt, whose decode state may wait) pick a backend here;
the layer asks these and decides nothing on its own. The rules each live in one function:
``is_softmax_prompt`` (a prompt that is plain causal softmax), ``takes_native_step`` (a generation
step that may run as one native call) and ``SparseCacheConfig.state_needs_queries`` (a state that
cannot be built from the keys alone).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .feature_maps import FeatureMap, is_elu1, resolve_qk_maps
from .gqa import expand_kv
from .hybrid.continuation import hybrid_attention_continue_torch
from .hybrid.reference import check_inputs, hybrid_attention_reference
from .hybrid.step import hybrid_attention_step_torch
from .native import prefill as native_prefill
from .native import sparse_prefill as native_sparse_prefill
from .native import step as native_step
from .sparse import batched as sparse_batched
from .sparse import continuation as sparse_continuation
from .sparse.chunked import hybrid_attention_sparse
from .sparse.config import SparseCacheConfig
from .sparse.reference import hybrid_attention_sparse_reference
from .sparse.state import softmax_prompt_state
from .sparse.step import hybrid_attention_step_sparse
from .state import HybridState, prefill_state

BACKENDS = ("auto", "reference", "chunked", "triton", "seed_naive")
logger = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[tuple[str, str]] = set()
# Why the triton eviction plan failed under `auto` (a compile error, say): the process stops asking it.
_PLAN_FAILED: list[str] = []


def _load_triton(module: str, attr: str) -> tuple[Callable | None, str]:
    """Import a triton entry point lazily; return (function or None, reason it is missing)."""
    try:
        mod = importlib.import_module(f"{__package__}.triton.{module}")
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
    sparse: SparseCacheConfig | None = None,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState | None]:
    """Hybrid attention: q ``[B, H, T, D]``, k/v ``[B, H_kv, T, D]`` (GQA, H % H_kv == 0, or H_kv = H).

    ``sparse`` adds the third memory, the sparse cache (``ops.sparse``; ``lolcats`` formulation
    only); None, or a config with neither keys nor sinks, leaves the op as it is. On CUDA the batched
    torch op runs it with its evictions planned by a triton kernel (``ops.triton.sparse_plan``).

    Returns ``(o, final_state)``: o ``[B, H, T, D]`` in q's dtype, and with ``output_final_state``
    the ``HybridState`` after the T tokens (what ``hybrid_attention_step`` continues from), else
    None. The triton kernels and the chunked backend read the KV heads in place; reference repeats
    them itself, seed_naive gets them repeated here.

    ``log_decay`` ``[H_kv]``: log gamma <= 0 per KV head, a linear state that decays by gamma per
    position (``hybrid.reference_parts``); None keeps it undecayed. The torch backends (reference,
    chunked, and the sparse cache's reference, loop and batched paths), the native CPU kernels (with
    and without the sparse cache) and the triton kernels (the eviction plan's too) compute it;
    ``seed_naive`` refuses it."""
    kwargs = dict(window=window, formulation=formulation, feature_map=feature_map, key_padding_mask=key_padding_mask,
                  output_final_state=output_final_state)
    _check_backend(backend)
    cache = (sparse or NO_CACHE).require_formulation(formulation)
    _check_decay(log_decay, cache, backend)
    if backend in SOFTMAX_PROMPT_BACKENDS and is_softmax_prompt(q.shape[2], window, cache, key_padding_mask,
                                                                 output_final_state):
        check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask)
        resolve_qk_maps(feature_map)  # rejects unknown maps, as the other paths do
        return _softmax_only(q, k, v, window=window, feature_map=feature_map, cache=cache,
                             output_final_state=output_final_state)
    if cache.active:
        return _sparse(q, k, v, window_logit, linear_logit, cache, backend, log_decay=log_decay, **kwargs)
    if backend == "reference":
        return hybrid_attention_reference(q, k, v, window_logit, linear_logit, log_decay=log_decay, **kwargs)
    if backend == "seed_naive":
        if formulation != "hybrid" or not is_elu1(feature_map) or key_padding_mask is not None:
            raise ValueError("backend='seed_naive' supports only formulation='hybrid', feature_map='elu1', no padding")
        from .hybrid.seed_naive import hybrid_attention_seed_naive

        o, _ = hybrid_attention_seed_naive(q, *expand_kv(q, k, v), window_logit, linear_logit, window=window)
        # The decode state stays at the KV heads, as the step reads it.
        return o, prefill_state(k, v, window=window) if output_final_state else None
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        fn = _triton_or_fallback("prefill", "hybrid_attention_triton", backend, "")
        if fn is not None:
            if backend == "triton":
                return fn(q, k, v, window_logit, linear_logit, log_decay=log_decay, **kwargs)
            try:
                return fn(q, k, v, window_logit, linear_logit, log_decay=log_decay, **kwargs)
            except NotImplementedError as exc:  # an option the kernel does not cover
                _fall_back("", f"{exc}")
    if backend in ("auto", "chunked") and native_prefill.covers(q, k, window, formulation, key_padding_mask,
                                                                log_decay):
        check_inputs(q, k, v, window_logit, linear_logit, window, formulation, key_padding_mask, log_decay)
        done = native_prefill.hybrid_attention_cpu(q, k, v, window_logit, linear_logit, window=window,
                                                formulation=formulation, feature_map=feature_map,
                                                output_final_state=output_final_state, log_decay=log_decay)
        if done is not None:
            return done
    from .hybrid.chunked import hybrid_attention_chunked

    # GQA k/v go in as they are: chunked reads the KV heads in place (and expands them itself for a
    # per-head callable feature map).
    return hybrid_attention_chunked(q, k, v, window_logit, linear_logit, log_decay=log_decay, **kwargs)


def _check_decay(log_decay: Tensor | None, cache: SparseCacheConfig, backend: str) -> None:
    """Refuse a decaying linear state where no path computes it (see ``hybrid_attention``)."""
    if log_decay is None:
        return
    if backend == "seed_naive":
        raise ValueError(f"backend={backend!r} has no decaying linear state (log_decay); use 'auto' or 'chunked'")


# Backends whose prompts inside the window are torch's causal SDPA (``causal_softmax``).
SOFTMAX_PROMPT_BACKENDS = ("auto", "chunked", "torch")


def causal_softmax(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The op on a prompt of T <= window tokens without padding, q ``[B, H, T, D]``, k/v ``[B, H_kv, T,
    D]``: no key has left the window, so every formulation is causal softmax attention (the linear
    part, the sparse cache and the mixing gates cancel out), which torch's SDPA computes."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


NO_CACHE = SparseCacheConfig()


def is_softmax_prompt(T: int, window: int, cache: SparseCacheConfig, key_padding_mask: Tensor | None = None,
                      final_state: bool = False) -> bool:
    """Whether a prompt of T tokens is causal softmax attention (``causal_softmax``), whatever the
    backend: no padding, and T inside the window or, at inference, within the sparse cache's
    ``softmax_prompt_len``; and, when its final state is asked for, a state that the keys alone give
    (``softmax_prompt_state``). Under autograd only the window counts: past it the sparse op's exact
    zero gradients for the mixing logits and maps are its own rounding, which an optimizer would
    still act on, so training keeps what it computed before."""
    return (key_padding_mask is None
            and (T <= window or (T <= cache.softmax_prompt_len(window) and not torch.is_grad_enabled()))
            and not (final_state and cache.state_needs_queries))


class DeferredState(NamedTuple):
    """A causal-softmax prompt's decode state, not built yet: ``build(k, v)`` makes it from the keys."""

    k: Tensor
    v: Tensor
    build: Callable[[Tensor, Tensor], HybridState]


def layer_prompt(q: Tensor, k: Tensor, v: Tensor, window_logit: Tensor, linear_logit: Tensor, *, window: int,
                 backend: str, formulation: str, feature_map: FeatureMap, key_padding_mask: Tensor | None,
                 keep_state: bool, sparse: SparseCacheConfig,
                 log_decay: Tensor | None = None) -> tuple[Tensor, HybridState | DeferredState | None]:
    """A hybrid layer's first prompt: ``(o, state)``, the state None unless ``keep_state``. A prompt
    that is causal softmax (``is_softmax_prompt``) gives a :class:`DeferredState`: building the ring
    buffers and sums would be most of what it costs beyond SDPA, and a forward that never decodes
    (scoring) never needs them; its SDPA runs without the op's argument checks and dispatch, which
    inside a model cost more than the attention of a short prompt."""
    if is_softmax_prompt(q.shape[2], window, sparse, key_padding_mask, keep_state):
        if backend in SOFTMAX_PROMPT_BACKENDS:
            o = causal_softmax(q, k, v)
        else:
            o, _ = hybrid_attention(q, k, v, window_logit, linear_logit, window=window, backend=backend,
                                    formulation=formulation, feature_map=feature_map, sparse=sparse,
                                    log_decay=log_decay)
        if not keep_state:
            return o, None
        build = partial(softmax_prompt_state, window=window, cache=sparse, feature_map=feature_map)
        return o, DeferredState(k.detach(), v.detach(), build)
    o, state = hybrid_attention(q, k, v, window_logit, linear_logit, window=window, backend=backend,
                                formulation=formulation, feature_map=feature_map, key_padding_mask=key_padding_mask,
                                output_final_state=keep_state, sparse=sparse, log_decay=log_decay)
    return o, None if state is None else state.detach()


def _softmax_only(q: Tensor, k: Tensor, v: Tensor, *, window: int, feature_map: FeatureMap, cache: SparseCacheConfig,
                  output_final_state: bool) -> tuple[Tensor, HybridState | None]:
    """``causal_softmax`` and, on request, the state after the prompt."""
    o = causal_softmax(q, k, v)
    if not output_final_state:
        return o, None
    return o, softmax_prompt_state(k, v, window=window, cache=cache, feature_map=feature_map)


def _sparse(q, k, v, window_logit, linear_logit, cache: SparseCacheConfig, backend: str, *,
            log_decay: Tensor | None = None, **kwargs):
    check_inputs(q, k, v, window_logit, linear_logit, kwargs["window"], "lolcats", kwargs["key_padding_mask"],
                 log_decay)
    kwargs.pop("formulation")
    if backend == "reference":
        if kwargs.pop("output_final_state"):
            raise ValueError("the sparse-cache reference gives no decode state; use backend='chunked'")
        o, _, _ = hybrid_attention_sparse_reference(q, k, v, window_logit, linear_logit, cache=cache,
                                                    log_decay=log_decay, **kwargs)
        return o, None
    batched = sparse_batched.covers(cache, kwargs["key_padding_mask"], kwargs.get("return_shares"))
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        done = _sparse_on_triton(q, k, v, window_logit, linear_logit, cache, backend, batched, log_decay, kwargs)
        if done is not None:
            return done
    if (backend in ("auto", "chunked") and not kwargs.get("return_shares")
            and native_sparse_prefill.covers(q, cache, kwargs["key_padding_mask"])):
        done = native_sparse_prefill.hybrid_attention_sparse_cpu(
            q, k, v, window_logit, linear_logit, window=kwargs["window"], cache=cache,
            feature_map=kwargs["feature_map"], output_final_state=kwargs["output_final_state"], log_decay=log_decay)
        if done is not None:
            return done
    if batched:
        return _sparse_batched(q, k, v, window_logit, linear_logit, cache, log_decay, kwargs)
    return hybrid_attention_sparse(q, k, v, window_logit, linear_logit, cache=cache, log_decay=log_decay, **kwargs)


def _sparse_batched(q, k, v, window_logit, linear_logit, cache: SparseCacheConfig, log_decay: Tensor | None,
                    kwargs: dict, planner: Callable | None = None):
    """``sparse.batched``'s op with the dispatcher's arguments (``planner``: its evictions' planner)."""
    return sparse_batched.hybrid_attention_sparse_batched(
        q, k, v, window_logit, linear_logit, window=kwargs["window"], cache=cache, feature_map=kwargs["feature_map"],
        output_final_state=kwargs["output_final_state"], log_decay=log_decay, planner=planner)


def _sparse_on_triton(q, k, v, window_logit, linear_logit, cache: SparseCacheConfig, backend: str, batched: bool,
                      log_decay: Tensor | None, kwargs: dict):
    """The batched sparse op with its evictions planned by the triton kernel, or None where that does
    not apply (said once; ``backend='triton'`` raises instead). ``batched``: whether the batched op
    takes these options."""
    if not batched:
        why = "the triton eviction plan takes no padding mask, no 'attention' score and no shares"
        if backend == "triton":
            raise NotImplementedError(why)
        _fall_back("", why)
        return None
    if backend == "auto" and _PLAN_FAILED:
        return None
    planner = _triton_or_fallback("sparse_plan", "plan_evictions_triton", backend, "")
    if planner is None:
        return None
    try:
        return _sparse_batched(q, k, v, window_logit, linear_logit, cache, log_decay, kwargs, planner)
    except NotImplementedError as exc:  # widths the kernel does not take
        if backend == "triton":
            raise
        _fall_back("", f"{exc}")
        return None
    except Exception as exc:  # e.g. a GPU the kernel does not compile for: auto stops trying it
        if backend == "triton":
            raise
        _PLAN_FAILED.append(f"{type(exc).__name__}: {exc}")
        _fall_back("", f"the triton eviction plan failed, so the torch plan runs from now on ({_PLAN_FAILED[0]})")
        return None


def takes_native_step(backend: str, sparse: SparseCacheConfig) -> bool:
    """Whether a generation step (in place, the new key real) may run as one native call
    (``native_step_in_place``): the backends that take the CPU's native kernels, without a sparse
    cache or with one whose score keeps no attention sums (the kernel does not update them)."""
    return backend in ("auto", "chunked") and (not sparse.active or sparse.score != "attention")


def native_step_in_place(q: Tensor, k: Tensor, v: Tensor, state: HybridState, window_logit: Tensor,
                         linear_logit: Tensor, formulation: str, feature_map: FeatureMap,
                         rope: tuple[Tensor, Tensor] | None = None, log_decay: Tensor | None = None,
                         sparse: SparseCacheConfig | None = None) -> Tensor | None:
    """A real token's decode step as one native call on the CPU (``native.step``), updating ``state`` in
    place: out ``[B, H, 1, D]``, or None where it does not apply (then nothing has changed). The
    caller gives ``state`` up (a generation cache) and asks for a backend ``takes_native_step``
    allows; :func:`hybrid_attention_step` is that call's general form. ``rope``: the token's Llama
    ``(cos, sin)`` when q and k arrive before RoPE (the kernel applies it).
    ``log_decay``: a decaying linear state's fp32 ``[H_kv]`` log gamma; the prepared call reads it in
    place, so a caller passes the same tensor every step (the layer keeps one per parameter value).
    ``sparse``: the cache's settings where the state has a sparse cache: its step runs natively on
    the w - 1 of every w steps that close no block (the closing step evicts and folds in torch)."""
    if not q.is_cpu or torch.is_grad_enabled():
        return None
    if state.sparse is not None:
        if sparse is None or not sparse.active or sparse.score == "attention":
            return None
        return native_step.sparse_step_in_place(q, k, v, state, window_logit, linear_logit,
                                                resolve_qk_maps(feature_map)[0], sparse, log_decay, rope)
    if state.all_real or bool(state.window_valid[:, : min(state.seen, state.window)].all()):
        return native_step.step_in_place(q, k, v, state, window_logit, linear_logit, formulation,
                                         *resolve_qk_maps(feature_map), rope, log_decay)
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
    sparse: SparseCacheConfig | None = None,
    inplace: bool = False,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """One decode step: q ``[B, H, 1, D]``, k/v ``[B, H_kv, 1, D]`` with the state's heads equal to
    H_kv (GQA; H_kv = H for expanded k/v); returns (out ``[B, H, 1, D]``, new state).

    ``key_valid``: ``[B]`` bool, False marks the new token as padding. Backends: ``auto`` (triton on
    CUDA when available, else torch), ``torch`` / ``reference`` / ``chunked`` / ``seed_naive`` (all
    the torch step: the recreation had no recurrent decode), ``triton``. ``inplace``: the caller
    gives ``state`` up (a generation cache), so the step may update its buffers in place; on the CPU
    ``auto`` and ``chunked`` then run it as one native call where ``native.step`` covers the arguments.
    ``sparse``: the sparse cache's settings, as for ``hybrid_attention`` (the state's buffers have its sizes).
    ``log_decay``: a decaying linear state, as for ``hybrid_attention`` (the native steps where they
    take an fp32 one, the triton step, and the torch steps with and without a sparse cache compute it).
    """
    cache = sparse or NO_CACHE
    if inplace and key_valid is None and takes_native_step(backend, cache):
        # The common decode step of a generation cache on the CPU (checked first and kept lean: inside a
        # model every line here runs cold).
        out = native_step_in_place(q, k, v, state, window_logit, linear_logit, formulation, feature_map,
                                   log_decay=log_decay, sparse=cache)
        if out is not None:
            return out, state
    kwargs = dict(feature_map=feature_map, formulation=formulation, key_valid=key_valid, log_decay=log_decay)
    _check_backend(backend)
    cache.require_formulation(formulation)
    _check_decay(log_decay, cache, backend)
    if cache.active or state.sparse is not None:
        if backend == "triton" or (backend == "auto" and q.is_cuda):
            _fall_back("_step", "the triton kernels have no sparse-cache decode step")
        kwargs.pop("formulation")
        return hybrid_attention_step_sparse(q, k, v, state, window_logit, linear_logit, cache=cache, **kwargs)
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        fn = _triton_or_fallback("decode", "hybrid_attention_step_triton", backend, "_step")
        if fn is not None:
            if backend == "triton":
                return fn(q, k, v, state, window_logit, linear_logit, **kwargs)
            try:
                return fn(q, k, v, state, window_logit, linear_logit, **kwargs)
            except NotImplementedError as exc:
                _fall_back("_step", f"{exc}")
    return hybrid_attention_step_torch(q, k, v, state, window_logit, linear_logit, inplace=inplace, **kwargs)


def continues_at_once(sparse: SparseCacheConfig | None, state: HybridState) -> bool:
    """Whether :func:`hybrid_attention_continue` takes a state with these cache settings (every new
    key real; otherwise the layer steps token by token)."""
    cache = sparse or NO_CACHE
    if cache.active or state.sparse is not None:
        return sparse_continuation.covers(cache, state)
    return True


def hybrid_attention_continue(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: HybridState,
    window_logit: Tensor,
    linear_logit: Tensor,
    *,
    feature_map: FeatureMap = "elu1",
    formulation: str = "hybrid",
    sparse: SparseCacheConfig | None = None,
    log_decay: Tensor | None = None,
) -> tuple[Tensor, HybridState]:
    """L real tokens continuing a decode state at once: q ``[B, H, L, D]``, k/v ``[B, H_kv, L, D]``;
    returns (out ``[B, H, L, D]``, the state after them), what L calls of :func:`hybrid_attention_step`
    return (a cache continued by a new turn or by a shared prompt's suffixes). PyTorch ops, so any
    device; ``continues_at_once`` tells which states it takes. The given state is left as it was."""
    cache = (sparse or NO_CACHE).require_formulation(formulation)
    if cache.active or state.sparse is not None:
        return sparse_continuation.hybrid_attention_continue_sparse(
            q, k, v, state, window_logit, linear_logit, cache=cache, feature_map=feature_map, log_decay=log_decay)
    return hybrid_attention_continue_torch(q, k, v, state, window_logit, linear_logit, feature_map=feature_map,
                                           formulation=formulation, log_decay=log_decay)
