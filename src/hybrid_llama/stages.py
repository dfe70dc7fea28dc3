"""Build each model variant of the pipeline from its artifacts.

``load_stage(model_dir, stage, ...)`` is what evaluation and the workflow call:

- ``base``: the pretrained model as is;
- ``converted``: base with the hybrid layers as converted, untrained (e.g. the window-only control);
- ``transfer``: base + ``hybrid_layers.safetensors`` from attention transfer (needs ``hybrid``);
- ``transfer_lora``: the transfer model + the LoRA adapter of ``run_finetune`` (needs ``adapter``);
- ``base_lora``: base + a LoRA adapter trained on the plain model (the control).

With ``merge=True`` (default) adapters are merged into the weights by ``merge_lora_adapter``: the
result is a plain ``LlamaForCausalLM`` (with hybrid layers where configured, trained mixing logits and
feature maps copied in), so every evaluator sees the same class. ``merge=False`` returns the
``peft.PeftModel``.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybrid_llama.names import STAGES
from hybrid_llama.runtime import resolve_dtype

if TYPE_CHECKING:
    from hybrid_llama.layers import HybridConfig

__all__ = ["STAGES", "load_stage", "load_stage_for_eval", "load_base", "as_hybrid_config", "merge_lora_adapter",
           "weights_hash"]


def as_hybrid_config(hybrid: Any) -> HybridConfig | None:
    """A ``HybridConfig`` from a dict or a HybridConfig (None stays None)."""
    from hybrid_llama.layers import HybridConfig

    if hybrid is None or isinstance(hybrid, HybridConfig):
        return hybrid
    return HybridConfig.from_dict(dict(hybrid))


def load_base(model_dir: str | os.PathLike, *, dtype: Any = None, device: Any = None) -> tuple[nn.Module, Any]:
    """(model, tokenizer) of a resolved model directory (``hybrid_llama.models.load_model``), eval mode.

    ``dtype`` defaults to float32 (training and adapter merging want fp32 weights).
    """
    from hybrid_llama.models import load_model

    return load_model(model_dir, dtype=resolve_dtype(dtype) or torch.float32, device=device)


def load_stage(
    model_dir: str | os.PathLike,
    stage: str,
    *,
    hybrid: Any = None,
    hybrid_layers: str | os.PathLike | None = None,
    adapter: str | os.PathLike | None = None,
    dtype: Any = None,
    device: Any = None,
    merge: bool = True,
) -> tuple[nn.Module, Any]:
    """(model, tokenizer) for ``stage`` in ``STAGES`` (see module doc).

    ``hybrid``: HybridConfig or dict (required for transfer stages); ``hybrid_layers``: the
    ``hybrid_layers.safetensors`` of ``run_transfer``; ``adapter``: the peft directory of
    ``run_finetune``. Returns the model in eval mode on ``device`` in ``dtype`` (default float32).
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r} (want one of {STAGES})")
    cfg = as_hybrid_config(hybrid)
    if stage in ("transfer", "transfer_lora"):
        if cfg is None or hybrid_layers is None:
            raise ValueError(f"stage {stage!r} needs hybrid= and hybrid_layers=")
    elif stage == "converted":
        if cfg is None or hybrid_layers is not None:
            raise ValueError("stage 'converted' needs hybrid= and no hybrid_layers= (it is untrained)")
    elif hybrid_layers is not None or cfg is not None:
        raise ValueError(f"stage {stage!r} is a plain model: drop hybrid/hybrid_layers")
    if stage.endswith("_lora") and adapter is None:
        raise ValueError(f"stage {stage!r} needs adapter=")
    if not stage.endswith("_lora") and adapter is not None:
        raise ValueError(f"stage {stage!r} takes no adapter")

    # Adapters are applied in float32 so merging does not round twice; cast at the end.
    model, tok = load_base(model_dir, dtype=torch.float32)
    if cfg is not None:
        from hybrid_llama.models import convert_to_hybrid, load_hybrid_layers

        if hybrid_layers is None:
            convert_to_hybrid(model, **asdict(cfg))
        else:
            load_hybrid_layers(model, hybrid_layers, cfg)
    if adapter is not None and merge:
        merge_lora_adapter(model, adapter)
    elif adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    dt = resolve_dtype(dtype, device)
    if dt is not None or device is not None:
        model = model.to(device=device, dtype=dt)
    return model.eval(), tok


