"""Hybrid attention as a drop-in replacement for transformers' ``LlamaAttention``.

The layer keeps the pretrained q/k/v/o projections and RoPE, and replaces the softmax over all past
keys by ``hybrid_llama.ops.hybrid_attention``: softmax over the last ``window`` keys mixed with
linear attention over the keys that left the window. Per-head mixing logits live in ``.mixing``.

With a transformers cache (``model.generate(..., use_cache=True)``) the layer keeps a constant-size
``HybridState`` in the cache object transformers created: its slot in ``cache.layers`` is swapped for
a :class:`HybridCacheLayer` on first use, while softmax layers keep their normal KV cache.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb

from hybrid_llama.config import SPARSE_CACHE_KEYS, without_unused_hybrid_keys
from hybrid_llama.ops import (
    FORMULATIONS,
    DeferredState,
    HedgehogFeatureMap,
    SparseCacheConfig,
    continues_at_once,
    hybrid_attention_continue,
    hybrid_attention_step,
    layer_prompt,
    native_step_in_place,
    takes_native_step,
)
from hybrid_llama.ops.kept import kept

from .exact_heads import ExactHeads
from .hybrid_cache import HybridCacheLayer, hybrid_cache_layer
from .softmax_attention import qkv_heads, rotary_qkv

FEATURE_MAPS = ("elu1", "hedgehog")


@dataclass
class HybridConfig:
    """Which layers are hybrid and how; stored as ``model.config.hybrid`` (a dict) in config.json."""

    layers: list[int] = field(default_factory=list)
    window: int = 64
    formulation: str = "hybrid"
    feature_map: str = "elu1"  # "elu1" | "hedgehog"
    backend: str = "auto"
    # The third memory (ops.sparse): keys per KV head kept exactly, pinned first positions, and the
    # rule that picks the keys; 0 and 0 leave the layer as it is. ``.sparse`` holds them as the
    # ``SparseCacheConfig`` the ops take, made whenever one of them is set.
    sparse_cache: int = 0
    sinks: int = 0
    cache_score: str = "sre"
    # KV heads kept exact: ``[layer, kv_head]`` pairs whose query heads attend with causal softmax
    # over the whole context (a growing KV cache) instead of the hybrid op; the heads a base model
    # reads a needle with (``hybrid_llama.eval.retrieval_heads``). Empty: none.
    softmax_heads: list[list[int]] = field(default_factory=list)
    # A decaying linear state: the initial gamma of ``S <- gamma S + phi(k) v^T`` (one learnable gamma
    # = sigmoid(decay_logit) per KV head, in ``.mixing``, trained with the mixing logits); None: no
    # decay, the sums grow with every key that leaves the window.
    decay: float | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in SPARSE_CACHE_KEYS and all(f in self.__dict__ for f in SPARSE_CACHE_KEYS):
            super().__setattr__("sparse", SparseCacheConfig(self.sparse_cache, self.sinks, self.cache_score))

    def __post_init__(self) -> None:
        self.layers = sorted({int(i) for i in self.layers})
        if int(self.window) < 1:
            raise ValueError(f"HybridConfig.window must be >= 1, got {self.window}")
        self.window = int(self.window)
        if self.formulation not in FORMULATIONS:
            raise ValueError(f"HybridConfig.formulation must be one of {FORMULATIONS}, got {self.formulation!r}")
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"HybridConfig.feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
        try:
            self.sparse.require_formulation(self.formulation)
        except ValueError as exc:
            raise ValueError(f"HybridConfig: {exc}") from None
        self.softmax_heads = normalized_softmax_heads(self.softmax_heads, self.layers)
        if self.decay is not None:
            self.decay = float(self.decay)
            if not 0.0 < self.decay < 1.0:
                raise ValueError(f"HybridConfig.decay must be in (0, 1) or None, got {self.decay}")

    def to_dict(self) -> dict[str, Any]:
        """The config as config.json stores it; the sparse-cache keys only when the cache is on, so
        models saved without it keep their exact config."""
        return without_unused_hybrid_keys(asdict(self))

    def softmax_heads_of(self, layer: int) -> list[int]:
        """The KV heads of ``layer`` kept exact."""
        return [h for i, h in self.softmax_heads if i == layer]

    @property
    def native_steps(self) -> bool:
        """Whether a generate step may take the native CPU call (``ops.takes_native_step``)."""
        return takes_native_step(self.backend, self.sparse)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown HybridConfig keys {sorted(unknown)}")
        return cls(**d)


def normalized_softmax_heads(pairs, layers: list[int]) -> list[list[int]]:
    """``pairs`` as sorted, unique ``[layer, kv_head]`` lists; ValueError unless each names a hybrid layer."""
    out = set()
    for pair in pairs or []:
        if len(pair) != 2 or int(pair[1]) < 0:
            raise ValueError(f"HybridConfig.softmax_heads: {pair!r} is not a [layer, kv_head] pair")
        layer, head = int(pair[0]), int(pair[1])
        if layer not in layers:
            raise ValueError(f"HybridConfig.softmax_heads: layer {layer} is not a hybrid layer ({layers})")
        out.add((layer, head))
    return [list(p) for p in sorted(out)]


class MixingLogits(nn.Module):
    """Per-head logits of the two attention parts; sigmoid(0) = 0.5 each at init. With a ``decay``
    (initial gamma), also ``decay_logit`` per KV head: the linear state decays by sigmoid(decay_logit)
    per position. It lives here so that it trains, saves and loads as the mixing logits do."""

    def __init__(self, num_heads: int, decay: float | None = None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.window_logit = nn.Parameter(torch.zeros(num_heads))
        self.linear_logit = nn.Parameter(torch.zeros(num_heads))
        if decay is not None:
            self.decay_logit = nn.Parameter(torch.full((num_kv_heads or num_heads,), math.log(decay / (1 - decay))))

    def extra_repr(self) -> str:
        return f"num_heads={self.window_logit.numel()}"


class Elu1FeatureMap(nn.Module):
    """``elu(x) + 1`` as a module (no parameters), so every hybrid layer has a ``.feature_map``."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.out_features = head_dim

    def forward(self, x: Tensor) -> Tensor:
        return F.elu(x) + 1.0


