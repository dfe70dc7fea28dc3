"""LoRA finetuning of a (hybrid) model on instruction data, with peft.

LoRA goes on q/k/v/o of the hybrid layers (``target: hybrid``) or of every layer (``target: all``);
the hybrid layers' mixing logits train too and are saved in the adapter through peft's
``modules_to_save`` (they live in the ``mixing`` submodule). With ``hybrid=None`` this trains the
"base + LoRA" control on the plain model.

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

from hybrid_llama.data import IGNORE_INDEX, load_instruct
from hybrid_llama.stages import as_hybrid_config, load_base
from hybrid_llama.train.common import (
    stage_defaults,
    LossCSV,
    add_hybrid_arguments,
    NonFiniteError,
    autocast,
    batch_order,
    hybrid_from_arguments,
    merge_config,
    pick_device,
    run_steps,
    seed_everything,
)

__all__ = ["run_finetune", "FINETUNE_DEFAULTS", "lora_targets", "validation_loss"]

# The schema's lora section (config/schema.yaml).
FINETUNE_DEFAULTS: dict[str, Any] = stage_defaults("lora")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_targets(num_layers: int, lora: dict, hybrid_layers: list[int] | None) -> tuple[list[str], list[str]]:
    """(target_modules, modules_to_save) as explicit full module names of a ``LlamaForCausalLM``."""
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
    save = [f"model.layers.{i}.self_attn.mixing" for i in (hybrid_layers or [])]
    return targets, save


def _trim(batch: dict[str, torch.Tensor], max_length: int | None) -> dict[str, torch.Tensor]:
    # Right padding: cut columns past the longest real row (and past max_length).
    width = int(batch["attention_mask"].sum(1).max())
    if max_length is not None:
        width = min(width, int(max_length))
    return {k: v[:, :width] for k, v in batch.items()}


def _token_nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over label tokens, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return nll, int((labels != IGNORE_INDEX).sum())


@torch.no_grad()
def validation_loss(model: nn.Module, data: dict[str, torch.Tensor], batch_size: int, device, amp: bool,
                    max_length: int | None = None) -> float:
    """Mean NLL per label token over the whole split (token-weighted, not batch-weighted)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    n = len(data["input_ids"])
    for s in range(0, n, batch_size):
        batch = _trim({k: v[s : s + batch_size].to(device) for k, v in data.items()}, max_length)
        with autocast(device, amp):
            nll, c = _token_nll(model, batch)
        total += float(nll)
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

        def hook(_m, _a, out, i=m.group(1)):
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
    instruct_path: str | os.PathLike,
    lora: dict | None,
    out_dir: str | os.PathLike,
    *,
    hybrid: Any = None,
    hybrid_layers: str | os.PathLike | None = None,
    callback=None,
) -> dict:
    """LoRA-finetune the base (``hybrid=None``) or hybrid model on ``instruct_path``; returns metrics.

    ``hybrid`` (HybridConfig | dict) with ``hybrid_layers`` (``run_transfer``'s safetensors) builds the
    transferred model; ``hybrid`` without ``hybrid_layers`` converts without transfer.
    ``lora``: the keys of the config schema's ``lora`` section (config/schema.yaml documents each
    one; missing keys take the schema's defaults, ``FINETUNE_DEFAULTS``), plus the run options
    checkpoint_dir (None = out_dir/checkpoints), resume and progress. LoRA goes on ``layers`` when
    given, else on the hybrid layers for target "hybrid", else on every layer ("all", or when
    hybrid is None).

    Writes a peft adapter (``adapter_config.json``, ``adapter_model.safetensors``), ``loss.csv``
    (step,split,loss with split train|val; val at step 0 = before training and after each epoch)
    and ``metrics.json`` into ``out_dir``.
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
    targets, save = lora_targets(n_layers, cfg, hcfg.layers if hcfg else None)
    peft_cfg = LoraConfig(
        r=int(cfg["r"]), lora_alpha=cfg["alpha"], lora_dropout=cfg["dropout"], target_modules=targets,
        modules_to_save=save or None, task_type="CAUSAL_LM", bias="none",
    )
    model = get_peft_model(model, peft_cfg).to(device)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    train_data = load_instruct(instruct_path, "train")
    val_data = load_instruct(instruct_path, "val")
    if cfg["max_val_examples"] is not None:
        val_data = {k: v[: int(cfg["max_val_examples"])] for k, v in val_data.items()}
    bs, max_len = int(cfg["batch_size"]), cfg["max_length"]
    n_rows = len(train_data["input_ids"])
    n_micro = -(-n_rows // bs)

    def val() -> float:
        return validation_loss(model, val_data, bs, device, amp, max_len)

    val_before = val()
    state: dict[str, Any] = {"val_per_epoch": []}
    orders: dict[int, list[int]] = {}
    log: dict[str, LossCSV] = {}

    def step_fn(step: int, epoch: int, m: int):
        if epoch not in orders:
            orders.clear()
            orders[epoch] = batch_order(n_rows, epoch, int(cfg["seed"]))
        idx = orders[epoch][m * bs : (m + 1) * bs]
        batch = _trim({k: v[idx].to(device) for k, v in train_data.items()}, max_len)
        with autocast(device, amp):
            nll, count = _token_nll(model, batch)
        loss = nll / max(1, count)
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
        "num_train": n_rows,
        "num_val": len(val_data["input_ids"]),
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
    ap.add_argument("--instruct", required=True, help="instruction safetensors from hybrid_llama.data")
    add_hybrid_arguments(ap, layers_help="comma-separated hybrid layers (omit for the base+LoRA control)",
                         layers_required=False)
    ap.add_argument("--hybrid-layers", default=None, help="hybrid_layers.safetensors from the transfer stage")
    ap.add_argument("--lora", default="{}", help="JSON dict of lora keys (config/schema.yaml: lora)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    m = run_finetune(a.model_dir, a.instruct, json.loads(a.lora), a.out, hybrid=hybrid_from_arguments(a),
                     hybrid_layers=a.hybrid_layers)
    print(json.dumps({k: m[k] for k in ("val_loss_before", "val_loss_after", "wall_time_s", "tokens_per_s")}, indent=1))


if __name__ == "__main__":
    main()
