"""The in-place decode steps as one native call on the CPU (``cpu_kernels.c``'s ``hybrid_step_f32`` and
``hybrid_sparse_step_f32``).

The torch step (``ops.hybrid.step``) is about 20 small ops per layer and token, the sparse
cache's (``ops.sparse.step``) about 140; inside a model each runs cold, so a step costs its op count
rather than its arithmetic. The C kernels do the same step in one call (built and loaded by
``build``; without them the torch steps run).

Covered: fp32 contiguous CPU tensors, elu1 or Hedgehog (query map per query head, key map per KV
head), the three formulations, any batch and GQA, with or without a decaying linear state (an fp32
``log_decay`` per KV head: the fold scales S and z by gamma first), while every key in the window is
real. The sparse step: the ``sre`` and ``random`` scores, with or without a decaying linear state
(the kernel ages ``S, z`` by gamma in place, then reads them), on every step but the one in ``w``
that closes a block (eviction and fold run in torch). Both take q and k before RoPE with the token's
``(cos, sin)`` (``rope``), so a model's step runs no torch op between its projections and the kernel.
The caller checks the rest; the torch steps are the references they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..feature_maps import elu1
from ..hybrid.step import check_step_shapes
from ..kept import held, hold
from ..sparse.config import SparseCacheConfig
from . import build
from .bindings import Kernel, fill, fp32_cpu, map_parameters
from .build import FORMULATION_CODES, MAP_CODES, MAX_D, MAX_F, MAX_W

STEP, SPARSE_STEP = Kernel("hybrid_step_f32"), Kernel("hybrid_sparse_step_f32")
# What changes from one step to the next; the rest is bound when a state's call is prepared.
STEP_ARGS = ("seen", "threads", "q", "k", "v", "out", "cos", "sin", "rope_stride")
SPARSE_STEP_ARGS = ("seen", "q", "k", "v", "out", "log_decay", "cos", "sin", "rope_stride")


@dataclass
class _Prepared:
    """A checked call for one state and one layer's parameters: every size and pointer but the
    token's own. Inside a model the Python around the kernel runs cold too (docs/performance.md), so
    each step only checks that nothing it was prepared from has changed (``_still_valid``)."""

    buffers: tuple[Tensor, ...]  # the state's buffers, by identity (held here, so no id is reused)
    logits: tuple[Tensor, Tensor]
    maps: tuple  # (query map, key map or None)
    params: tuple[Tensor, ...]  # the Hedgehog maps' (weight, bias) as read from their modules
    pointers: tuple[int, ...]  # the logits' and params' data pointers: .to() keeps a tensor's identity
    log_decay: Tensor | None  # read by the kernel where it is, so by identity and data pointer too
    decay_pointer: int
    formulation: str
    q_shape: torch.Size
    kv_shape: torch.Size
    args: list  # the kernel's arguments, bound by name, the step's own (STEP_ARGS) left open
    slots: tuple[int, ...]  # where those go


_STATE_FIELDS = ("k_window", "v_window", "window_valid", "S", "z")
# The sparse step writes the ring, the sinks and the pending block, and with a decay S, z (aged in
# place); it reads the cache.
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


def _kernel_maps(phi_q_map, phi_k_map, H: int, Hk: int, D: int, F: int) -> tuple[int, tuple] | None:
    """``(map code, the Hedgehog maps' parameter tensors)`` as the kernels read them; None where they
    do not cover the maps. ``phi_k_map`` None: the query's map only (the sparse step)."""
    if phi_q_map is elu1 and phi_k_map in (elu1, None):
        return MAP_CODES["elu1"], ()
    qmap = map_parameters(phi_q_map, H, D)
    kmap = () if phi_k_map is None else map_parameters(phi_k_map, Hk, D)
    if qmap is None or kmap is None or qmap[0].shape[2] * 2 != F:
        return None
    return MAP_CODES["hedgehog"], (*qmap, *kmap)


def _prepare(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor, formulation: str,
             phi_q_map, phi_k_map, cache: SparseCacheConfig | None,
             log_decay: Tensor | None = None) -> _Prepared | None:
    """Check everything the kernel will trust (it reads by these sizes) and bind the pointers; None
    where the kernel does not cover the arguments. For the sparse step (``cache`` given, ``phi_k_map``
    None) the state's buffers must have the cache's sizes, and the buffers the step writes are first
    copied into memory of the state's own: a state's tensors may be views shared with the prefill
    that built it, and the step must not write through them. ``log_decay``: fp32 ``[H_kv]`` or None
    (the sparse step has no decay)."""
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
    if (state.sparse is None) != (cache is None):
        return None
    if log_decay is not None and (cache is not None or log_decay.shape != (Hk,) or not fp32_cpu(log_decay)):
        return None
    if cache is not None:
        sp = state.sparse
        ns, lam = cache.sinks, cache.size
        shapes = {"sink_k": (B, Hk, ns, D), "sink_v": (B, Hk, ns, D), "sink_valid": (B, ns), "pend_k": (B, Hk, w, D),
                  "pend_v": (B, Hk, w, D), "pend_valid": (B, w), "cache_k": (B, Hk, lam, D),
                  "cache_v": (B, Hk, lam, D), "cache_valid": (B, Hk, lam)}
        wrong = [name for name, shape in shapes.items() if getattr(sp, name).shape != shape]
        if formulation != "lolcats" or 2 * w + ns + lam > MAX_W or wrong:
            return None
    if (not _typed_as_the_kernel_reads(state) or not fp32_cpu(window_logit, linear_logit, *params)
            or v.shape != k.shape or state.v_window.shape != state.k_window.shape or state.S.shape != (B, Hk, F, D)
            or state.z.shape != (B, Hk, F) or state.window_valid.shape != (B, w)):
        return None
    if state.sparse is not None:
        for name in _STATE_FIELDS:  # S, z too: a decaying step ages them in place
            setattr(state, name, getattr(state, name).clone(memory_format=torch.contiguous_format))
        for name in _SPARSE_FIELDS[:6]:
            setattr(sp, name, getattr(sp, name).clone(memory_format=torch.contiguous_format))
        for name in _SPARSE_FIELDS[6:]:
            setattr(sp, name, getattr(sp, name).contiguous())
    buffers = _buffers(state)
    if not all(t.is_contiguous() for t in buffers):
        return None
    sizes = dict(B=B, H=H, Hk=Hk, D=D, w=w, F=F, map=fmap, window_logit=window_logit.data_ptr(),
                 linear_logit=linear_logit.data_ptr())
    own = dict(zip(("k_win", "v_win", "valid" if cache is None else "win_valid", "S", "z"),
                   (t.data_ptr() for t in buffers[:5])))
    if cache is None:
        wq, bq, wk, bk = (t.data_ptr() for t in params) if params else (None,) * 4
        args, slots = STEP.template(STEP_ARGS, **sizes, **own, formulation=FORMULATION_CODES[formulation],
                                    wq=wq, bq=bq, wk=wk, bk=bk,
                                    log_decay=None if log_decay is None else log_decay.data_ptr())
    else:
        wq, bq = (t.data_ptr() for t in params) if params else (None,) * 2
        sparse = {name: t.data_ptr() for name, t in zip(_SPARSE_FIELDS, buffers[5:])}
        args, slots = SPARSE_STEP.template(SPARSE_STEP_ARGS, **sizes, **own, **sparse, ns=ns, lam=lam, wq=wq, bq=bq)
    pointers = (window_logit.data_ptr(), linear_logit.data_ptr(), *(t.data_ptr() for t in params))
    # params: the maps' (weight, bias) as _still_valid reads them from the modules' tables
    return _Prepared(buffers, (window_logit, linear_logit), (phi_q_map, phi_k_map), params, pointers,
                     log_decay, 0 if log_decay is None else log_decay.data_ptr(), formulation, q.shape, k.shape,
                     args, slots)


def _still_valid(call: _Prepared, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map,
                 log_decay) -> bool:
    """Nothing the call was prepared from was replaced, moved or rebound. It runs every token, so it
    compares identities and pointers one by one rather than building tuples of them."""
    b, (wl, ll) = call.buffers, call.logits
    if not (state.k_window is b[0] and state.v_window is b[1] and state.window_valid is b[2] and state.S is b[3]
            and state.z is b[4] and window_logit is wl and linear_logit is ll and formulation == call.formulation
            and phi_q_map is call.maps[0] and phi_k_map is call.maps[1] and log_decay is call.log_decay):
        return False
    if log_decay is not None and log_decay.data_ptr() != call.decay_pointer:
        return False
    sparse = state.sparse
    if (sparse is None) != (len(b) == 5) or (sparse is not None and not all(
            getattr(sparse, name) is t for name, t in zip(_SPARSE_FIELDS, b[5:]))):
        return False
    if wl.data_ptr() != call.pointers[0] or ll.data_ptr() != call.pointers[1]:
        return False
    params = call.params
    if not params:
        return True
    # The maps' parameters as registered now, from the modules' own tables (attribute access goes
    # through nn.Module.__getattr__, several times dearer); None for the sparse step's key map.
    qp = phi_q_map._parameters
    now = (qp["weight"], qp["bias"]) if phi_k_map is None else (
        qp["weight"], qp["bias"], phi_k_map._parameters["weight"], phi_k_map._parameters["bias"])
    if len(now) != len(params):
        return False
    for t, prepared_with, pointer in zip(now, params, call.pointers[2:]):
        if t is not prepared_with or t.data_ptr() != pointer:
            return False
    return True


def _call(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor, formulation: str,
          phi_q_map, phi_k_map, cache: SparseCacheConfig | None, key: str,
          log_decay: Tensor | None = None) -> tuple[_Prepared, Tensor, Tensor, Tensor] | None:
    """The state's prepared call (held on the state under ``key``) and the token's q, k, v, or None."""
    call = held(state, key)
    if call is None or not _still_valid(call, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map,
                                        log_decay):
        # HYBRID_LLAMA_NATIVE is read here, when a state's call is prepared (reading the environment
        # costs more than the rest of a step's checks): a state keeps the path its first step took.
        if not build.enabled() or build.load() is None:
            return None
        call = _prepare(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map, cache,
                        log_decay)
        if call is None:
            return None
        hold(state, key, call)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copy for a model's one-token q, k, v
    if q.shape != call.q_shape or k.shape != call.kv_shape or v.shape != call.kv_shape:
        return None
    for t in (q, k, v):  # _fp32_cpu, without a generator's cost per token
        if t.dtype is not torch.float32 or not t.is_cpu:
            return None
    return call, q, k, v


def _rope_pointers(rope: tuple[Tensor, Tensor], B: int, D: int) -> tuple[int, int, int] | None:
    """``(cos, sin, row stride)`` as the kernel reads one token's RoPE tables ``[1 | B, 1, D]``, or None."""
    cos, sin = rope
    if cos.shape != sin.shape or cos.shape[-1] != D or cos.numel() not in (D, B * D):
        return None
    for t in (cos, sin):
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            return None
    return cos.data_ptr(), sin.data_ptr(), 0 if cos.numel() == D else D


def step_in_place(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor,
                  formulation: str, phi_q_map, phi_k_map, rope: tuple[Tensor, Tensor] | None = None,
                  log_decay: Tensor | None = None) -> Tensor | None:
    """Run the step natively, updating ``state`` in place; None when the kernel does not cover these
    arguments (the caller then runs the torch step). The caller guarantees: no autograd, the new key
    real, every key in the window real.

    ``log_decay``: a decaying linear state's log gamma, fp32 contiguous ``[H_kv]`` (else declined), or
    None. The kernel reads it where it is at every step: pass the same tensor from step to step (a
    new one prepares the call again), its values may change in place.

    ``rope``: the token's ``(cos, sin)`` as transformers' Llama rotary embedding gives them; q and k then
    arrive before RoPE and the kernel rotates them (the ring keeps the rotated key). None: q and k are
    rotated already. Where this returns None, q and k are as they came (still to be rotated)."""
    bound = _call(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map, None, "native_step",
                  log_decay)
    if bound is None:
        return None
    call, q, k, v = bound
    rotation = (None, None, 0) if rope is None else _rope_pointers(rope, q.shape[0], q.shape[-1])
    if rotation is None:
        return None
    out = torch.empty_like(q)
    if build.load().hybrid_step_f32(*fill(call.args, call.slots, state.seen, torch.get_num_threads(), q.data_ptr(),
                                          k.data_ptr(), v.data_ptr(), out.data_ptr(), *rotation)) != 0:
        return None
    state.seen += 1
    return out


def sparse_step_in_place(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor,
                         phi_q_map, cache: SparseCacheConfig, log_decay: Tensor | None = None,
                         rope: tuple[Tensor, Tensor] | None = None) -> Tensor | None:
    """The sparse cache's step natively (``hybrid_sparse_step_f32``), updating ``state`` in place; None
    on the step that closes a block (once every ``w`` steps: eviction and fold stay in torch) or where
    the kernel does not cover the arguments: the caller then runs the torch step
    (``ops.sparse.step``), the reference this is tested against. The caller guarantees: no autograd,
    the new key real, a score that keeps no attention sums (``sre``, ``random``). ``log_decay``
    ``[H_kv]``: log gamma of a decaying linear state (the state's S, z age by gamma first, as in
    the torch step); where this returns None, the state holds the values it had. ``rope``: as for
    ``step_in_place`` (where this returns None, q and k are still to be rotated)."""
    w, ns = state.window, cache.sinks
    leaving = state.seen - w
    if leaving >= ns and (leaving - ns) % w == w - 1:
        return None
    decay = None
    if log_decay is not None:
        if log_decay.shape != (k.shape[1],) or not log_decay.is_cpu:
            return None
        decay = log_decay.float().contiguous()
    bound = _call(q, k, v, state, window_logit, linear_logit, "lolcats", phi_q_map, None, cache,
                  "native_sparse_step")
    if bound is None:
        return None
    call, q, k, v = bound
    rotation = (None, None, 0) if rope is None else _rope_pointers(rope, q.shape[0], q.shape[-1])
    if rotation is None:
        return None
    out = torch.empty_like(q)
    if build.load().hybrid_sparse_step_f32(*fill(call.args, call.slots, state.seen, q.data_ptr(), k.data_ptr(),
                                                 v.data_ptr(), out.data_ptr(),
                                                 None if decay is None else decay.data_ptr(), *rotation)) != 0:
        return None
    state.seen += 1
    return out
