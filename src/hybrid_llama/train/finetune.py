"""LoRA finetuning of a (hybrid) model, with peft.

LoRA goes on q/k/v/o of the hybrid layers (``target: hybrid``) or of every layer (``target: all``);
the hybrid layers' mixing logits and learnable feature maps train too and are saved in the adapter
through peft's ``modules_to_save`` (the ``mixing`` and ``feature_map`` submodules). With
``hybrid=None`` this trains the "base + LoRA" control on the plain model. The objective is
instruction cross-entropy or distillation KL from the base model (``lora_objectives``).

``python -m hybrid_llama.train.finetune --help`` runs it from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybrid_llama.files import atomic_write
from hybrid_llama.names import RecallShape
from hybrid_llama.runtime import resolve_dtype
from hybrid_llama.stages import as_hybrid_config, load_base
from hybrid_llama.train.cli import add_hybrid_arguments, hybrid_from_arguments
from hybrid_llama.train.compute import autocast_active, pick_device, seed_everything
from hybrid_llama.train.lora_objectives import DistillObjective, InstructObjective, TokenObjective
from hybrid_llama.train.positions import RowShift, check_max_position
from hybrid_llama.train.settings import AdapterSettings, LoraSettings
from hybrid_llama.train.trainer import fit

if TYPE_CHECKING:
    from hybrid_llama.layers import HybridConfig

__all__ = ["run_finetune", "LoraSettings", "FINETUNE_DEFAULTS", "lora_targets"]

# Every key run_finetune's ``lora`` dict accepts, with its default (the schema's lora section).
FINETUNE_DEFAULTS: dict[str, Any] = LoraSettings.defaults()
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_targets(
    num_layers: int, target: str, layers: list[int] | None, hybrid_layers: list[int] | None, feature_maps: bool = False
) -> tuple[list[str], list[str]]:
    """(target_modules, modules_to_save) as explicit full module names of a ``LlamaForCausalLM``.
    ``feature_maps``: the hybrid layers' feature maps have parameters (Hedgehog) and train too."""
    if target not in ("hybrid", "all"):
        raise ValueError(f"lora.target must be 'hybrid' or 'all', got {target!r}")
    if layers is not None:
        layers = sorted({int(i) for i in layers})
    elif target == "hybrid" and hybrid_layers:
        layers = list(hybrid_layers)
    else:  # "all", or the plain-model control without an explicit layer list
        layers = list(range(num_layers))
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"lora layers {bad} out of range: the model has {num_layers} layers")
    targets = [f"model.layers.{i}.self_attn.{p}" for i in layers for p in PROJ]
    parts = ("mixing", "feature_map") if feature_maps else ("mixing",)
    save = [f"model.layers.{i}.self_attn.{part}" for i in (hybrid_layers or []) for part in parts]
    return targets, save


