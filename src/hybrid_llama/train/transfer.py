"""Attention transfer: teach each hybrid attention layer to reproduce the frozen softmax layer.

One teacher forward per batch (the LoLCATs recipe): hooks record, for every hybrid layer, the input the
teacher's attention received (hidden states, RoPE cos/sin, mask) and the output it produced
(``teacher_cache``). Each student (a ``HybridLlamaAttention`` cloned from that layer) runs on exactly
those inputs, so students never see each other's errors. Loss = sum over layers of MSE(student
output, teacher output): the :class:`AttentionTransfer` objective of the shared trainer.

``python -m hybrid_llama.train.transfer --help`` runs it from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_llama.data import load_packed
from hybrid_llama.files import atomic_write, save_safetensors
from hybrid_llama.runtime import resolve_dtype
from hybrid_llama.stages import as_hybrid_config, load_base
from hybrid_llama.train.cli import add_hybrid_arguments, hybrid_from_arguments
from hybrid_llama.train.compute import autocast, autocast_active, pick_device, seed_everything
from hybrid_llama.train.errors import check_finite
from hybrid_llama.train.positions import NO_SHIFT, RowShift, check_max_position
from hybrid_llama.train.settings import CORPUS_KEYS, TransferSettings
from hybrid_llama.train.teacher_cache import TeacherCache, TeacherTap
from hybrid_llama.train.teacher_states import save_teacher_states
from hybrid_llama.train.trainer import MicroLoss, Objective, fit

__all__ = ["run_transfer", "AttentionTransfer", "TransferSettings", "TRANSFER_DEFAULTS", "CORPUS_KEYS",
           "TRAINABLE_PARTS", "layer_mse"]

# Every key run_transfer's ``train`` dict accepts, with its default (the schema's transfer section).
TRANSFER_DEFAULTS: dict[str, Any] = TransferSettings.defaults()
TRAINABLE_PARTS = ("logits", "feature_map", "qkvo")
QKVO = ("q_proj.", "k_proj.", "v_proj.", "o_proj.")


def _student_out(student: nn.Module, inp: dict[str, Any],
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    # Students keep fp32 master weights; a bf16 teacher's activations are upcast (autocast on GPU recasts).
    # ``rope``: the (cos, sin) of shifted positions, in place of the teacher's (max_position).
    dt = student.q_proj.weight.dtype
    cos, sin = rope if rope is not None else inp["position_embeddings"]
    return student(
        hidden_states=inp["hidden_states"].to(dt),
        position_embeddings=(cos.to(dt), sin.to(dt)),
        attention_mask=inp["attention_mask"],
    )[0]


def _select_trainable(students: nn.ModuleDict, trainable: str) -> list[tuple[str, nn.Parameter]]:
    parts = set(trainable.split("+"))
    if not parts or not parts <= set(TRAINABLE_PARTS):
        raise ValueError(f"train.trainable must join some of {TRAINABLE_PARTS} with '+', got {trainable!r}")
    named = []
    for i, s in students.items():
        for n, p in s.named_parameters():
            on = (
                (n.startswith("mixing.") and "logits" in parts)
                or (n.startswith("feature_map.") and "feature_map" in parts)
                or (n.startswith(QKVO) and "qkvo" in parts)
            )
            p.requires_grad_(on)
            if on:
                named.append((f"model.layers.{i}.self_attn.{n}", p))
    if not named:
        raise ValueError(f"train.trainable={trainable!r} selects no parameters (elu1 has no feature-map parameters)")
    return named


@torch.no_grad()
def layer_mse(
    tap: TeacherTap, students: nn.ModuleDict, rows: torch.Tensor, batch_size: int, device: torch.device, amp: bool
) -> dict[int, float]:
    """Mean per-layer MSE(student, teacher) over ``rows`` (each row weighted equally)."""
    sums = {int(i): 0.0 for i in students}
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size].to(device)
        with autocast(device, amp):
            tap.run(batch)
            for i, s in students.items():
                out = _student_out(s, tap.inputs[int(i)])
                sums[int(i)] += F.mse_loss(out.float(), tap.outputs[int(i)].float()).item() * len(batch)
    return {i: v / len(rows) for i, v in sums.items()}


class AttentionTransfer(Objective):
    """Sum over the hybrid layers of MSE(student output, teacher output) on the teacher's own inputs.

    Held-out MSE is measured before training (``validate(0)``, kept in ``mse_before``) and after it
    (``heldout_mse``, by run_transfer), not between epochs: loss.csv holds the training MSEs only.
    ``shift`` gives each training row's students the RoPE angles of a randomly shifted start
    (``train.positions``); the teacher's outputs, relative in position, stay the targets.
    """

    name = "transfer"
    log_columns = ("step", "layer", "mse")

    def __init__(self, students: nn.ModuleDict, named: list[tuple[str, nn.Parameter]], cache: TeacherCache,
                 train_rows: torch.Tensor, eval_rows: torch.Tensor, *, batch_size: int, device: torch.device,
                 amp: bool, shift: RowShift = NO_SHIFT) -> None:
        self.students, self.named, self.cache = students, named, cache
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.batch_size, self.device, self.amp, self.shift = batch_size, device, amp, shift
        self.mse_before: dict[int, float] = {}

    @property
    def num_rows(self) -> int:
        return len(self.train_rows)

    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    def clip_groups(self) -> list[list[tuple[str, nn.Parameter]]]:
        # Per layer: the layers are independent problems with very different gradient scales.
        return [[(n, p) for n, p in self.named if n.startswith(f"model.layers.{i}.")] for i in self.students]

    def loss(self, rows: list[int], step: int) -> MicroLoss:
        batch = self.train_rows[rows].to(self.device)
        tap = self.cache.tap
        with autocast(self.device, self.amp):
            self.cache.run(rows, batch)
            rope = self._shifted_rope(rows, step, tap.inputs[tap.layers[0]]["hidden_states"])
            total = 0.0
            logs = {}
            for i, s in self.students.items():
                y = _student_out(s, tap.inputs[int(i)], rope)
                mse = F.mse_loss(y.float(), tap.outputs[int(i)].float())
                check_finite(mse, step, f"layer {i}")
                logs[f"layer.{i}"] = mse.item()
                total = total + mse
        return MicroLoss(total, batch.numel(), logs)

    def _shifted_rope(self, rows: list[int], step: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        seq_len = self.train_rows.shape[1]
        shifted = self.shift.position_ids(rows, step, seq_len, like.device)
        if shifted is None:
            return None
        return self.cache.tap.teacher.model.rotary_emb(like, shifted)

    def log_step(self, step: int, logs: dict[str, float]) -> list[tuple]:
        return [(step, int(key.split(".", 1)[1]), v) for key, v in logs.items() if key.startswith("layer.")]

    def validate(self, step: int) -> list[tuple]:
        if step == 0:
            self.mse_before = self.heldout_mse()
        return []

    def heldout_mse(self) -> dict[int, float]:
        return layer_mse(self.cache.tap, self.students, self.eval_rows, self.batch_size, self.device, self.amp)


def _split_rows(packed_path: str | os.PathLike, eval_path: str | None,
                eval_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows): ``eval_path``'s rows, else the last ``eval_sequences`` rows."""
    rows = load_packed(packed_path)
    if eval_path is not None:
        return rows, load_packed(eval_path)
    k = int(eval_sequences)
    if k < 1 or len(rows) - k < 1:
        raise ValueError(f"{packed_path}: {len(rows)} rows, need 1 <= eval_sequences={k} < rows")
    return rows[:-k], rows[-k:]


