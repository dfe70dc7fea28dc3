"""``HybridLlamaForCausalLM``: the ``hybrid_llama`` model type, loadable by ``AutoModelForCausalLM``.

A ``LlamaForCausalLM`` whose constructor converts ``config.hybrid``'s layers with the same step as
``convert_to_hybrid`` (``swap_in_hybrid_attention``), so the module tree and parameter names are
those of a converted Llama and ``from_pretrained`` fills the mixing logits and feature maps from
the checkpoint like any other weight. Generation uses the hybrid layers' recurrent cache
(``HybridCacheLayer``) as on a converted model. ``from_pretrained`` refuses a checkpoint with
missing, unexpected or mismatched keys instead of letting transformers initialize them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import LlamaForCausalLM

from hybrid_llama.files import safetensors_float_dtype
from hybrid_llama.layers import HybridConfig

from .configuration import HybridLlamaConfig
from .convert import swap_in_hybrid_attention

WEIGHTS_NAME = "model.safetensors"


class HybridLlamaForCausalLM(LlamaForCausalLM):
    """A Llama with hybrid attention in ``config.hybrid["layers"]`` (see ``HybridLlamaConfig``)."""

    config_class = HybridLlamaConfig

    def __init__(self, config: HybridLlamaConfig) -> None:
        super().__init__(config)
        if not config.hybrid:
            raise ValueError("HybridLlamaForCausalLM needs config.hybrid (the HybridConfig of its layers)")
        swap_in_hybrid_attention(self, HybridConfig.from_dict(dict(config.hybrid)))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any):
        """``PreTrainedModel.from_pretrained``, strict: every parameter must come from the checkpoint.

        transformers would initialize missing hybrid weights (mixing logits, feature maps) and go
        on, which is the silent failure this model type exists to prevent. A truncated local
        ``model.safetensors`` raises ``ArtifactError`` naming the file.
        """
        local = Path(pretrained_model_name_or_path) / WEIGHTS_NAME
        if local.is_file():
            safetensors_float_dtype(local, rule=None)
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                              **kwargs)
        problems = {k: sorted(map(str, v)) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")
                    if (v := info.get(k))}
        if problems:
            raise ValueError(f"{pretrained_model_name_or_path}: the checkpoint does not fit {cls.__name__} "
                             f"with hybrid settings {model.config.hybrid}: {problems}")
        return (model, info) if wants_info else model
