"""The in-place decode steps as one native call on the CPU (``cpu_kernels.c``'s ``hybrid_step_f32`` and
``hybrid_sparse_step_f32``).

The torch step (``decode._step_in_place``) is about 20 small ops per layer and token, the sparse
cache's (``sparse_decode``) about 140; inside a model each runs cold, so a step costs its op count
rather than its arithmetic. The C kernels do the same step in one call (built and loaded by
``native``; without them the torch steps run).

Covered: fp32 contiguous CPU tensors, elu1 or Hedgehog (query map per query head, key map per KV
head), the three formulations, any batch and GQA, while every key in the window is real. The sparse
step: the ``sre`` and ``random`` scores, on every step but the one in ``w`` that closes a block
(eviction and fold run in torch). The caller checks the rest; the torch steps are the references
they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import native
from .decode import check_step_shapes
from .feature_maps import HedgehogFeatureMap, elu1
from .native import FORMULATION_CODES, MAX_D, MAX_F, MAX_W


def map_parameters(fmap, heads: int, D: int) -> tuple[Tensor, Tensor] | None:
    """A Hedgehog map's ``(W [heads, D, F/2], b [heads, 1, F/2])`` as the kernel reads them, or None."""
    if not isinstance(fmap, HedgehogFeatureMap) or fmap.num_heads != heads or fmap.head_dim != D:
        return None
    W, bias = fmap.weight, fmap.bias
    fh = fmap.feature_dim
    if W.shape != (heads, D, fh) or bias.numel() != heads * fh or not _fp32_cpu(W, bias):
        return None
    return W, bias


