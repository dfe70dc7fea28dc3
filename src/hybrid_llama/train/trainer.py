"""The one training loop of every stage; a stage differs only by its :class:`Objective`.

:func:`fit` owns what all stages share: the order of the training rows, AdamW and its lr schedule,
gradient accumulation, clipping (per clip group), validation after every epoch, ``loss.csv``,
checkpoints and resume, and the progress bar. The objective owns what the stage trains and how it
scores a micro-batch. One optimizer step, top to bottom:

    lr of this step -> for each micro-batch: objective.loss(rows, step), backward of loss / micro-batches
    -> clip each of objective.clip_groups() -> AdamW step -> loss.csv rows of objective.log_step
    -> after an epoch: objective.validate(step) -> checkpoint every ``checkpoint_every`` steps

Optimizer step ``s`` (0-based) of epoch ``e`` uses micro-batches ``[k*accum, (k+1)*accum)`` of that
epoch's row order, a function of (seed, epoch) only: a resumed run replays exactly the batches an
uninterrupted one would, and its parameters, optimizer, RNG and objective state come back from the
checkpoint, so it ends bit-identical.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hybrid_llama.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from hybrid_llama.train.errors import NoGradientError
from hybrid_llama.train.optim import clip_and_check, lr_factor, make_optimizer
from hybrid_llama.train.reporting import LossCSV, Progress
from hybrid_llama.train.settings import LoopSettings, OptimizerSettings

__all__ = ["Objective", "MicroLoss", "TrainResult", "fit", "batch_order"]

Named = list[tuple[str, torch.nn.Parameter]]
Row = Sequence[Any]


class MicroLoss(NamedTuple):
    """An objective's result for one micro-batch."""

    loss: torch.Tensor  # the scalar to minimize (the trainer averages it over the step's micro-batches)
    tokens: int  # tokens it trained on (throughput)
    logs: dict[str, float]  # further per-micro-batch values, averaged like the loss, for log_step


