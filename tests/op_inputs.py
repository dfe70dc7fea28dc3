"""Inputs shared by the native kernels' tests (imported by them; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from hybrid_llama.ops import HedgehogFeatureMap


def trained_maps(H: int, Hk: int, D: int, seed: int = 3) -> tuple[HedgehogFeatureMap, HedgehogFeatureMap]:
    """Hedgehog maps for H query heads and Hk KV heads, moved away from their identity start so that
    W and b matter."""
    g = torch.Generator().manual_seed(seed)
    maps = (HedgehogFeatureMap(H, D), HedgehogFeatureMap(Hk, D))
    with torch.no_grad():
        for m in maps:
            m.weight.add_(0.3 * torch.randn(m.weight.shape, generator=g))
            m.bias.add_(0.5 * torch.randn(m.bias.shape, generator=g))
    return maps


def count_calls(monkeypatch, module, name: str) -> dict[str, int]:
    """Wrap ``module.name`` (a native path that returns None where it declines) to count the calls
    that ran and those it declined."""
    calls = {"ran": 0, "declined": 0}
    real = getattr(module, name)

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["ran" if out is not None else "declined"] += 1
        return out

    monkeypatch.setattr(module, name, counting)
    return calls
