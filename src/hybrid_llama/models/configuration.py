"""The ``hybrid_llama`` model type's config: a ``LlamaConfig`` that carries the hybrid settings.

Saved hybrids write ``model_type: "hybrid_llama"`` in config.json, so transformers' Auto classes
either build :class:`~hybrid_llama.models.modeling.HybridLlamaForCausalLM` (once ``import
hybrid_llama`` registered the type) or stop with their unknown-model-type error; never a plain
Llama that would silently run full softmax attention in the hybrid layers.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

MODEL_TYPE = "hybrid_llama"


@strict
class HybridLlamaConfig(LlamaConfig):
    """``LlamaConfig`` + ``hybrid``: the ``HybridConfig.to_dict()`` of the converted layers."""

    model_type = MODEL_TYPE

    hybrid: dict | None = None

    @classmethod
    def from_llama(cls, config: LlamaConfig, hybrid: dict[str, Any] | None = None) -> HybridLlamaConfig:
        """The hybrid config of a (converted) Llama's config: every Llama setting kept, ``hybrid``
        from the argument or, by default, the ``config.hybrid`` that ``convert_to_hybrid`` recorded."""
        d = config.to_dict()
        for key in ("model_type", "architectures", "transformers_version"):
            d.pop(key, None)
        d["hybrid"] = dict(hybrid if hybrid is not None else d.get("hybrid") or {}) or None
        return cls.from_dict(d)