# Adapter settings the direct merge reproduces, at the value it assumes (what run_finetune writes).
_PLAIN_LORA = {"peft_type": "LORA", "use_dora": False, "fan_in_fan_out": False, "bias": "none",
               "lora_bias": False, "rank_pattern": {}, "alpha_pattern": {}}


@torch.no_grad()
def merge_lora_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """Merge a saved peft LoRA adapter into ``model`` in place, as ``merge_and_unload`` would.

    Each target weight gets ``(B @ A) * lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) added, and
    every ``modules_to_save`` tensor (mixing logits, feature maps) is copied over. Evaluation jobs
    load adapters this way to skip importing peft, which is slow; anything the adapter holds that
    does not match a parameter of ``model``, or a setting outside plain LoRA, is an error.
    """
    import json
    import math
    from pathlib import Path

    from hybrid_llama.files import load_safetensors

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    for key, plain in _PLAIN_LORA.items():
        if config.get(key, plain) not in (plain, None):
            raise ValueError(f"{adapter_dir}: adapter setting {key}={config[key]!r} is not plain LoRA; "
                             "load it with merge=False (peft) instead")
    rank = int(config["r"])
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    params = dict(model.named_parameters())
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_safetensors(adapter_dir / "adapter_model.safetensors", rule="lora").items():
        name = key.removeprefix("base_model.model.")
        lora = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if lora:
            factors.setdefault(lora[1], {})[lora[2]] = tensor
        elif name in params:
            params[name].copy_(tensor)
        else:
            raise ValueError(f"{adapter_dir}: adapter tensor {key!r} matches no parameter of the model")
    for module, ab in factors.items():
        weight = params.get(f"{module}.weight")
        if weight is None or ab.keys() != {"A", "B"}:
            raise ValueError(f"{adapter_dir}: LoRA factors of {module!r} have no target weight or lack A or B")
        weight += (ab["B"].to(weight) @ ab["A"].to(weight)) * scaling
    return model


def weights_hash(model_dir: str | os.PathLike) -> str:
    """sha256 of a resolved model's weights, from the ``hashes.json`` the workflow's weights rule
    writes: the file's own hash, or for shards the sha256 of their sorted ``{name: sha256}`` JSON."""
    import hashlib
    import json
    from pathlib import Path

    hashes = json.loads((Path(model_dir) / "hashes.json").read_text())
    if list(hashes) == ["model.safetensors"]:
        return hashes["model.safetensors"]
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def load_stage_for_eval(
    model_dir: str | os.PathLike,
    stage: str,
    *,
    hybrid: Any = None,
    hybrid_layers: str | os.PathLike | None = None,
    adapter: str | os.PathLike | None = None,
    device: str = "cpu",
    dtype: Any = None,
    labels: dict | None = None,
) -> tuple[nn.Module, Any, dict, str]:
    """``(model, tokenizer, meta, torch_device)`` of a stage for an evaluation job.

    ``device`` is the config's device (a cluster label allowed, checked by ``require_device``);
    ``adapter`` is the adapter directory or its ``adapter_model.safetensors``. ``meta`` records
    ``labels`` (model, variant, stage, the requested device), the hybrid settings and the sha256
    of every file the model was built from, so each result names exactly what it measured.
    """
    from pathlib import Path

    from hybrid_llama.files import sha256_of
    from hybrid_llama.runtime import require_device

    torch_device = require_device(device)
    adapter_file = None
    if adapter is not None:
        adapter = Path(adapter)
        adapter_file = adapter if adapter.suffix == ".safetensors" else adapter / "adapter_model.safetensors"
        adapter = adapter_file.parent
    model, tokenizer = load_stage(model_dir, stage, hybrid=hybrid, hybrid_layers=hybrid_layers, adapter=adapter,
                                  dtype=dtype, device=torch_device)
    meta = {
        **(labels or {}),
        "stage": stage,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "hybrid": hybrid,
        "model_hash": weights_hash(model_dir),
        "layers_hash": sha256_of(Path(hybrid_layers)) if hybrid_layers else None,
        "adapter_hash": sha256_of(adapter_file) if adapter_file else None,
    }
    return model, tokenizer, meta, torch_device
