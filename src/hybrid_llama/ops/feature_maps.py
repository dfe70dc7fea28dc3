"""Feature maps phi for the linear-attention part.

Every map takes ``[B, H, T, D]`` and returns strictly positive features ``[B, H, T, F]``; positivity
keeps the linear normalizer ``phi(q) . sum phi(k)`` above zero.

The ops take ``feature_map`` as ``"elu1"`` (fused where a backend can), one callable applied to both
queries and keys, or a pair ``(query_map, key_map)``. A pair lets the key map work at the KV heads
(GQA): the key features, and so the linear state, stay once per KV head while each query head has
its own query map.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kept import kept

FeatureMap = str | Callable[[Tensor], Tensor] | tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]


def elu1(x: Tensor) -> Tensor:
    """``elu(x) + 1``: positive, F = D (the map of "Linear Transformers are RNNs")."""
    return F.elu(x) + 1.0


class HedgehogFeatureMap(nn.Module):
    """Learnable Hedgehog map: ``softmax(x W_h) ++ softmax(-x W_h)`` per head.

    ``feature_dim`` is the width of the projection (default ``head_dim``); the output has
    ``out_features = 2 * feature_dim`` channels. ``W_h`` starts as the identity (or its truncation
    when ``feature_dim != head_dim``), so the untrained map is the parameter-free
    ``softmax(x) ++ softmax(-x)``, which is the usual starting point before attention transfer.
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.feature_dim = feature_dim or head_dim
        self.out_features = 2 * self.feature_dim
        eye = torch.eye(head_dim, self.feature_dim)
        self.weight = nn.Parameter(eye.unsqueeze(0).repeat(num_heads, 1, 1))  # [H, D, Fh]
        self.bias = nn.Parameter(torch.zeros(num_heads, 1, self.feature_dim))  # [H, 1, Fh]

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] != self.num_heads or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"HedgehogFeatureMap({self.num_heads} heads, dim {self.head_dim}) got input {tuple(x.shape)}"
            )
        # softmax(x W + b) ++ softmax(-(x W + b)), in fp32 (the softmax over features is the whole
        # map, keep it accurate), as one softmax over the stacked pair.
        xf, Fh = x.float(), self.feature_dim
        if x.shape[0] == 1 and x.shape[2] == 1:
            # One token (a decode step): the product is bound by reading W, which the rest of a model
            # has evicted from the caches by the next token, so read W once and negate the result.
            weight, bias = self.fp32_parameters(signed=False)
            proj = torch.baddbmm(bias, xf[0], weight)  # [H, 1, Fh]
            out = torch.softmax(torch.stack([proj, proj.neg()], dim=-2), dim=-1).view(*x.shape[:3], 2 * Fh)
        else:  # many rows: one product with [W, -W] beats a second pass over the projections
            weight, bias = self.fp32_parameters(signed=True)
            if x.shape[0] == 1:  # one fused bmm + bias over the heads (a 4-D matmul issues several ops)
                proj = torch.baddbmm(bias, xf[0], weight).unsqueeze(0)  # [1, H, T, 2 Fh]
            else:
                proj = torch.matmul(xf, weight) + bias  # [B, H, T, 2 Fh]
            out = torch.softmax(proj.view(*proj.shape[:3], 2, Fh), dim=-1).view(proj.shape)
        return out.to(x.dtype)

    def fp32_parameters(self, signed: bool) -> tuple[Tensor, Tensor]:
        """``(W, b)`` in fp32, or with ``signed`` ``[W, -W]`` ``[H, D, 2 Fh]`` and ``[b, -b]``
        ``[H, 1, 2 Fh]``. Without autograd they are kept until the parameters change (``kept``)."""
        return kept(self, f"_fp32_parameters_{signed}", (self.weight, self.bias), lambda: self._fp32(signed))

    def _fp32(self, signed: bool) -> tuple[Tensor, Tensor]:
        w, b = self.weight.float(), self.bias.float()
        return (torch.cat([w, -w], dim=-1), torch.cat([b, -b], dim=-1)) if signed else (w, b)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"


def is_elu1(feature_map: FeatureMap) -> bool:
    """True for the parameter-free elu1 map (by name or as the function), which backends may fuse."""
    return feature_map is elu1 or (isinstance(feature_map, str) and feature_map == "elu1")


def is_pair(feature_map: FeatureMap) -> bool:
    """True for a ``(query_map, key_map)`` pair."""
    return isinstance(feature_map, (tuple, list)) and len(feature_map) == 2


def resolve_qk_maps(feature_map: FeatureMap) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """(map for queries, map for keys) of the ``feature_map`` argument of the ops."""
    if is_pair(feature_map):
        return resolve_feature_map(feature_map[0]), resolve_feature_map(feature_map[1])
    phi = resolve_feature_map(feature_map)
    return phi, phi


def keys_need_query_heads(feature_map: FeatureMap) -> bool:
    """A single callable other than elu1 may be per head (a HedgehogFeatureMap of H heads), so it must
    see k expanded to the query heads; elu1 and a (query_map, key_map) pair read k at the KV heads."""
    return not (is_elu1(feature_map) or is_pair(feature_map))


def resolve_feature_map(feature_map: FeatureMap) -> Callable[[Tensor], Tensor]:
    """Turn one map (a name or a callable) into a callable."""
    if is_pair(feature_map):
        raise ValueError("a (query_map, key_map) pair has two maps: use resolve_qk_maps")
    if callable(feature_map):
        return feature_map
    if feature_map == "elu1":
        return elu1
    if feature_map == "hedgehog":
        raise ValueError(
            "feature_map='hedgehog' is learnable: pass a HedgehogFeatureMap(num_heads, head_dim) module instead"
        )
    raise ValueError(f"unknown feature_map {feature_map!r}; use 'elu1' or a module [B,H,T,D] -> [B,H,T,F]")


def feature_dim_of(feature_map: FeatureMap, head_dim: int) -> int:
    """Width F of the features a map produces for ``head_dim`` inputs (the key map's, for a pair)."""
    if is_pair(feature_map):
        return feature_dim_of(feature_map[1], head_dim)
    if isinstance(feature_map, HedgehogFeatureMap):
        return feature_map.out_features
    if is_elu1(feature_map):
        return head_dim
    out_features = getattr(feature_map, "out_features", None)
    if out_features is not None:
        return int(out_features)
    raise ValueError(f"cannot infer the feature width of {feature_map!r}; give feature_dim explicitly")