class QKFeatureMaps(nn.Module):
    """Learnable maps for queries (``.q``, one per query head) and keys (``.k``, one per KV head).

    Keys are mapped at the KV heads (GQA), so the linear state ``S, z`` is kept once per KV head, as
    for elu1; each query head still has its own query map. The ops get them as a (query_map, key_map)
    pair (``op_feature_map``).
    """

    def __init__(self, q: nn.Module, k: nn.Module) -> None:
        super().__init__()
        self.q, self.k = q, k
        self.out_features = k.out_features

    @property
    def op_feature_map(self) -> tuple[nn.Module, nn.Module]:
        return self.q, self.k


def make_feature_map(kind: str, num_heads: int, head_dim: int, num_kv_heads: int | None = None) -> nn.Module:
    """The ``.feature_map`` of a hybrid layer: parameter-free elu1, or Hedgehog maps for queries
    (``num_heads``) and keys (``num_kv_heads``, default ``num_heads``)."""
    if kind == "elu1":
        return Elu1FeatureMap(head_dim)
    if kind == "hedgehog":
        return QKFeatureMaps(
            HedgehogFeatureMap(num_heads, head_dim), HedgehogFeatureMap(num_kv_heads or num_heads, head_dim)
        )
    raise ValueError(f"unknown feature_map {kind!r}; use one of {FEATURE_MAPS}")


