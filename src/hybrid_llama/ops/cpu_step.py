"""The in-place decode step as one native call on the CPU (``cpu_kernels.c``'s ``hybrid_step_f32``).

The torch step (``decode._step_in_place``) is about 20 small ops per layer and token; inside a model
each runs cold, so the step costs its op count rather than its arithmetic. The C kernel does the same
step in one call (built and loaded by ``native``; without it the torch step runs).

Covered: fp32 contiguous CPU tensors, elu1 or Hedgehog (query map per query head, key map per KV
head), the three formulations, any batch and GQA, while every key in the window is real. The caller
checks that; the torch step is the reference it is tested against.
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
    sizes: tuple[int, ...]  # B, H, Hk, D, w, F
    q_shape: torch.Size
    kv_shape: torch.Size
    args: tuple  # formulation and map codes, then the state's and parameters' pointers


def _sources(state, window_logit: Tensor, linear_logit: Tensor, maps: tuple) -> tuple[tuple, tuple]:
    """``(objects, pointers)``: the state's buffers, the logits and the maps with their parameters
    (compared by id: the prepared call holds them, so no id is reused), and the data pointers of the
    logits and parameters (``Module.to`` and ``.data =`` keep a tensor's identity, not its memory)."""
    objects = (state.k_window, state.v_window, state.window_valid, state.S, state.z, window_logit, linear_logit, *maps)
    return objects, tuple(t.data_ptr() for t in objects[5:] if isinstance(t, Tensor))


def _prepare(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor, formulation: str,
             phi_q_map, phi_k_map) -> _Prepared | None:
    """Check everything the kernel will trust (it reads by these sizes) and bind the pointers; None
    where the kernel does not cover the arguments."""
    check_step_shapes(q, k, v, state)
    B, H, _, D = q.shape
    Hk, w, F = k.shape[1], state.window, state.S.shape[2]
    if phi_q_map is elu1 and phi_k_map is elu1:
        fmap, maps = 0, ()
    else:
        qmap, kmap = map_parameters(phi_q_map, H, D), map_parameters(phi_k_map, Hk, D)
        if qmap is None or kmap is None or qmap[0].shape[2] * 2 != F:
            return None
        fmap, maps = 1, (*qmap, *kmap)
    if (formulation not in FORMULATION_CODES or D > MAX_D or F > MAX_F or w > MAX_W
            or window_logit.shape != (H,) or linear_logit.shape != (H,)):
        return None
    buffers = (state.k_window, state.v_window, state.S, state.z)
    if (not _fp32_cpu(*buffers, window_logit, linear_logit, *maps) or v.shape != k.shape
            or state.v_window.shape != state.k_window.shape or state.S.shape != (B, Hk, F, D)
            or state.z.shape != (B, Hk, F) or state.window_valid.shape != (B, w)
            or state.window_valid.dtype != torch.bool or not state.window_valid.is_contiguous()):
        return None
    sources, pointers = _sources(state, window_logit, linear_logit, (phi_q_map, phi_k_map, *maps))
    bound = (state.k_window, state.v_window, state.window_valid, state.S, state.z, window_logit, linear_logit)
    map_pointers = tuple(t.data_ptr() for t in maps) if maps else (None,) * 4
    args = (FORMULATION_CODES[formulation], fmap, *(t.data_ptr() for t in bound), *map_pointers)
    sizes = (B, H, Hk, D, w, F)
    return _Prepared(sources, tuple(map(id, sources)), pointers, formulation, sizes, q.shape, k.shape, args)


def _still_valid(call: _Prepared, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map) -> bool:
    """Nothing the call was prepared from was replaced, moved or rebound (cheap: runs every token)."""
    if phi_q_map is not call.sources[7] or phi_k_map is not call.sources[8] or formulation != call.formulation:
        return False
    maps = (phi_q_map, phi_k_map)
    if len(call.sources) > 9:  # Hedgehog maps: their parameters, read from the modules' own table (a
        # plain dict look-up; attribute access through nn.Module.__getattr__ costs several times more)
        qp, kp = phi_q_map._parameters, phi_k_map._parameters
        maps += (qp["weight"], qp["bias"], kp["weight"], kp["bias"])
    objects, pointers = _sources(state, window_logit, linear_logit, maps)
    return tuple(map(id, objects)) == call.ids and pointers == call.pointers


def step_in_place(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor,
                  formulation: str, phi_q_map, phi_k_map) -> Tensor | None:
    """Run the step natively, updating ``state`` in place; None when the kernel does not cover these
    arguments (the caller then runs the torch step). The caller guarantees: no autograd, the new key
    real, every key in the window real."""
    if not native.enabled():
        return None
    call = state.__dict__.get("_native_step")
    if call is None or not _still_valid(call, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map):
        call = _prepare(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map)
        if call is None:
            return None
        state.__dict__["_native_step"] = call
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copy for a model's one-token q, k, v
    if q.shape != call.q_shape or k.shape != call.kv_shape or v.shape != call.kv_shape or not _fp32_cpu(q, k, v):
        return None
    lib = native.load()
    if lib is None:
        return None
    out = torch.empty_like(q)
    if lib.hybrid_step_f32(*call.sizes, state.seen, *call.args[:2], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                           *call.args[2:], out.data_ptr()) != 0:
        return None
    state.seen += 1
    return out