class Objective(ABC):
    """What a stage trains and how it scores it; :func:`fit` does the rest.

    Steps are 1-based in every method: step ``n`` is the n-th optimizer step (0 = before training).
    """

    name: str  # progress-bar label
    log_columns: tuple[str, ...]  # header of loss.csv; its rows come from log_step and validate

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Training rows; the trainer orders them each epoch and hands out ``batch_size`` per micro-batch."""

    @abstractmethod
    def parameters(self) -> Named:
        """The named trainable parameters (optimized, clipped and checkpointed in this order)."""

    def clip_groups(self) -> list[Named]:
        """Parameter groups whose gradient norms are clipped to ``grad_clip`` separately."""
        return [self.parameters()]

    @abstractmethod
    def loss(self, rows: list[int], step: int) -> MicroLoss:
        """Forward one micro-batch of training rows ``rows``; raise ``NonFiniteError`` naming the layer."""

    @abstractmethod
    def log_step(self, step: int, logs: dict[str, float]) -> list[Row]:
        """loss.csv rows of a finished step; ``logs`` holds ``loss`` and the step's means of ``MicroLoss.logs``."""

    def validate(self, step: int) -> list[Row]:
        """Held-out scoring, called at step 0 (always, before a checkpoint is loaded; its rows are
        logged on a fresh start only) and after every epoch; returns loss.csv rows."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state saved in each checkpoint (e.g. validation losses so far)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (stateless objectives keep it)
        """Restore :meth:`state_dict` on resume."""


@dataclass(frozen=True)
class TrainResult:
    steps: int  # optimizer steps of the whole run
    start_step: int  # the checkpoint's step it resumed from (0 = from scratch)
    tokens: int  # tokens trained on, over all runs that led to it
    elapsed_s: float  # training time, over all runs that led to it
    tokens_this_run: int
    elapsed_this_run_s: float


def batch_order(n: int, epoch: int, seed: int) -> list[int]:
    """Row order for one epoch; a function of (seed, epoch) only, so a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def fit(
    objective: Objective,
    loop: LoopSettings,
    optimizer: OptimizerSettings,
    out_dir: Path,
    callback: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train ``objective``; log to ``out_dir/loss.csv``, checkpoint to ``loop.checkpoint_dir`` (None =
    ``out_dir/checkpoints``) and resume from there. ``callback(step, logs)`` runs after every step
    (and its checkpoint); raising ``StopTraining`` from it simulates a kill."""
    bs, accum = loop.batch_size, loop.grad_accum
    n_micro = -(-objective.num_rows // bs)
    steps_per_epoch = math.ceil(n_micro / accum)
    if steps_per_epoch == 0:
        raise ValueError("no training batches")
    total = steps_per_epoch * loop.epochs
    if loop.max_steps is not None:
        total = min(total, loop.max_steps)
    ckpt_dir = Path(loop.checkpoint_dir) if loop.checkpoint_dir else out_dir / "checkpoints"

    before = objective.validate(0)
    params = objective.parameters()
    opt = make_optimizer(params, optimizer)
    start, elapsed_before, tokens_before = 0, 0.0, 0
    ckpt = latest_checkpoint(ckpt_dir) if loop.resume else None
    if ckpt is not None:
        meta = load_checkpoint(ckpt, params, opt)
        extra = meta["extra"]
        if extra.get("total_steps", total) != total:
            raise ValueError(
                f"{ckpt}: checkpoint of a run with {extra['total_steps']} steps, this run has {total}; "
                "remove it or use another checkpoint_dir"
            )
        start = int(meta["step"])
        elapsed_before = float(extra.get("elapsed_s", 0.0))
        tokens_before = int(extra.get("tokens", 0))
        objective.load_state_dict(extra.get("state", {}))
    log = LossCSV(out_dir / "loss.csv", objective.log_columns, start if ckpt is not None else None)
    if ckpt is None:
        log.write_rows(before)

    clip_groups = objective.clip_groups()
    order: list[int] = []
    order_epoch = None
    t0, tokens = time.perf_counter(), 0
    bar = Progress(total, start, objective.name, loop.progress)
    try:
        for step in range(start, total):
            epoch, k = divmod(step, steps_per_epoch)
            if epoch != order_epoch:
                order, order_epoch = batch_order(objective.num_rows, epoch, loop.seed), epoch
            factor = lr_factor(step, total, loop.schedule, loop.warmup_ratio, loop.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * factor

            # Accumulate the gradient of the mean loss over the step's micro-batches.
            opt.zero_grad(set_to_none=True)
            micro = range(k * accum, min((k + 1) * accum, n_micro))
            means: dict[str, float] = {}
            for m in micro:
                out = objective.loss(order[m * bs : (m + 1) * bs], step + 1)
                if not out.loss.requires_grad:  # else autograd's own error, which names no cause
                    raise NoGradientError(step + 1, objective.name)
                (out.loss / len(micro)).backward()
                tokens += out.tokens
                for key, v in {"loss": float(out.loss.detach()), **out.logs}.items():
                    means[key] = means.get(key, 0.0) + v / len(micro)
            for group in clip_groups:
                clip_and_check(group, loop.grad_clip, step + 1)
            opt.step()

            log.write_rows(objective.log_step(step + 1, means))
            if (step + 1) % steps_per_epoch == 0 or step + 1 == total:
                log.write_rows(objective.validate(step + 1))
            elapsed = elapsed_before + time.perf_counter() - t0
            if loop.checkpoint_every and ((step + 1) % loop.checkpoint_every == 0 or step + 1 == total):
                extra = {"elapsed_s": elapsed, "tokens": tokens_before + tokens, "total_steps": total,
                         "state": objective.state_dict()}
                save_checkpoint(ckpt_dir, step + 1, params, opt, extra, loop.keep_checkpoints)
            bar.update(means["loss"], tokens / max(1e-9, time.perf_counter() - t0))
            if callback is not None:
                callback(step + 1, means)
    finally:
        bar.close()
        log.close()
    elapsed_this_run = time.perf_counter() - t0
    return TrainResult(
        steps=total,
        start_step=start,
        tokens=tokens_before + tokens,
        elapsed_s=elapsed_before + elapsed_this_run,
        tokens_this_run=tokens,
        elapsed_this_run_s=elapsed_this_run,
    )