def _fp32_cpu(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


@dataclass
class _Prepared:
    """A checked call for one state and one layer's parameters: every size and pointer but the
    token's own. Inside a model the Python around the kernel runs cold too (docs/performance.md), so
    each step only checks that nothing it was prepared from has changed."""

    sources: tuple  # the objects it was prepared from (kept alive here, so their ids stay theirs)
    ids: tuple[int, ...]
    pointers: tuple[int, ...]  # their data pointers: a parameter moved by .to() keeps its identity
    formulation: str
    sizes: tuple[int, ...]  # B, H, Hk, D, w, F (and for the sparse step: sinks, cache size)
    q_shape: torch.Size
    kv_shape: torch.Size
    args: tuple  # formulation and map codes, then the state's and parameters' pointers


_STATE_FIELDS = ("k_window", "v_window", "window_valid", "S", "z")
# The sparse step writes the ring, the sinks and the pending block; it reads the cache and S, z.
_SPARSE_FIELDS = ("sink_k", "sink_v", "sink_valid", "pend_k", "pend_v", "pend_valid", "cache_k", "cache_v",
                  "cache_valid")


def _buffers(state) -> tuple[Tensor, ...]:
    own = tuple(getattr(state, name) for name in _STATE_FIELDS)
    return own if state.sparse is None else own + tuple(getattr(state.sparse, name) for name in _SPARSE_FIELDS)


def _typed_as_the_kernel_reads(state) -> bool:
    """Every buffer on the CPU, the validity flags bool (read as bytes), the rest fp32."""
    names = _STATE_FIELDS + (() if state.sparse is None else _SPARSE_FIELDS)
    return all(t.is_cpu and t.dtype == (torch.bool if name.endswith("valid") else torch.float32)
               for name, t in zip(names, _buffers(state)))


def _sources(state, window_logit: Tensor, linear_logit: Tensor, maps: tuple) -> tuple[tuple, tuple]:
    """``(objects, pointers)``: the state's buffers, the logits and the maps with their parameters
    (compared by id: the prepared call holds them, so no id is reused), and the data pointers of the
    logits and parameters (``Module.to`` and ``.data =`` keep a tensor's identity, not its memory)."""
    buffers = _buffers(state)
    objects = (*buffers, window_logit, linear_logit, *maps)
    return objects, tuple(t.data_ptr() for t in objects[len(buffers):] if isinstance(t, Tensor))


def _kernel_maps(phi_q_map, phi_k_map, H: int, Hk: int, D: int, F: int) -> tuple[int, tuple] | None:
    """``(map code, the Hedgehog maps' parameter tensors)`` as the kernels read them; None where they
    do not cover the maps. ``phi_k_map`` None: the query's map only (the sparse step)."""
    if phi_q_map is elu1 and phi_k_map in (elu1, None):
        return 0, ()
    qmap = map_parameters(phi_q_map, H, D)
    kmap = () if phi_k_map is None else map_parameters(phi_k_map, Hk, D)
    if qmap is None or kmap is None or qmap[0].shape[2] * 2 != F:
        return None
    return 1, (*qmap, *kmap)


def _prepare(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor, formulation: str,
             phi_q_map, phi_k_map) -> _Prepared | None:
    """Check everything the kernel will trust (it reads by these sizes) and bind the pointers; None
    where the kernel does not cover the arguments. For a sparse state (``phi_k_map`` None) the
    buffers the step writes are first copied into memory of the state's own: a state's tensors may
    be views shared with the prefill that built it, and the step must not write through them."""
    check_step_shapes(q, k, v, state)
    B, H, _, D = q.shape
    Hk, w, F = k.shape[1], state.window, state.S.shape[2]
    maps = _kernel_maps(phi_q_map, phi_k_map, H, Hk, D, F)
    if maps is None:
        return None
    fmap, params = maps
    if (formulation not in FORMULATION_CODES or D > MAX_D or F > MAX_F or w > MAX_W
            or window_logit.shape != (H,) or linear_logit.shape != (H,)):
        return None
    sizes = (B, H, Hk, D, w, F)
    if state.sparse is not None:
        sp = state.sparse
        ns, lam = sp.sink_k.shape[2], sp.cache_k.shape[2]
        shapes = {"sink_k": (B, Hk, ns, D), "sink_v": (B, Hk, ns, D), "sink_valid": (B, ns), "pend_k": (B, Hk, w, D),
                  "pend_v": (B, Hk, w, D), "pend_valid": (B, w), "cache_k": (B, Hk, lam, D),
                  "cache_v": (B, Hk, lam, D), "cache_valid": (B, Hk, lam)}
        wrong = [name for name, shape in shapes.items() if getattr(sp, name).shape != shape]
        if formulation != "lolcats" or 2 * w + ns + lam > MAX_W or wrong:
            return None
        sizes += (ns, lam)
    if (not _typed_as_the_kernel_reads(state) or not _fp32_cpu(window_logit, linear_logit, *params)
            or v.shape != k.shape or state.v_window.shape != state.k_window.shape or state.S.shape != (B, Hk, F, D)
            or state.z.shape != (B, Hk, F) or state.window_valid.shape != (B, w)):
        return None
    if state.sparse is not None:
        for name in _STATE_FIELDS[:3]:
            setattr(state, name, getattr(state, name).clone(memory_format=torch.contiguous_format))
        for name in _SPARSE_FIELDS[:6]:
            setattr(sp, name, getattr(sp, name).clone(memory_format=torch.contiguous_format))
        for name in _SPARSE_FIELDS[6:]:
            setattr(sp, name, getattr(sp, name).contiguous())
    buffers = _buffers(state)
    if not all(t.is_contiguous() for t in buffers):
        return None
    sources, pointers = _sources(state, window_logit, linear_logit, (phi_q_map, phi_k_map, *params))
    map_pointers = tuple(t.data_ptr() for t in params) or (None,) * (2 if phi_k_map is None else 4)
    args = (FORMULATION_CODES[formulation], fmap, *(t.data_ptr() for t in (*buffers, window_logit, linear_logit)),
            *map_pointers)
    return _Prepared(sources, tuple(map(id, sources)), pointers, formulation, sizes, q.shape, k.shape, args)


def _still_valid(call: _Prepared, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map) -> bool:
    """Nothing the call was prepared from was replaced, moved or rebound (cheap: runs every token)."""
    n = len(_STATE_FIELDS) + (0 if state.sparse is None else len(_SPARSE_FIELDS))
    if (len(call.sources) < n + 4 or phi_q_map is not call.sources[n + 2] or phi_k_map is not call.sources[n + 3]
            or formulation != call.formulation):
        return False
    maps = (phi_q_map, phi_k_map)
    if len(call.sources) > n + 4:  # Hedgehog maps: their parameters, read from the modules' own table (a
        # plain dict look-up; attribute access through nn.Module.__getattr__ costs several times more)
        qp = phi_q_map._parameters
        maps += (qp["weight"], qp["bias"])
        if phi_k_map is not None:
            kp = phi_k_map._parameters
            maps += (kp["weight"], kp["bias"])
    objects, pointers = _sources(state, window_logit, linear_logit, maps)
    return tuple(map(id, objects)) == call.ids and pointers == call.pointers


def _call(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor, formulation: str,
          phi_q_map, phi_k_map, key: str) -> tuple[_Prepared, Tensor, Tensor, Tensor] | None:
    """The state's prepared call (``key`` in its ``__dict__``) and the token's q, k, v, or None."""
    call = state.__dict__.get(key)
    if call is None or not _still_valid(call, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map):
        call = _prepare(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map)
        if call is None:
            return None
        state.__dict__[key] = call
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copy for a model's one-token q, k, v
    if q.shape != call.q_shape or k.shape != call.kv_shape or v.shape != call.kv_shape or not _fp32_cpu(q, k, v):
        return None
    return call, q, k, v


def step_in_place(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor,
                  formulation: str, phi_q_map, phi_k_map) -> Tensor | None:
    """Run the step natively, updating ``state`` in place; None when the kernel does not cover these
    arguments (the caller then runs the torch step). The caller guarantees: no autograd, the new key
    real, every key in the window real."""
    if not native.enabled():
        return None
    bound = _call(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map, "_native_step")
    lib = native.load() if bound is not None else None
    if lib is None:
        return None
    call, q, k, v = bound
    out = torch.empty_like(q)
    if lib.hybrid_step_f32(*call.sizes, state.seen, *call.args[:2], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                           *call.args[2:], out.data_ptr()) != 0:
        return None
    state.seen += 1
    return out


def sparse_step_in_place(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor,
                         phi_q_map) -> Tensor | None:
    """The sparse cache's step natively (``hybrid_sparse_step_f32``), updating ``state`` in place; None
    on the step that closes a block (once every ``w`` steps: eviction and fold stay in torch) or where
    the kernel does not cover the arguments: the caller then runs the torch step
    (``sparse_decode``), the reference this is tested against. The caller guarantees: no autograd,
    the new key real, a score that keeps no attention sums (``sre``, ``random``)."""
    if not native.enabled():
        return None
    w, ns = state.window, state.sparse.sink_k.shape[2]
    leaving = state.seen - w
    if leaving >= ns and (leaving - ns) % w == w - 1:
        return None
    bound = _call(q, k, v, state, window_logit, linear_logit, "lolcats", phi_q_map, None, "_native_sparse_step")
    lib = native.load() if bound is not None else None
    if lib is None:
        return None
    call, q, k, v = bound
    out = torch.empty_like(q)
    if lib.hybrid_sparse_step_f32(*call.sizes, state.seen, call.args[1], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  *call.args[2:], out.data_ptr()) != 0:
        return None
    state.seen += 1
    return out
