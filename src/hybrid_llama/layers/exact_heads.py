"""KV heads of a hybrid layer kept exact: causal softmax over the whole context, as in the base model.

A few heads do most of a model's retrieval: while it reads a needle back, they put their attention on
the needle's tokens (``hybrid_llama.eval.retrieval_heads`` ranks them on the base model). Past the
training length the hybrid op keeps such a needle in its sparse cache but does not read it
(docs/long-context.md); these heads read it as base does. They cost a growing KV cache of their own
heads only, which the layer's cache slot keeps beside its constant-size state.

The hybrid op still computes every head (its kernels take whole layers); the exact heads' outputs
replace its output for their query heads. So every backend, the native kernels included, serves a
layer with exact heads unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .append_kv_cache import AppendKVCacheLayer


class ExactHeads:
    """The exact KV heads of one layer and the query heads each serves (GQA: ``group`` consecutive
    query heads per KV head, as transformers' ``repeat_kv`` pairs them)."""

    def __init__(self, kv_heads: list[int], num_kv_heads: int, group: int, scaling: float) -> None:
        bad = [h for h in kv_heads if not 0 <= h < num_kv_heads]
        if bad:
            raise ValueError(f"softmax_heads: KV head {bad[0]} does not exist (the layer has {num_kv_heads})")
        self.kv_heads = list(kv_heads)
        self.group, self.scaling = group, scaling
        self.q_heads = [h * group + j for h in self.kv_heads for j in range(group)]
        # Made per device on first use (a model built on the meta device has no data to move).
        self._indices: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def indices(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(query heads, KV heads) as index tensors on ``device``."""
        if device not in self._indices:
            self._indices[device] = (torch.tensor(self.q_heads, device=device),
                                     torch.tensor(self.kv_heads, device=device))
        return self._indices[device]

    def attend(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None,
               store: AppendKVCacheLayer | None) -> Tensor:
        """``out`` [B, H, T, D] with the exact heads' outputs in place of the op's; q ``[B, H, T, D]``
        and k, v ``[B, H_kv, T, D]`` with RoPE applied. ``store`` keeps the exact heads' keys and
        values across calls (a cache)."""
        q_index, kv_index = self.indices(q.device)
        return self._attend(out, q.index_select(1, q_index), k.index_select(1, kv_index),
                            v.index_select(1, kv_index), attention_mask, store)

    def step_before_rope(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor,
                         rope: tuple[Tensor, Tensor], store: AppendKVCacheLayer) -> Tensor:
        """:meth:`attend` for one unmasked token whose q and k arrive before RoPE (the native step
        applies it inside its kernel): RoPE goes on the exact heads' slices only."""
        q_index, kv_index = self.indices(q.device)
        qe, ke = apply_rotary_pos_emb(q.index_select(1, q_index), k.index_select(1, kv_index), *rope)
        return self._attend(out, qe, ke, v.index_select(1, kv_index), None, store)

    def _attend(self, out: Tensor, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None,
                store: AppendKVCacheLayer | None) -> Tensor:
        if store is not None:
            k, v = store.update(k, v)
        t, n = q.shape[2], k.shape[2]
        mask = exact_mask(attention_mask, t, n, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                           scale=self.scaling, enable_gqa=self.group > 1)
        if mask is not None:
            o = torch.nan_to_num(o)  # a padding query attends to nothing: 0, not NaN
        return out.index_copy(1, self.indices(q.device)[0], o.to(out.dtype))


def exact_mask(attention_mask: Tensor | None, t: int, n: int, device: torch.device) -> Tensor | None:
    """The boolean mask ``[B|1, 1, t, n]`` (True = attend) of ``t`` queries over the last ``n`` keys, the
    queries being the last ``t`` of them; None where plain causal attention (``is_causal``, or a
    single query over everything) is exact. Takes the mask the layer receives: None, a 2D padding
    mask ``[B, n]`` or a 4D mask (bool, or additive with 0 = attend)."""
    if attention_mask is None and (t == 1 or t == n):
        return None
    causal = torch.ones(t, n, dtype=torch.bool, device=device).tril(n - t)[None, None]
    if attention_mask is None:
        return causal
    m = attention_mask
    if m.dim() == 2:
        return causal & m[:, None, None, -n:].bool()
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    return m[..., -t:, -n:]