def run_transfer(
    model_dir: str | os.PathLike,
    packed_path: str | os.PathLike,
    hybrid: Any,
    train: dict | None,
    out_dir: str | os.PathLike,
    *,
    callback: Callable[[int, dict[str, float]], None] | None = None,
) -> dict:
    """Train the hybrid layers of ``hybrid`` to match the frozen base model; returns the metrics dict.

    ``hybrid``: HybridConfig or dict (layers required; the other keys default as in HybridConfig).
    ``train``: the keys of the config schema's ``transfer`` section (config/schema.yaml documents
    each one; missing keys take the schema's defaults, ``TRANSFER_DEFAULTS``), plus the run options
    checkpoint_dir (None = out_dir/checkpoints), resume, progress, and eval_path (a held-out packed
    file; None = the last ``eval_sequences`` rows of ``packed_path``, excluded from training).
    Students train in fp32; ``dtype`` is the teacher's.

    ``callback(step, logs)`` is called after every optimizer step (and checkpoint); raising
    ``StopTraining`` from it simulates a kill. Writes ``hybrid_layers.safetensors`` (every parameter of
    the hybrid attention modules, full model names, for ``load_hybrid_layers``), ``metrics.json``,
    ``loss.csv`` (step,layer,mse) and ``teacher_states.safetensors`` (the teacher's final hidden
    states of the training rows with ``teacher_states``, else no rows; see ``teacher_states``) into
    ``out_dir``.
    """
    s = TransferSettings.from_dict(train)
    hcfg = as_hybrid_config(hybrid)
    if not hcfg.layers:
        raise ValueError("hybrid.layers is empty: nothing to transfer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(s.device)
    amp = bool(s.autocast)
    seed_everything(int(s.loop.seed))

    teacher, _tok = load_base(model_dir, dtype=resolve_dtype(s.dtype), device=device)
    teacher.requires_grad_(False)
    n_layers = len(teacher.model.layers)
    bad = [i for i in hcfg.layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"hybrid layers {bad} out of range: the model has {n_layers} layers")

    from hybrid_llama.models import make_hybrid_attention

    students = nn.ModuleDict(
        {str(i): make_hybrid_attention(teacher.model.layers[i].self_attn, hcfg) for i in hcfg.layers}
    ).float()
    students.train()
    named = _select_trainable(students, s.trainable)
    train_rows, eval_rows = _split_rows(packed_path, s.eval_path, s.eval_sequences)
    positions = getattr(teacher.config, "max_position_embeddings", None)
    check_max_position(int(s.max_position), train_rows.shape[1], positions, "transfer.max_position")
    bs = int(s.loop.batch_size)

    tap = TeacherTap(teacher, hcfg.layers)
    # Only a second epoch reads a cached row again.
    cache_bytes = float(s.teacher_cache_gib) * 2**30 if int(s.loop.epochs) > 1 else 0.0
    cache = TeacherCache(tap, len(train_rows), cache_bytes, final_states=bool(s.teacher_states))
    objective = AttentionTransfer(students, named, cache, train_rows, eval_rows, batch_size=bs, device=device, amp=amp,
                                  shift=RowShift.of(s))
    try:
        result = fit(objective, s.loop, s.optimizer, out, callback)
        students.eval()
        mse_before, mse_after = objective.mse_before, objective.heldout_mse()
        final = cache.final_states(train_rows, bs, device, amp) if s.teacher_states else None
    finally:
        tap.remove()
    save_teacher_states(out / "teacher_states.safetensors", train_rows, final,
                        dtype=str(next(teacher.parameters()).dtype), autocast=autocast_active(device, amp))

    tensors = {}
    for i, student in students.items():
        prefix = f"model.layers.{i}.self_attn."
        for n, p in student.named_parameters():
            tensors[prefix + n] = p.detach().float().contiguous().cpu()
    save_safetensors(out / "hybrid_layers.safetensors", tensors, metadata={"hybrid": json.dumps(hcfg.to_dict())})

    metrics = {
        "mse_before": {str(i): v for i, v in mse_before.items()},
        "mse_after": {str(i): v for i, v in mse_after.items()},
        "mse_before_mean": sum(mse_before.values()) / len(mse_before),
        "mse_after_mean": sum(mse_after.values()) / len(mse_after),
        "wall_time_s": result.elapsed_s,
        "train_tokens": result.tokens,
        "tokens_per_s": result.tokens / max(1e-9, result.elapsed_s),
        "steps": result.steps,
        "resumed_from_step": result.start_step,
        "teacher_forwards": cache.teacher_forwards,
        "seq_len": train_rows.shape[1],
        "train_sequences": len(train_rows),
        "eval_sequences": len(eval_rows),
        "trainable": sorted({n.split(".self_attn.", 1)[1].split(".")[0] for n, _ in named}),
        "num_trainable_params": sum(p.numel() for _, p in named),
        "device": str(device),
        "autocast_bf16": autocast_active(device, amp),  # what `autocast: true` meant on this device
        "hybrid": hcfg.to_dict(),
        "train": s.as_dict(),
    }
    atomic_write(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybrid_llama.train.transfer", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--packed", required=True, help="packed corpus safetensors from hybrid_llama.data")
    add_hybrid_arguments(ap, layers_help="comma-separated hybrid layer indices", layers_required=True)
    ap.add_argument("--train", default="{}", help="JSON dict of train keys (config/schema.yaml: transfer)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    m = run_transfer(a.model_dir, a.packed, hybrid_from_arguments(a), json.loads(a.train), a.out)
    print(json.dumps({k: m[k] for k in ("mse_before", "mse_after", "wall_time_s", "tokens_per_s")}, indent=1))


if __name__ == "__main__":
    main()