def _lora_model(model_dir: str | os.PathLike, adapter: AdapterSettings, hcfg: HybridConfig | None,
                hybrid_layers: str | os.PathLike | None, dtype: torch.dtype | None,
                device: torch.device) -> tuple[nn.Module, list[str], list[str]]:
    """(peft model on ``device`` in train mode, LoRA target modules, modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    # Weights stay fp32 for training (LoRA and logits need fp32 optimizer math); bf16 via autocast.
    model, _tok = load_base(model_dir, dtype=dtype)
    if hcfg is not None:
        if hybrid_layers is not None:
            from hybrid_llama.models import load_hybrid_layers

            load_hybrid_layers(model, hybrid_layers, hcfg)
        else:
            from hybrid_llama.models import convert_to_hybrid

            convert_to_hybrid(model, **asdict(hcfg))
    n_layers = len(model.model.layers)
    # Learnable feature maps (Hedgehog) are whatever feature-map module has parameters.
    has_fmaps = any(".feature_map." in name for name, _ in model.named_parameters())
    targets, save = lora_targets(n_layers, adapter.target, adapter.layers, hcfg.layers if hcfg else None,
                                 feature_maps=has_fmaps)
    peft_cfg = LoraConfig(
        r=int(adapter.r), lora_alpha=adapter.alpha, lora_dropout=adapter.dropout, target_modules=targets,
        modules_to_save=save or None, task_type="CAUSAL_LM", bias="none",
    )
    model = get_peft_model(model, peft_cfg).to(device)
    model.train()
    return model, targets, save


def run_finetune(
    model_dir: str | os.PathLike,
    data_path: str | os.PathLike,
    lora: dict | None,
    out_dir: str | os.PathLike,
    *,
    hybrid: Any = None,
    hybrid_layers: str | os.PathLike | None = None,
    teacher_states: str | os.PathLike | None = None,
    recall_rows: str | os.PathLike | None = None,
    callback: Callable[[int, dict[str, float]], None] | None = None,
) -> dict:
    """LoRA-finetune the base (``hybrid=None``) or hybrid model; returns the metrics dict.

    ``data_path``: instruction data (``prepare_instruct_data``) for objective "instruct", packed
    transfer-corpus rows (``prepare_transfer_corpus``) for "distill" (whose teacher is the model in
    ``model_dir``).

    ``hybrid`` (HybridConfig | dict) with ``hybrid_layers`` (``run_transfer``'s safetensors) builds the
    transferred model; ``hybrid`` without ``hybrid_layers`` converts without transfer.
    ``teacher_states``: ``run_transfer``'s ``teacher_states.safetensors``; for "distill", training
    rows found there skip the teacher's forward (``hybrid_llama.train.teacher_states``).
    ``recall_rows``: a ``prepare_recall_rows`` file of ``lora.recall_rows`` rows, trained beside the
    corpus rows with their answer positions weighted by ``lora.answer_weight`` (objective distill).
    ``lora``: the keys of the config schema's ``lora`` section (config/schema.yaml documents each
    one; missing keys take the schema's defaults, ``FINETUNE_DEFAULTS``), plus the run options
    checkpoint_dir (None = out_dir/checkpoints), resume and progress. LoRA goes on ``layers`` when
    given, else on the hybrid layers for target "hybrid", else on every layer ("all", or when
    hybrid is None). ``callback(step, logs)`` is called after every optimizer step (and checkpoint);
    raising ``StopTraining`` from it simulates a kill.

    Writes a peft adapter (``adapter_config.json``, ``adapter_model.safetensors``), ``loss.csv``
    (step,split,loss with split train|val; val at step 0 = before training and after each epoch;
    the loss is per token: NLL for instruct, KL for distill) and ``metrics.json`` into ``out_dir``.
    """
    s = LoraSettings.from_dict(lora)
    hcfg = as_hybrid_config(hybrid)
    if hybrid_layers is not None and hcfg is None:
        raise ValueError("hybrid_layers given without hybrid config")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(s.device)
    amp = bool(s.autocast)
    dtype = resolve_dtype(s.dtype)
    seed_everything(int(s.loop.seed))

    model, targets, save = _lora_model(model_dir, s.adapter, hcfg, hybrid_layers, dtype, device)
    bs = int(s.loop.batch_size)
    positions = getattr(model.config, "max_position_embeddings", None)
    check_max_position(int(s.max_position), 1, positions, "lora.max_position")
    shift = RowShift.of(s)
    objective: TokenObjective
    _check_recall_rows(s, recall_rows)
    if s.objective == "distill":
        if hcfg is None:
            raise ValueError("lora.objective 'distill' trains a hybrid model towards its base model: give hybrid=")
        teacher, _ = load_base(model_dir, dtype=dtype, device=device)
        objective = DistillObjective(model, data_path, teacher.requires_grad_(False), eval_sequences=s.eval_sequences,
                                     teacher_states=teacher_states, batch_size=bs, device=device, amp=amp,
                                     recall_rows=recall_rows, answer_weight=s.answer_weight,
                                     answer_target=s.answer_target, shift=shift)
    else:
        objective = InstructObjective(model, data_path, max_length=s.max_length,
                                      max_val_examples=s.max_val_examples, batch_size=bs, device=device, amp=amp,
                                      shift=shift)

    result = fit(objective, s.loop, s.optimizer, out, callback)

    model.eval()
    model.save_pretrained(str(out))
    named = objective.parameters()
    metrics = {
        "val_loss_before": objective.val_before,
        "val_loss_after": objective.val_per_epoch[-1] if objective.val_per_epoch else objective.validation_loss(),
        "val_loss_per_epoch": objective.val_per_epoch,
        "train_loss_final": objective.last_train_loss,
        "wall_time_s": result.elapsed_s,
        "train_tokens": result.tokens,
        "tokens_per_s": result.tokens / max(1e-9, result.elapsed_s),
        "steps": result.steps,
        "resumed_from_step": result.start_step,
        "objective": s.objective,
        "val_metric": objective.metric,
        "teacher_forwards": objective.teacher_forwards,
        "num_train": objective.num_rows,
        "num_val": objective.split_rows("val"),
        "num_recall_rows": 0 if recall_rows is None else s.recall_rows,
        "target_modules": targets,
        "modules_to_save": save,
        "num_trainable_params": sum(p.numel() for _, p in named),
        "device": str(device),
        "autocast_bf16": autocast_active(device, amp),  # what `autocast: true` meant on this device
        "hybrid": None if hcfg is None else {k: getattr(hcfg, k) for k in ("layers", "window", "formulation",
                                                                        "feature_map", "backend")},
        "lora": s.as_dict(),
    }
    atomic_write(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    return metrics


def _check_recall_rows(s: LoraSettings, path: str | os.PathLike | None) -> None:
    """The recall-rows file must be the one lora.recall_rows, its shape (recall_facts, recall_asks,
    recall_same_attribute, recall_subjects) and recall_seq_len describe."""
    if s.recall_rows == 0:
        if path is not None:
            raise ValueError("recall rows given but lora.recall_rows is 0")
        return
    if s.objective != "distill":
        raise ValueError("lora.recall_rows: recall rows train a distilled stage (lora.objective distill)")
    if path is None:
        raise ValueError(f"lora.recall_rows={s.recall_rows}: give the recall-rows file (recall_rows=)")
    from hybrid_llama.data import read_manifest

    m = read_manifest(path)
    # a manifest written before the later keys existed: asked at the end, attributes drawn, people's
    got = RecallShape(m.get("facts_per_row"), m.get("asks_per_row", RecallShape.asks),
                      m.get("same_attribute", RecallShape.same_attribute), m.get("subjects", RecallShape.subjects))
    want = RecallShape(s.recall_facts, s.recall_asks, s.recall_same_attribute, s.recall_subjects)
    if (m.get("num_sequences"), got) != (s.recall_rows, want) or s.recall_seq_len not in (None, m.get("seq_len")):
        raise ValueError(f"{path} holds {m.get('num_sequences')} rows of {got.facts} facts (shape {got.name}) and "
                         f"{m.get('seq_len')} tokens; lora asks for {s.recall_rows} of {want.facts} facts (shape "
                         f"{want.name}) and {s.recall_seq_len or 'any'} tokens")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybrid_llama.train.finetune", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument(
        "--data",
        required=True,
        help="instruction data (objective instruct) or packed transfer rows (distill) from hybrid_llama.data",
    )
    add_hybrid_arguments(
        ap, layers_help="comma-separated hybrid layers (omit for the base+LoRA control)", layers_required=False
    )
    ap.add_argument("--hybrid-layers", default=None, help="hybrid_layers.safetensors from the transfer stage")
    ap.add_argument("--teacher-states", default=None, help="teacher_states.safetensors from the transfer stage")
    ap.add_argument("--recall-rows", default=None, help="recall rows (hybrid_llama.recall_rows) for lora.recall_rows")
    ap.add_argument("--lora", default="{}", help="JSON dict of lora keys (config/schema.yaml: lora)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    m = run_finetune(
        a.model_dir, a.data, json.loads(a.lora), a.out, hybrid=hybrid_from_arguments(a), hybrid_layers=a.hybrid_layers,
        teacher_states=a.teacher_states, recall_rows=a.recall_rows,
    )
    print(json.dumps({k: m[k] for k in ("val_loss_before", "val_loss_after", "wall_time_s", "tokens_per_s")}, indent=1))


if __name__ == "__main__":
    main()
