"""Hybrid attention: sliding-window softmax + linear attention over the keys that left the window.

Public API (contract in docs/design.md, section "ops"):

- ``hybrid_attention(q, k, v, window_logit, linear_logit, *, window, backend, formulation,
  feature_map, key_padding_mask, output_final_state, sparse)``: the parallel (prefill / training)
  op; like every backend it returns ``(o, final_state)``, the state only when asked for.
- ``hybrid_attention_step(q, k, v, state, window_logit, linear_logit, *, ...)``: one decode step.
- ``hybrid_attention_continue(q, k, v, state, ...)``: several tokens continuing a state at once (the
  chunked form with an initial state); ``continues_at_once`` says which states it takes.
- ``prefill_state``, ``window_prompt_state``, ``init_state``, ``HybridState``: the recurrent state.
- ``SparseCacheConfig``: the sparse cache's settings, taken by every path as they are.

Layout, one folder per op, each with its naive reference, chunked form and recurrent step:

- ``hybrid/``: the op without the cache (``reference``, ``chunked``, ``step``, ``continuation``, and ``seed_naive``,
  the published recreation's implementation kept as a benchmark baseline);
- ``sparse/``: the op with the sparse cache (``config``, ``eviction``, ``reference``, ``chunked``,
  ``batched``, ``step``, ``continuation``, ``state``);
- ``native/``: the CPU kernels (``cpu_kernels.h`` declares them once, ``cpu_kernels.c``, ``build``,
  ``bindings``) and the calls that use them (``prefill``, ``sparse_prefill``, ``step``,
  ``softmax_decode``);
- ``triton/``: the CUDA kernels (``prefill``, ``decode``), loaded lazily;
- shared: ``state``, ``feature_maps``, ``gqa``, ``kept``; ``dispatch`` picks the path for a call.

Backends: ``reference`` (readable, O(T^2)), ``chunked`` (on the CPU without autograd the native
recurrence where it applies, else PyTorch ops, O(T*w*D + T*D^2); ``torch`` forces the PyTorch ops),
``triton`` (CUDA kernels), ``auto`` (triton on CUDA when it imports and supports the options, else
chunked; a fallback on CUDA is logged once with its reason), and ``seed_naive`` (prefill only, elu1
+ hybrid formulation without padding; its decode step is the torch step).
"""

from __future__ import annotations

from .dispatch import (
    BACKENDS,
    SOFTMAX_PROMPT_BACKENDS,
    DeferredState,
    causal_softmax,
    continues_at_once,
    hybrid_attention,
    hybrid_attention_continue,
    hybrid_attention_step,
    is_softmax_prompt,
    layer_prompt,
    native_step_in_place,
    takes_native_step,
)
from .feature_maps import HedgehogFeatureMap, elu1
from .gqa import expand_kv
from .hybrid.reference import FORMULATIONS
from .sparse.config import CACHE_SCORES, SparseCacheConfig
from .sparse.state import softmax_prompt_state
from .sparse.step import init_sparse_state
from .state import HybridState, init_state, prefill_state, window_prompt_state

__all__ = [
    "hybrid_attention",
    "hybrid_attention_step",
    "hybrid_attention_continue",
    "continues_at_once",
    "layer_prompt",
    "DeferredState",
    "causal_softmax",
    "is_softmax_prompt",
    "takes_native_step",
    "native_step_in_place",
    "SOFTMAX_PROMPT_BACKENDS",
    "BACKENDS",
    "FORMULATIONS",
    "expand_kv",
    "prefill_state",
    "window_prompt_state",
    "softmax_prompt_state",
    "init_state",
    "init_sparse_state",
    "HybridState",
    "HedgehogFeatureMap",
    "elu1",
    "CACHE_SCORES",
    "SparseCacheConfig",
]
