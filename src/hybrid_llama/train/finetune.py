"""LoRA finetuning of a (hybrid) model, with peft.

LoRA goes on q/k/v/o of the hybrid layers (``target: hybrid``) or of every layer (``target: all``);
the hybrid layers' mixing logits and learnable feature maps train too and are saved in the adapter
through peft's ``modules_to_save`` (the ``mixing`` and ``feature_map`` submodules). With
``hybrid=None`` this trains the "base + LoRA" control on the plain model.

Two objectives:
- ``instruct``: next-token cross-entropy on the responses of instruction data (Dolly), as the
  published recreation finetunes;
- ``distill``: the KL divergence from the frozen base model's next-token distribution to the
  hybrid model's, on rows of the transfer corpus. Where attention transfer matches each layer on
  its own, this trains the layers together on what the model outputs, which is what held-out
  perplexity measures.

``python -m hybrid_llama.train.finetune --help`` runs it from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_llama.data import IGNORE_INDEX, load_instruct, load_packed
from hybrid_llama.stages import as_hybrid_config, load_base
from hybrid_llama.train.common import (
    LossCSV,
    NonFiniteError,
    add_hybrid_arguments,
    autocast,
    autocast_active,
    batch_order,
    hybrid_from_arguments,
    merge_config,
    pick_device,
    run_steps,
    seed_everything,
    stage_defaults,
)

__all__ = ["run_finetune", "FINETUNE_DEFAULTS", "lora_targets", "validation_loss"]

# The schema's lora section (config/schema.yaml).
FINETUNE_DEFAULTS: dict[str, Any] = stage_defaults("lora")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_targets(
    num_layers: int, lora: dict, hybrid_layers: list[int] | None, feature_maps: bool = False
) -> tuple[list[str], list[str]]:
    """(target_modules, modules_to_save) as explicit full module names of a ``LlamaForCausalLM``.
    ``feature_maps``: the hybrid layers' feature maps have parameters (Hedgehog) and train too."""
    if lora["target"] not in ("hybrid", "all"):
        raise ValueError(f"lora.target must be 'hybrid' or 'all', got {lora['target']!r}")
    if lora["layers"] is not None:
        layers = sorted({int(i) for i in lora["layers"]})
    elif lora["target"] == "hybrid" and hybrid_layers:
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


def _trim(batch: dict[str, torch.Tensor], max_length: int | None) -> dict[str, torch.Tensor]:
    # Right padding: cut columns past the longest real row (and past max_length).
    width = int(batch["attention_mask"].sum(1).max())
    if max_length is not None:
        width = min(width, int(max_length))
    return {k: v[:, :width] for k, v in batch.items()}


class InstructObjective:
    """Next-token cross-entropy on the response tokens of instruction data (``prepare_instruct_data``)."""

    metric = "nll"

    def __init__(self, path: str | os.PathLike, cfg: dict) -> None:
        self.train = load_instruct(path, "train")
        self.val = load_instruct(path, "val")
        if cfg["max_val_examples"] is not None:
            self.val = {k: v[: int(cfg["max_val_examples"])] for k, v in self.val.items()}
        self.max_length = cfg["max_length"]

    def rows(self, split: str) -> int:
        return len((self.train if split == "train" else self.val)["input_ids"])

    def batch(self, split: str, idx, device) -> dict[str, torch.Tensor]:
        data = self.train if split == "train" else self.val
        return _trim({k: v[idx].to(device) for k, v in data.items()}, self.max_length)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Summed next-token NLL over label tokens, and their count."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        return nll, int((labels != IGNORE_INDEX).sum())


class DistillObjective:
    """KL(teacher || student) of the next-token distributions, summed over every position of packed
    transfer-corpus rows; the last ``eval_sequences`` rows are held out for validation."""

    metric = "kl"

    def __init__(self, path: str | os.PathLike, cfg: dict, teacher: nn.Module,
                 teacher_states: str | os.PathLike | None = None) -> None:
        rows = load_packed(path)
        k = int(cfg["eval_sequences"])
        if not 1 <= k < len(rows):
            raise ValueError(f"{path}: {len(rows)} rows, need 1 <= lora.eval_sequences={k} < rows")
        self.train, self.val = rows[:-k], rows[-k:]
        self.teacher = teacher
        self.teacher_forwards = 0
        # The training rows' teacher states from attention transfer, when it saved them (teacher_states.py).
        self.train_states = None
        if teacher_states is not None:
            from hybrid_llama.train.teacher_states import TeacherStates

            weight = next(teacher.parameters())
            self.train_states, why = TeacherStates(teacher_states).for_rows(
                self.train, dtype=str(weight.dtype), autocast=autocast_active(weight.device, cfg["autocast"]))
            print(f"distill: teacher states {'from transfer' if why == '' else 'recomputed: ' + why}", flush=True)

    def rows(self, split: str) -> int:
        return len(self.train if split == "train" else self.val)

    def batch(self, split: str, idx, device) -> dict[str, torch.Tensor]:
        ids = (self.train if split == "train" else self.val)[idx].to(device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if split == "train" and self.train_states is not None:
            batch["teacher_states"] = self.train_states[idx].to(device)
        return batch

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        with torch.no_grad():
            states = batch.get("teacher_states")
            if states is None:  # what teacher(input_ids).logits computes, in two steps
                states = self.teacher.model(input_ids=batch["input_ids"]).last_hidden_state
                self.teacher_forwards += 1
            target = torch.log_softmax(self.teacher.lm_head(states).float(), dim=-1)
        logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), dim=-1)
        kl = F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="sum")
        return kl, batch["input_ids"].numel()