def keys_valid_from_mask(attention_mask: Tensor | None, q_len: int) -> Tensor | None:
    """``[B, q_len]`` bool (True = real key) for the new keys, read from the mask the layer receives.

    Accepts None (all real), a 2D padding mask ``[B, kv]`` (flash-attention style), or a 4D mask
    ``[B, 1|H, q, kv]`` (bool: True = attend; float: additive, 0 = attend). A new key counts as real
    when any query row may attend to it: padding masks remove whole key columns, while causal or
    packed-sequence block masks always leave the key's own row open. Returns None if all are real.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"hybrid layers need a tensor attention mask (not {type(attention_mask).__name__})")
    m = attention_mask
    if m.dim() == 2:
        valid = m[:, -q_len:].bool()
    elif m.dim() == 4:
        m = m[:, 0, :, -q_len:]  # [B, q, q_len]
        if m.dtype != torch.bool:
            m = m > torch.finfo(m.dtype).min / 2
        valid = m.any(dim=1)
    else:
        raise ValueError(f"attention mask must be 2D or 4D, got shape {tuple(m.shape)}")
    if bool(valid.all()):
        return None
    return valid


class HybridLlamaAttention(LlamaAttention):
    """``LlamaAttention`` with sliding-window softmax + linear attention (``hybrid_llama.ops``)."""

    def __init__(self, config, layer_idx: int, hybrid: HybridConfig) -> None:
        super().__init__(config, layer_idx)
        self.hybrid = hybrid
        self.num_heads = config.num_attention_heads
        self.mixing = MixingLogits(self.num_heads, hybrid.decay, config.num_key_value_heads)
        self.feature_map = make_feature_map(
            hybrid.feature_map, self.num_heads, self.head_dim, config.num_key_value_heads
        )
        kept = hybrid.softmax_heads_of(layer_idx)
        n_kv = config.num_key_value_heads
        self.exact = ExactHeads(kept, n_kv, self.num_heads // n_kv, self.scaling) if kept else None

    def project(
        self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[B, H, T, D]`` and k, v ``[B, H_kv, T, D]`` of the layer's input, RoPE applied to q, k.
        k/v stay at the KV heads (GQA): the kernels index them, and the decode state (window
        buffers, S, z) is kept once per KV head instead of once per query head."""
        return rotary_qkv(self, hidden_states, position_embeddings)

    def op_feature_map(self):
        """The layer's feature map as the ops take it: "elu1" by name (so backends can use their
        fused path), learnable maps as a (query_map, key_map) pair of modules."""
        # Read from the modules' own tables where they are ours: a decode step asks every token, and
        # nn.Module.__getattr__ costs several times more. A wrapper (peft's) answers through its own.
        fm = self._modules["feature_map"]
        if isinstance(fm, Elu1FeatureMap):
            return "elu1"
        if type(fm) is QKFeatureMaps:
            maps = fm._modules
            return maps["q"], maps["k"]
        return fm.op_feature_map

    def op_logits(self) -> tuple[Tensor, Tensor]:
        """(window_logit, linear_logit) as the ops take them (read as ``op_feature_map`` reads the maps)."""
        mixing = self._modules["mixing"]
        if type(mixing) is MixingLogits:
            logits = mixing._parameters
            return logits["window_logit"], logits["linear_logit"]
        return mixing.window_logit, mixing.linear_logit

    def op_log_decay(self) -> Tensor | None:
        """log gamma ``[H_kv]`` of a decaying linear state, as the ops take it (fp32, whatever the
        parameter's dtype); None without a decay. Without autograd the same tensor comes back until the
        parameter changes (``ops.kept``): the native step binds it once per state and reads it in place."""
        if self.hybrid.decay is None:
            return None
        logit = self._modules["mixing"].decay_logit
        return kept(logit, "_log_decay_fp32", (logit,), lambda: F.logsigmoid(logit.float()))

    def forward(
        self,
        hidden_states: Tensor,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        # transformers >= 5.2x passes the cache as `cache`, earlier 5.x as `past_key_values`.
        past_key_values = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        q_len = input_shape[-1]
        cfg = self.hybrid
        slot = hybrid_cache_layer(past_key_values, self.layer_idx) if past_key_values is not None else None
        if (q_len == 1 and slot is not None and hidden_states.is_cpu and attention_mask is None
                and cfg.native_steps and type(self).project is HybridLlamaAttention.project):
            # A generate step on the CPU: the one native call, RoPE included, without the general path's
            # dispatch or apply_rotary_pos_emb's small ops (inside a model each runs cold and costs more
            # than its arithmetic; docs/performance.md).
            q, k, v = qkv_heads(self, hidden_states)
            out = self._native_step(q, k, v, slot, position_embeddings)
            if out is not None:
                if self.exact is not None:
                    out = self.exact.step_before_rope(out, q, k, v, position_embeddings, slot.exact_store())
                return self.o_proj(out.transpose(1, 2).reshape(*input_shape, -1)), None
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        else:
            q, k, v = self.project(hidden_states, position_embeddings)
        valid = keys_valid_from_mask(attention_mask, q_len)

        if slot is None or slot.state is None:
            if slot is not None and slot.seen > 0:
                raise RuntimeError(
                    f"layer {self.layer_idx}: the cache saw {slot.seen} tokens without keeping a hybrid state "
                    "(forward ran in training mode); run the prefill in eval mode to decode"
                )
            # Training forwards never decode: they skip the final state.
            keep_state = slot is not None and not self.training
            out, state = layer_prompt(q, k, v, *self.op_logits(), window=cfg.window, backend=cfg.backend,
                                      formulation=cfg.formulation, feature_map=self.op_feature_map(),
                                      key_padding_mask=valid, keep_state=keep_state, sparse=cfg.sparse,
                                      log_decay=self.op_log_decay())
            if isinstance(state, DeferredState):
                slot.defer_state(state)
            elif slot is not None:
                slot.set_state(state, q_len)
        elif q_len > 1 and valid is None and continues_at_once(cfg.sparse, slot.state):
            # Several tokens on a cache (a new turn, a shared prompt's suffix): one product, not a step each.
            out, state = hybrid_attention_continue(q, k, v, slot.state, *self.op_logits(),
                                                   feature_map=self.op_feature_map(), formulation=cfg.formulation,
                                                   sparse=cfg.sparse, log_decay=self.op_log_decay())
            slot.set_state(state, q_len)
        else:
            fmap, (wl, ll), log_decay = self.op_feature_map(), self.op_logits(), self.op_log_decay()
            state, outs = slot.state, []
            for t in range(q_len):
                # One token (every generate step): q, k, v as they are; slicing costs ops that run cold.
                o, state = hybrid_attention_step(
                    *((q, k, v) if q_len == 1 else (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])),
                    state,
                    wl,
                    ll,
                    feature_map=fmap,
                    formulation=cfg.formulation,
                    key_valid=None if valid is None else valid[:, t],
                    backend=cfg.backend,
                    inplace=not torch.is_grad_enabled(),  # the cache owns its state
                    sparse=cfg.sparse,
                    log_decay=log_decay,
                )
                outs.append(o)
            out = outs[0] if q_len == 1 else torch.cat(outs, dim=2)
            slot.set_state(state, q_len)

        if self.exact is not None:
            out = self.exact.attend(out, q, k, v, attention_mask, None if slot is None else slot.exact_store())

        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), None

    def _native_step(self, q: Tensor, k: Tensor, v: Tensor, slot: HybridCacheLayer,
                     position_embeddings: tuple[Tensor, Tensor]) -> Tensor | None:
        """An inference step of one unmasked token, q and k before RoPE, as ``native_step_in_place`` (None
        where it does not apply, a prompt's first token included: the general path then runs it)."""
        state = slot.state
        if state is None:
            return None
        out = native_step_in_place(q, k, v, state, *self.op_logits(), self.hybrid.formulation, self.op_feature_map(),
                                   position_embeddings, self.op_log_decay(), self.hybrid.sparse)
        if out is not None:
            slot.set_state(state, 1)
        return out

    def extra_repr(self) -> str:
        c = self.hybrid
        text = f"window={c.window}, formulation={c.formulation}, feature_map={c.feature_map}, backend={c.backend}"
        if c.decay is not None:
            text += f", decay={c.decay}"
        if c.sparse.active:
            text += f", sparse_cache={c.sparse_cache}, sinks={c.sinks}, cache_score={c.cache_score}"
        if self.exact is not None:
            text += f", softmax_heads={self.exact.kv_heads}"
        return text
