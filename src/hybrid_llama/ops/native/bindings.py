"""What the Python side of the native kernels shares: tensors as the kernels read them, and calls
whose arguments are bound by the parameter names ``cpu_kernels.h`` declares.

A ctypes call is positional, so an argument added on one side only would shift every later one
(memory corruption, not an error). :class:`Kernel` takes the arguments by name and orders them as
the header declares them; a name missing or unknown raises, naming the entry point.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..feature_maps import FeatureMap, HedgehogFeatureMap, elu1, resolve_qk_maps
from . import build
from .build import DECLARATIONS, MAP_CODES, TILE


class Kernel:
    """One entry point of ``cpu_kernels.h``, called with keyword arguments."""

    def __init__(self, name: str) -> None:
        if name not in DECLARATIONS:
            raise KeyError(f"cpu_kernels.h declares no entry point {name!r}")
        self.name = name
        self.params = DECLARATIONS[name].param_names

    def bind(self, **named) -> tuple:
        """The arguments in the declared order; every declared name must be given, and only those."""
        if len(named) != len(self.params) or not all(p in named for p in self.params):
            missing = [p for p in self.params if p not in named]
            unknown = [n for n in named if n not in self.params]
            raise TypeError(f"{self.name}: arguments do not match cpu_kernels.h (missing {missing}, unknown {unknown})")
        return tuple(named[p] for p in self.params)

    def template(self, per_call: tuple[str, ...], **fixed) -> tuple[list, tuple[int, ...]]:
        """The bound arguments with the ``per_call`` ones left open, and where those go: for a call
        prepared once and made many times (``fill``)."""
        args = list(self.bind(**fixed, **dict.fromkeys(per_call)))
        return args, tuple(self.params.index(name) for name in per_call)

    def __call__(self, **named):
        return getattr(build.load(), self.name)(*self.bind(**named))


def fill(template: list, slots: tuple[int, ...], *values) -> list:
    """``template`` with ``values`` at ``slots`` (``Kernel.template``'s), as a new list."""
    args = template[:]
    for slot, value in zip(slots, values):
        args[slot] = value
    return args


def fp32_cpu(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def fp32_rows(x: Tensor) -> Tensor:
    """fp32 with a contiguous last dim (the kernels take the other strides as they are)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def strides3(x: Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def map_parameters(fmap, heads: int, D: int, *, cast: bool = False) -> tuple[Tensor, Tensor] | None:
    """A Hedgehog map's ``(W [heads, D, F/2], b [heads, 1, F/2])`` as the kernels read them, or None.

    ``cast``: fp32 copies of a map held in another dtype. The prefill kernels compute in fp32 and
    hand back the model's dtype, so a model evaluated in bf16 takes them too; the decode step keeps
    its state in the model's dtype and asks for fp32 maps as they are."""
    if not isinstance(fmap, HedgehogFeatureMap) or fmap.num_heads != heads or fmap.head_dim != D:
        return None
    W, bias = fmap.weight, fmap.bias
    fh = fmap.feature_dim
    if W.shape != (heads, D, fh) or bias.numel() != heads * fh:
        return None
    if cast and W.is_cpu and bias.is_cpu:
        W, bias = (t.detach().float().contiguous() for t in (W, bias))
    return (W, bias) if fp32_cpu(W, bias) else None


def prefill_maps(feature_map: FeatureMap, H: int, Hk: int, D: int) -> tuple[int, tuple, int] | None:
    """``(map code, (wq, bq, wk, bk), F)`` as the prefill kernels read the maps, or None for other maps."""
    phi_q, phi_k = resolve_qk_maps(feature_map)
    if phi_q is elu1 and phi_k is elu1:
        return MAP_CODES["elu1"], (None,) * 4, D
    qmap, kmap = map_parameters(phi_q, H, D, cast=True), map_parameters(phi_k, Hk, D, cast=True)
    if qmap is None or kmap is None or qmap[0].shape[2] != kmap[0].shape[2]:
        return None
    return MAP_CODES["hedgehog"], (*(t.detach() for t in qmap), *(t.detach() for t in kmap)), 2 * qmap[0].shape[2]


def pointers(*tensors: Tensor | None) -> tuple[int | None, ...]:
    return tuple(None if t is None else t.data_ptr() for t in tensors)


__all__ = ["Kernel", "fill", "fp32_cpu", "fp32_rows", "strides3", "map_parameters", "prefill_maps", "pointers", "TILE"]
