"""The optimizer, its learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from hybrid_llama.train.errors import NonFiniteError
from hybrid_llama.train.settings import OptimizerSettings

__all__ = ["make_optimizer", "lr_factor", "clip_and_check"]

Named = list[tuple[str, torch.nn.Parameter]]


def make_optimizer(named: Iterable[tuple[str, torch.nn.Parameter]], settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW over the trainable params in up to three groups: the mixing logits (names containing
    ``mixing.``) at ``logits_lr``, the feature maps (``feature_map.``) at ``feature_map_lr``, the
    rest at ``lr`` (a group's lr of None means ``lr``). Each group keeps its peak lr as ``base_lr``.

    The logits need far larger steps than the weights: moving a/b = sigmoid(logit) meaningfully takes
    O(1) changes, which lr 1e-3 does not reach in a short run; Hedgehog maps start at the identity
    and likewise want larger steps than a LoRA update of pretrained projections.
    """
    named = [(n, p) for n, p in named if p.requires_grad]
    if not named:
        raise ValueError("nothing to train: no parameter requires grad")

    def group_of(name: str) -> str:
        return "logits" if "mixing." in name else "feature_map" if "feature_map." in name else "weights"

    groups = []
    for group, lr in (("weights", None), ("logits", settings.logits_lr), ("feature_map", settings.feature_map_lr)):
        params = [p for n, p in named if group_of(n) == group]
        lr = settings.lr if lr is None else lr
        if params:
            groups.append({"params": params, "lr": lr, "base_lr": lr})
    return torch.optim.AdamW(groups, betas=tuple(settings.betas), weight_decay=settings.weight_decay, foreach=False)


def lr_factor(step: int, total: int, schedule: str, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based) of ``total``: linear warmup over
    ``warmup_ratio`` of the steps, then ``schedule`` (cosine | linear | constant) down to ``min_lr_ratio``."""
    warm = int(math.ceil(warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    if schedule == "constant":
        return 1.0
    progress = (step - warm) / max(1, total - warm - 1) if total - warm > 1 else 1.0
    progress = min(1.0, progress)
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - progress)
    raise ValueError(f"unknown schedule {schedule!r} (want cosine | linear | constant)")


def clip_and_check(named: Named, max_norm: float | None, step: int) -> float:
    """Clip the global grad norm of ``named``; a non-finite norm raises naming the first parameter
    with a bad grad. Returns the norm before clipping.

    The check runs before clipping: clipping by a NaN norm would spread NaN into every gradient.
    """
    grads = [(n, p.grad) for n, p in named if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for _, g in grads]))
    if not bool(torch.isfinite(norm)):
        for name, g in grads:
            if not bool(torch.isfinite(g).all()):
                raise NonFiniteError(step, name, "gradient")
        raise NonFiniteError(step, "gradient norm", "gradient")
    if max_norm:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, g in grads:
            g.mul_(coef.to(g.dtype))
    return float(norm)
