"""Values kept between calls on the object they belong to: the one place that stores them.

A decode step maps one token, so rebuilding what it derives from the parameters (Hedgehog's fp32 or
signed weights, the sigmoids of the mixing logits) or re-checking a prepared native call would cost
as much as the step's own ops. Two forms, both in the owner's ``__dict__`` under a ``kept:`` name:

- :func:`kept`: a value derived from tensors, rebuilt when a source changes. Without autograd it is
  keyed by the sources' versions and storage: an in-place update (an optimizer step) bumps the
  version, a new tensor has new storage.
- :func:`held` / :func:`hold`: a value the caller checks itself (a prepared native call, checked by
  identity against what it was prepared from at every use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
PREFIX = "kept:"  # a name no attribute has, so a kept value never shadows one


def version_key(*tensors: Tensor) -> tuple | None:
    """``(version, data_ptr)`` of each tensor, or None for inference tensors (made under
    ``torch.inference_mode``), which keep no version counter: nothing derived from those is kept."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple((t._version, t.data_ptr()) for t in tensors)


def kept(owner: object, slot: str, sources: tuple[Tensor, ...], make: Callable[[], T]) -> T:
    """``make()``, kept in ``owner.__dict__[slot]`` until a source changes; recomputed every call under
    autograd (the result must carry the graph) or when a source has no version counter."""
    key = None if torch.is_grad_enabled() else version_key(*sources)
    if key is None:
        return make()
    hit = owner.__dict__.get(PREFIX + slot)
    if hit is None or hit[0] != key:
        hit = owner.__dict__[PREFIX + slot] = (key, make())
    return hit[1]


def held(owner: object, slot: str):
    """What :func:`hold` left on ``owner`` under ``slot``, else None."""
    return owner.__dict__.get(PREFIX + slot)


def hold(owner: object, slot: str, value) -> None:
    owner.__dict__[PREFIX + slot] = value

