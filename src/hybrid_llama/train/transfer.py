"""Attention transfer: teach each hybrid attention layer to reproduce the frozen softmax layer.

One teacher forward per batch (the LoLCATs recipe): hooks record, for every hybrid layer, the input the
teacher's attention received (hidden states, RoPE cos/sin, mask) and the output it produced. Each
student (a ``HybridLlamaAttention`` cloned from that layer) runs on exactly those inputs, so students
never see each other's errors. Loss = sum over layers of MSE(student output, teacher output).

``python -m hybrid_llama.train.transfer --help`` runs it from the command line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_llama.data import load_packed
from hybrid_llama.files import save_safetensors
from hybrid_llama.stages import as_hybrid_config, load_base, resolve_dtype
from hybrid_llama.train.common import (
    LossCSV,
    add_hybrid_arguments,
    autocast,
    autocast_active,
    batch_order,
    check_finite,
    hybrid_from_arguments,
    merge_config,
    pick_device,
    run_steps,
    seed_everything,
    stage_defaults,
)
from hybrid_llama.train.teacher_states import save_teacher_states

__all__ = ["run_transfer", "TRANSFER_DEFAULTS", "TRAINABLE_PARTS", "layer_mse"]

# Keys of the schema's transfer section that describe the corpus the workflow packs (its rows are
# what packed_path holds), not how run_transfer trains.
CORPUS_KEYS = ("seq_len", "num_tokens")
# The schema's transfer section (config/schema.yaml) plus where the held-out rows come from.
TRANSFER_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in stage_defaults("transfer").items() if k not in CORPUS_KEYS},
    "eval_path": None,
}
TRAINABLE_PARTS = ("logits", "feature_map", "qkvo")
QKVO = ("q_proj.", "k_proj.", "v_proj.", "o_proj.")


class _StopForward(Exception):
    """Raised by the capture hook once the last hybrid layer ran: the rest of the teacher is not needed."""


class TeacherTap:
    """Forward hooks on the teacher's attention modules of ``layers`` recording inputs and outputs."""

    def __init__(self, teacher: nn.Module, layers: list[int]):
        self.teacher = teacher
        self.layers = layers
        self.last = max(layers)
        self._stop = True  # stop after the last hybrid layer unless run(to_end=True)
        self.inputs: dict[int, dict[str, Any]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        blocks = teacher.model.layers
        self._handles = []
        for i in layers:
            attn = blocks[i].self_attn
            self._handles.append(attn.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(attn.register_forward_hook(self._post(i)))

    def _pre(self, i: int):
        def hook(_mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.inputs[i] = {
                "hidden_states": h,
                "position_embeddings": kwargs.get("position_embeddings"),
                "attention_mask": kwargs.get("attention_mask"),
            }

        return hook

    def _post(self, i: int):
        def hook(_mod, _args, out):
            self.outputs[i] = out[0] if isinstance(out, tuple) else out
            if i == self.last and self._stop:
                raise _StopForward

        return hook

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, to_end: bool = False) -> torch.Tensor | None:
        """Record the hybrid layers' inputs/outputs; with ``to_end`` also run the remaining layers and
        return the final (normed) hidden states."""
        self.inputs, self.outputs = {}, {}
        self._stop = not to_end
        try:
            return self.teacher.model(input_ids=input_ids, use_cache=False).last_hidden_state
        except _StopForward:
            return None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _per_row(value: Any) -> bool:
    """Whether a recorded input differs between the rows of a batch (None and broadcast tables do not)."""
    if value is None:
        return False
    if isinstance(value, tuple):
        return any(_per_row(v) for v in value)
    return value.shape[0] != 1


class TeacherCache:
    """The teacher's per-layer inputs and outputs of every training row, kept after the row's first pass.

    The teacher is frozen, so each later epoch would recompute exactly these tensors with a forward
    through almost the whole model: the largest cost of a transfer step on CPU. After the first
    micro-batch shows their size, one buffer per layer is allocated for all rows if they fit in
    ``limit_bytes`` (one block, so the resident memory is the estimate, not a fragmented multiple).
    RoPE tables and the causal mask depend only on the packed length, so one copy serves every row.
    With ``final_states`` a row's first forward also runs the teacher's remaining layers and keeps its
    final hidden states (``transfer.teacher_states``, for a distilled LoRA stage).
    """

    def __init__(self, tap: TeacherTap, n_rows: int, limit_bytes: float, final_states: bool = False):
        self.tap, self.n_rows, self.limit = tap, n_rows, limit_bytes
        self.enabled: bool | None = None if limit_bytes > 0 else False
        self.hidden: dict[int, torch.Tensor] = {}
        self.output: dict[int, torch.Tensor] = {}
        self.shared: dict[int, dict[str, Any]] = {}
        self.filled = torch.zeros(n_rows, dtype=torch.bool)
        self.teacher_forwards = 0
        # The teacher's final hidden states, one full forward per row (transfer.teacher_states).
        self.final: torch.Tensor | None = None
        self.final_filled = torch.zeros(n_rows, dtype=torch.bool) if final_states else None

    def run(self, idx: list[int], batch: torch.Tensor) -> None:
        """Leave the teacher's tensors for training rows ``idx`` (= ``batch``) in ``tap.inputs/outputs``."""
        tap = self.tap
        to_end = self.final_filled is not None and not bool(self.final_filled[idx].all())
        if self.enabled and bool(self.filled[idx].all()) and not to_end:
            tap.inputs = {i: {"hidden_states": self.hidden[i][idx], **self.shared[i]} for i in tap.layers}
            tap.outputs = {i: self.output[i][idx] for i in tap.layers}
            return
        final = tap.run(batch, to_end=to_end)
        self.teacher_forwards += 1
        if to_end:
            if self.final is None:
                self.final = final.new_empty((self.n_rows, *final.shape[1:]))
            self.final[idx] = final
            self.final_filled[idx] = True
        if self.enabled is None:
            self.enabled = self._allocate(len(idx))
        if self.enabled:
            for i in tap.layers:
                self.hidden[i][idx] = tap.inputs[i]["hidden_states"]
                self.output[i][idx] = tap.outputs[i]
            self.filled[idx] = True

    def _allocate(self, batch_rows: int) -> bool:
        tap = self.tap
        if any(_per_row(v) for i in tap.layers for k, v in tap.inputs[i].items() if k != "hidden_states"):
            print("transfer: teacher cache off (an attention input other than the hidden states varies by row)")
            return False
        tensors = [t for i in tap.layers for t in (tap.inputs[i]["hidden_states"], tap.outputs[i])]
        need = sum(t.numel() * t.element_size() for t in tensors) // batch_rows * self.n_rows
        on = need <= self.limit
        print(f"transfer: teacher cache {'on' if on else 'off'} ({need / 2**30:.2f} GiB for {self.n_rows} rows, "
              f"limit {self.limit / 2**30:.2f} GiB)", flush=True)
        if on:
            def buffer(t: torch.Tensor) -> torch.Tensor:
                return torch.empty((self.n_rows, *t.shape[1:]), dtype=t.dtype, device=t.device)

            for i in tap.layers:
                self.hidden[i] = buffer(tap.inputs[i]["hidden_states"])
                self.output[i] = buffer(tap.outputs[i])
                self.shared[i] = {k: v for k, v in tap.inputs[i].items() if k != "hidden_states"}
        return on

    def final_states(self, rows: torch.Tensor, batch_size: int, device: torch.device, amp: bool) -> torch.Tensor:
        """The final hidden states of every training row (``rows``), running the teacher on those a
        resumed run skipped."""
        todo = [int(r) for r in torch.nonzero(~self.final_filled).flatten()]
        for s in range(0, len(todo), batch_size):
            idx = todo[s : s + batch_size]
            with autocast(device, amp):
                self.run(idx, rows[idx].to(device))
        return self.final


def _student_out(student: nn.Module, inp: dict[str, Any]) -> torch.Tensor:
    # Students keep fp32 master weights; a bf16 teacher's activations are upcast (autocast on GPU recasts).
    dt = student.q_proj.weight.dtype
    cos, sin = inp["position_embeddings"]
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


def run_transfer(
    model_dir: str | os.PathLike,
    packed_path: str | os.PathLike,
    hybrid: Any,
    train: dict | None,
    out_dir: str | os.PathLike,
    *,
    callback=None,
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
    cfg = merge_config(train, TRANSFER_DEFAULTS, "transfer train config")
    hcfg = as_hybrid_config(hybrid)
    if not hcfg.layers:
        raise ValueError("hybrid.layers is empty: nothing to transfer")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg["device"])
    amp = bool(cfg["autocast"])
    seed_everything(int(cfg["seed"]))

    teacher, _tok = load_base(model_dir, dtype=resolve_dtype(cfg["dtype"]), device=device)
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
    named = _select_trainable(students, cfg["trainable"])

    rows = load_packed(packed_path)
    if cfg["eval_path"] is not None:
        train_rows, eval_rows = rows, load_packed(cfg["eval_path"])
    else:
        k = int(cfg["eval_sequences"])
        if k < 1 or len(rows) - k < 1:
            raise ValueError(f"{packed_path}: {len(rows)} rows, need 1 <= eval_sequences={k} < rows")
        train_rows, eval_rows = rows[:-k], rows[-k:]
    bs = int(cfg["batch_size"])
    n_micro = -(-len(train_rows) // bs)
    seq_len = rows.shape[1]

    tap = TeacherTap(teacher, hcfg.layers)
    # Only a second epoch reads a cached row again.
    cache_bytes = float(cfg["teacher_cache_gib"]) * 2**30 if int(cfg["epochs"]) > 1 else 0.0
    cache = TeacherCache(tap, len(train_rows), cache_bytes, final_states=bool(cfg["teacher_states"]))
    try:
        mse_before = layer_mse(tap, students, eval_rows, bs, device, amp)
        orders: dict[int, list[int]] = {}

        def step_fn(step: int, epoch: int, m: int):
            if epoch not in orders:
                orders.clear()
                orders[epoch] = batch_order(len(train_rows), epoch, int(cfg["seed"]))
            idx = orders[epoch][m * bs : (m + 1) * bs]
            batch = train_rows[idx].to(device)
            with autocast(device, amp):
                cache.run(idx, batch)
                total = 0.0
                logs = {}
                for i, s in students.items():
                    y = _student_out(s, tap.inputs[int(i)])
                    mse = F.mse_loss(y.float(), tap.outputs[int(i)].float())
                    check_finite(mse, step + 1, f"layer {i}")
                    logs[f"layer.{i}"] = mse.item()
                    total = total + mse
            logs["loss"] = float(total.detach())
            return total, logs, batch.numel()

        log: dict[str, LossCSV] = {}

        def open_log(resume_step):
            log["csv"] = LossCSV(out / "loss.csv", ["step", "layer", "mse"], resume_step)

        def on_step(step: int, logs: dict[str, float]):
            for key, v in logs.items():
                if key.startswith("layer."):
                    log["csv"].write(step, int(key.split(".", 1)[1]), v)
            log["csv"].flush()

        ckpt_dir = Path(cfg["checkpoint_dir"]) if cfg["checkpoint_dir"] else out / "checkpoints"
        try:
            result = run_steps(
                named_trainables=named, n_micro=n_micro, step_fn=step_fn, cfg=cfg, ckpt_dir=ckpt_dir,
                on_step=on_step, callback=callback, desc="transfer", before_resume=open_log,
                clip_groups=[[(n, p) for n, p in named if n.startswith(f"model.layers.{i}.")] for i in students],
            )
        finally:
            if "csv" in log:
                log["csv"].close()
        students.eval()
        mse_after = layer_mse(tap, students, eval_rows, bs, device, amp)
        final = cache.final_states(train_rows, bs, device, amp) if cfg["teacher_states"] else None
    finally:
        tap.remove()
    save_teacher_states(out / "teacher_states.safetensors", train_rows, final,
                        dtype=str(next(teacher.parameters()).dtype), autocast=autocast_active(device, amp))

    tensors = {}
    for i, s in students.items():
        prefix = f"model.layers.{i}.self_attn."
        for n, p in s.named_parameters():
            tensors[prefix + n] = p.detach().float().contiguous().cpu()
    save_safetensors(out / "hybrid_layers.safetensors", tensors, metadata={"hybrid": json.dumps(hcfg.to_dict())})

    metrics = {
        "mse_before": {str(i): v for i, v in mse_before.items()},
        "mse_after": {str(i): v for i, v in mse_after.items()},
        "mse_before_mean": sum(mse_before.values()) / len(mse_before),
        "mse_after_mean": sum(mse_after.values()) / len(mse_after),
        "wall_time_s": result["elapsed_s"],
        "train_tokens": result["tokens"],
        "tokens_per_s": result["tokens"] / max(1e-9, result["elapsed_s"]),
        "steps": result["steps"],
        "resumed_from_step": result["start_step"],
        "teacher_forwards": cache.teacher_forwards,
        "seq_len": seq_len,
        "train_sequences": len(train_rows),
        "eval_sequences": len(eval_rows),
        "trainable": sorted({n.split(".self_attn.", 1)[1].split(".")[0] for n, _ in named}),
        "num_trainable_params": sum(p.numel() for _, p in named),
        "device": str(device),
        "hybrid": hcfg.to_dict(),
        "train": cfg,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
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