Objective = InstructObjective | DistillObjective


@torch.no_grad()
def validation_loss(model: nn.Module, objective: Objective, batch_size: int, device, amp: bool) -> float:
    """The objective per token over the whole validation split (token-weighted, not batch-weighted)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    n = objective.rows("val")
    for s in range(0, n, batch_size):
        batch = objective.batch("val", slice(s, s + batch_size), device)
        with autocast(device, amp):
            loss, c = objective.loss_sum(model, batch)
        total += float(loss)
        count += c
    model.train(was)
    return total / max(1, count)


def _locate_nonfinite(model: nn.Module, batch: dict[str, torch.Tensor], step: int) -> NonFiniteError:
    """Rerun the forward with hooks to name the first decoder layer whose output is not finite."""
    bad: list[str] = []
    handles = []
    for name, mod in model.named_modules():
        m = re.search(r"layers\.(\d+)$", name)
        if m is None:
            continue

        def hook(_m, _a, out, i=m[1]):
            t = out[0] if isinstance(out, tuple) else out
            if not bad and not bool(torch.isfinite(t).all()):
                bad.append(f"layer {i}")

        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return NonFiniteError(step, bad[0] if bad else "the loss (logits/labels)")


def run_finetune(
    model_dir: str | os.PathLike,
    data_path: str | os.PathLike,
    lora: dict | None,
    out_dir: str | os.PathLike,
    *,
    hybrid: Any = None,
    hybrid_layers: str | os.PathLike | None = None,
    teacher_states: str | os.PathLike | None = None,
    callback=None,
) -> dict:
    """LoRA-finetune the base (``hybrid=None``) or hybrid model; returns the metrics dict.

    ``data_path``: instruction data (``prepare_instruct_data``) for objective "instruct", packed
    transfer-corpus rows (``prepare_transfer_corpus``) for "distill" (whose teacher is the model in
    ``model_dir``).

    ``hybrid`` (HybridConfig | dict) with ``hybrid_layers`` (``run_transfer``'s safetensors) builds the
    transferred model; ``hybrid`` without ``hybrid_layers`` converts without transfer.
    ``teacher_states``: ``run_transfer``'s ``teacher_states.safetensors``; for "distill", training
    rows found there skip the teacher's forward (``hybrid_llama.train.teacher_states``).
    ``lora``: the keys of the config schema's ``lora`` section (config/schema.yaml documents each
    one; missing keys take the schema's defaults, ``FINETUNE_DEFAULTS``), plus the run options
    checkpoint_dir (None = out_dir/checkpoints), resume and progress. LoRA goes on ``layers`` when
    given, else on the hybrid layers for target "hybrid", else on every layer ("all", or when
    hybrid is None).

    Writes a peft adapter (``adapter_config.json``, ``adapter_model.safetensors``), ``loss.csv``
    (step,split,loss with split train|val; val at step 0 = before training and after each epoch;
    the loss is per token: NLL for instruct, KL for distill) and ``metrics.json`` into ``out_dir``.
    """
    from peft import LoraConfig, get_peft_model

    cfg = merge_config(lora, FINETUNE_DEFAULTS, "lora config")
    hcfg = as_hybrid_config(hybrid)
    if hybrid_layers is not None and hcfg is None:
        raise ValueError("hybrid_layers given without hybrid config")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg["device"])
    amp = bool(cfg["autocast"])
    seed_everything(int(cfg["seed"]))

    # Weights stay fp32 for training (LoRA and logits need fp32 optimizer math); bf16 via autocast.
    model, _tok = load_base(model_dir, dtype=cfg["dtype"])
    if hcfg is not None:
        if hybrid_layers is not None:
            from hybrid_llama.models import load_hybrid_layers

            load_hybrid_layers(model, hybrid_layers, hcfg)
        else:
            from dataclasses import asdict

            from hybrid_llama.models import convert_to_hybrid

            convert_to_hybrid(model, **asdict(hcfg))
    n_layers = len(model.model.layers)
    # Learnable feature maps (Hedgehog) are whatever feature-map module has parameters.
    has_fmaps = any(".feature_map." in name for name, _ in model.named_parameters())
    targets, save = lora_targets(n_layers, cfg, hcfg.layers if hcfg else None, feature_maps=has_fmaps)
    peft_cfg = LoraConfig(
        r=int(cfg["r"]), lora_alpha=cfg["alpha"], lora_dropout=cfg["dropout"], target_modules=targets,
        modules_to_save=save or None, task_type="CAUSAL_LM", bias="none",
    )
    model = get_peft_model(model, peft_cfg).to(device)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    if cfg["objective"] == "distill":
        if hcfg is None:
            raise ValueError("lora.objective 'distill' trains a hybrid model towards its base model: give hybrid=")
        teacher, _ = load_base(model_dir, dtype=cfg["dtype"], device=device)
        objective: Objective = DistillObjective(data_path, cfg, teacher.requires_grad_(False), teacher_states)
    else:
        objective = InstructObjective(data_path, cfg)
    bs = int(cfg["batch_size"])
    n_rows = objective.rows("train")
    n_micro = -(-n_rows // bs)

    def val() -> float:
        return validation_loss(model, objective, bs, device, amp)

    val_before = val()
    state: dict[str, Any] = {"val_per_epoch": []}
    orders: dict[int, list[int]] = {}
    log: dict[str, LossCSV] = {}

    def step_fn(step: int, epoch: int, m: int):
        if epoch not in orders:
            orders.clear()
            orders[epoch] = batch_order(n_rows, epoch, int(cfg["seed"]))
        batch = objective.batch("train", orders[epoch][m * bs : (m + 1) * bs], device)
        with autocast(device, amp):
            total, count = objective.loss_sum(model, batch)
        loss = total / max(1, count)
        if not bool(torch.isfinite(loss.detach())):
            raise _locate_nonfinite(model, batch, step + 1)
        return loss, {"loss": float(loss.detach())}, int(batch["attention_mask"].sum())

    def open_log(resume_step):
        log["csv"] = LossCSV(out / "loss.csv", ["step", "split", "loss"], resume_step)
        if resume_step is None:
            log["csv"].write(0, "val", val_before)

    def on_step(step: int, logs: dict[str, float]):
        log["csv"].write(step, "train", logs["loss"])
        state["last_train_loss"] = logs["loss"]
        log["csv"].flush()

    def on_epoch_end(epoch: int, step: int):
        v = val()
        state["val_per_epoch"].append(v)
        log["csv"].write(step, "val", v)
        log["csv"].flush()

    ckpt_dir = Path(cfg["checkpoint_dir"]) if cfg["checkpoint_dir"] else out / "checkpoints"
    try:
        result = run_steps(
            named_trainables=named, n_micro=n_micro, step_fn=step_fn, cfg=cfg, ckpt_dir=ckpt_dir,
            on_step=on_step, on_epoch_end=on_epoch_end, callback=callback, desc="lora",
            before_resume=open_log, state=state,
        )
    finally:
        if "csv" in log:
            log["csv"].close()

    model.eval()
    model.save_pretrained(str(out))
    metrics = {
        "val_loss_before": val_before,
        "val_loss_after": state["val_per_epoch"][-1] if state["val_per_epoch"] else val(),
        "val_loss_per_epoch": state["val_per_epoch"],
        "train_loss_final": state.get("last_train_loss"),
        "wall_time_s": result["elapsed_s"],
        "train_tokens": result["tokens"],
        "tokens_per_s": result["tokens"] / max(1e-9, result["elapsed_s"]),
        "steps": result["steps"],
        "resumed_from_step": result["start_step"],
        "objective": cfg["objective"],
        "val_metric": objective.metric,
        "teacher_forwards": getattr(objective, "teacher_forwards", None),
        "num_train": n_rows,
        "num_val": objective.rows("val"),
        "target_modules": targets,
        "modules_to_save": save,
        "num_trainable_params": sum(p.numel() for _, p in named),
        "device": str(device),
        "hybrid": None if hcfg is None else {k: getattr(hcfg, k) for k in ("layers", "window", "formulation",
                                                                        "feature_map", "backend")},
        "lora": cfg,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


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
    ap.add_argument("--lora", default="{}", help="JSON dict of lora keys (config/schema.yaml: lora)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    m = run_finetune(
        a.model_dir, a.data, json.loads(a.lora), a.out, hybrid=hybrid_from_arguments(a), hybrid_layers=a.hybrid_layers,
        teacher_states=a.teacher_states,
    )
    print(json.dumps({k: m[k] for k in ("val_loss_before", "val_loss_after", "wall_time_s", "tokens_per_s")}, indent=1))


if __name__ == "__main__":
    main()
