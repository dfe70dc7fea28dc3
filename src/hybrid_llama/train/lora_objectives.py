"""The objectives of the LoRA stage: per-token losses of the language model being finetuned.

- :class:`InstructObjective`: next-token cross-entropy on the responses of instruction data (Dolly),
  as the published recreation finetunes;
- :class:`DistillObjective`: the KL divergence from the frozen base model's next-token distribution
  to the hybrid model's, on rows of the transfer corpus (plus, optionally, recall rows whose answer
  positions weigh more: ``hybrid_llama.recall_rows``). Where attention transfer matches each layer
  on its own, this trains the layers together on what the model outputs, which is what held-out
  perplexity measures.

Both validate before training and after every epoch, per token over the whole validation split.
"""

from __future__ import annotations

import functools
import os
import re
from abc import abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hybrid_llama.data import IGNORE_INDEX, load_instruct, load_packed
from hybrid_llama.recall_rows import answer_positions, load_recall_rows
from hybrid_llama.train.compute import autocast, autocast_active
from hybrid_llama.train.errors import NonFiniteError
from hybrid_llama.train.positions import NO_SHIFT, RowShift
from hybrid_llama.train.trainer import MicroLoss, Objective

__all__ = ["TokenObjective", "InstructObjective", "DistillObjective"]

Batch = dict[str, torch.Tensor]


class TokenObjective(Objective):
    """A per-token loss of ``model`` (the peft-wrapped model; its parameters that require grad train).

    A subclass names its data (:meth:`split_rows`, :meth:`batch`) and its summed loss (:meth:`loss_sum`).
    ``shift`` runs each training row at a randomly shifted start (``train.positions``); validation
    rows start at 0.
    """

    name = "lora"
    log_columns = ("step", "split", "loss")
    metric: str  # what the per-token loss is, for metrics.json
    teacher_forwards: int | None = None  # teacher forwards run, where there is a teacher

    def __init__(self, model: nn.Module, *, batch_size: int, device: torch.device, amp: bool,
                 shift: RowShift = NO_SHIFT) -> None:
        self.model, self.batch_size, self.device, self.amp, self.shift = model, batch_size, device, amp, shift
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.val_before: float | None = None
        self.val_per_epoch: list[float] = []
        self.last_train_loss: float | None = None

    @abstractmethod
    def split_rows(self, split: str) -> int:
        """Rows of ``split`` ("train" | "val")."""

    @abstractmethod
    def batch(self, split: str, idx: Any) -> Batch:
        """Rows ``idx`` (indices or a slice) of ``split`` on the device, with an ``attention_mask``."""

    @abstractmethod
    def loss_sum(self, batch: Batch) -> tuple[torch.Tensor, float]:
        """The loss summed over the batch's scored tokens, and their count (their summed weight,
        where positions are weighted)."""

    @property
    def num_rows(self) -> int:
        return self.split_rows("train")

    def parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.named

    def loss(self, rows: list[int], step: int) -> MicroLoss:
        batch = self.batch("train", rows)
        width = batch["input_ids"].shape[1]
        shifted = self.shift.position_ids(rows, step, width, self.device)
        if shifted is not None:
            batch["position_ids"] = shifted
        with autocast(self.device, self.amp):
            total, count = self.loss_sum(batch)
        loss = total / max(1, count)
        if not bool(torch.isfinite(loss.detach())):
            raise _locate_nonfinite(self.model, batch, step)
        return MicroLoss(loss, int(batch["attention_mask"].sum()), {})

    def log_step(self, step: int, logs: dict[str, float]) -> list[tuple]:
        self.last_train_loss = logs["loss"]
        return [(step, "train", logs["loss"])]

    def validate(self, step: int) -> list[tuple]:
        v = self.validation_loss()
        if step == 0:
            self.val_before = v
        else:
            self.val_per_epoch.append(v)
        return [(step, "val", v)]

    def state_dict(self) -> dict[str, Any]:
        return {"val_per_epoch": list(self.val_per_epoch), "last_train_loss": self.last_train_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.val_per_epoch = list(state.get("val_per_epoch", []))
        self.last_train_loss = state.get("last_train_loss")

    @torch.no_grad()
    def validation_loss(self) -> float:
        """The loss per token over the whole validation split (token-weighted, not batch-weighted)."""
        was = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for s in range(0, self.split_rows("val"), self.batch_size):
            batch = self.batch("val", slice(s, s + self.batch_size))
            with autocast(self.device, self.amp):
                loss, c = self.loss_sum(batch)
            total += float(loss)
            count += c
        self.model.train(was)
        return total / max(1, count)


def _trim(batch: Batch, max_length: int | None) -> Batch:
    # Right padding: cut columns past the longest real row (and past max_length).
    width = int(batch["attention_mask"].sum(1).max())
    if max_length is not None:
        width = min(width, int(max_length))
    return {k: v[:, :width] for k, v in batch.items()}


class InstructObjective(TokenObjective):
    """Next-token cross-entropy on the response tokens of instruction data (``prepare_instruct_data``)."""

    metric = "nll"

    def __init__(self, model: nn.Module, path: str | os.PathLike, *, max_length: int | None,
                 max_val_examples: int | None, batch_size: int, device: torch.device, amp: bool,
                 shift: RowShift = NO_SHIFT) -> None:
        super().__init__(model, batch_size=batch_size, device=device, amp=amp, shift=shift)
        self.splits = {"train": load_instruct(path, "train"), "val": load_instruct(path, "val")}
        if max_val_examples is not None:
            self.splits["val"] = {k: v[: int(max_val_examples)] for k, v in self.splits["val"].items()}
        self.max_length = max_length

    def split_rows(self, split: str) -> int:
        return len(self.splits[split]["input_ids"])

    def batch(self, split: str, idx: Any) -> Batch:
        return _trim({k: v[idx].to(self.device) for k, v in self.splits[split].items()}, self.max_length)

    def loss_sum(self, batch: Batch) -> tuple[torch.Tensor, float]:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                            position_ids=batch.get("position_ids")).logits
        labels = batch["labels"][:, 1:]
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
        return nll, int((labels != IGNORE_INDEX).sum())


class DistillObjective(TokenObjective):
    """KL(teacher || student) of the next-token distributions, summed over every position of packed
    transfer-corpus rows; the last ``eval_sequences`` rows are held out for validation.

    ``teacher_states``: attention transfer's ``teacher_states.safetensors``; training rows found there
    get the teacher's logits from one ``lm_head`` matmul instead of a teacher forward.
    """

    metric = "kl"

    def __init__(self, model: nn.Module, path: str | os.PathLike, teacher: nn.Module, *, eval_sequences: int,
                 teacher_states: str | os.PathLike | None, batch_size: int, device: torch.device,
                 amp: bool, shift: RowShift = NO_SHIFT, recall_rows: str | os.PathLike | None = None,
                 answer_weight: float = 1.0, answer_target: str = "teacher") -> None:
        super().__init__(model, batch_size=batch_size, device=device, amp=amp, shift=shift)
        rows = load_packed(path)
        k = int(eval_sequences)
        if not 1 <= k < len(rows):
            raise ValueError(f"{path}: {len(rows)} rows, need 1 <= lora.eval_sequences={k} < rows")
        self.rows = {"train": rows[:-k], "val": rows[-k:]}
        # Recall rows train after the corpus's rows (indices from len(rows["train"]) on); each
        # position's loss is weighted, answer_weight where it predicts an answer token, and with
        # answer_target 'token' that loss is the answer token's cross-entropy instead of the KL.
        if answer_target not in ("teacher", "token"):
            raise ValueError(f"lora.answer_target={answer_target!r}: 'teacher' or 'token'")
        self.answer_target, self.answer_weight = answer_target, float(answer_weight)
        self.recall: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens, positions predicting an answer)
        if recall_rows is not None:
            tokens, answers = load_recall_rows(recall_rows)
            if batch_size > 1 and tokens.shape[1] != rows.shape[1]:
                raise ValueError(f"{recall_rows}: recall rows of {tokens.shape[1]} tokens cannot share batches of "
                                 f"{batch_size} with corpus rows of {rows.shape[1]}: use lora.batch_size 1")
            self.recall = (tokens, answer_positions(answers))
        self.teacher = teacher
        self.teacher_forwards = 0
        self.train_states = None
        self.val_states: torch.Tensor | None = None  # the teacher's, the same at every validation
        if teacher_states is not None:
            from hybrid_llama.train.teacher_states import TeacherStates

            weight = next(teacher.parameters())
            self.train_states, why = TeacherStates(teacher_states).for_rows(
                self.rows["train"], dtype=str(weight.dtype), autocast=autocast_active(weight.device, amp))
            print(f"distill: teacher states {'from transfer' if why == '' else 'recomputed: ' + why}", flush=True)

    def split_rows(self, split: str) -> int:
        return len(self.rows[split]) + (len(self.recall[0]) if split == "train" and self.recall else 0)

    def batch(self, split: str, idx: Any) -> Batch:
        if split == "val":
            ids = self.rows["val"][idx].to(self.device)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if self.val_states is not None:
                batch["teacher_states"] = self.val_states[idx]  # already on the device
            return batch
        idx = list(range(self.split_rows("train")))[idx] if isinstance(idx, slice) else list(idx)
        n = len(self.rows["train"])
        ids = torch.stack([self.rows["train"][i] if i < n else self.recall[0][i - n] for i in idx]).to(self.device)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if any(i >= n for i in idx):  # recall rows: weighted; the transfer's saved states hold corpus rows only
            none = torch.zeros(ids.shape[1], dtype=torch.bool)
            predicts = torch.stack([none if i < n else self.recall[1][i - n] for i in idx]).to(self.device)
            batch["weights"] = 1.0 + (self.answer_weight - 1.0) * predicts.float()
            if self.answer_target == "token":
                batch["hard"] = predicts
        elif self.train_states is not None:
            batch["teacher_states"] = self.train_states[idx].to(self.device)
        return batch

    def validation_loss(self) -> float:
        # The teacher is frozen: its states of the validation rows, run once in the batches every
        # validation reads, serve the validations before and after training alike.
        if self.val_states is None:
            with autocast(self.device, self.amp):
                self.val_states = torch.cat([
                    self._teacher_states(self.batch("val", slice(s, s + self.batch_size))["input_ids"])
                    for s in range(0, self.split_rows("val"), self.batch_size)])
        return super().validation_loss()

    @torch.no_grad()
    def _teacher_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The teacher's final hidden states: what teacher(input_ids).logits computes before its lm_head."""
        self.teacher_forwards += 1
        return self.teacher.model(input_ids=input_ids).last_hidden_state

    def loss_sum(self, batch: Batch) -> tuple[torch.Tensor, float]:
        states = batch.get("teacher_states")
        if states is None:
            states = self._teacher_states(batch["input_ids"])
        # The teacher's targets are relative in position: a shifted student row keeps them.
        student = _causal_lm(self.model)
        # A row longer than one KL chunk also recomputes each decoder layer in the backward: at 8192
        # tokens the layers' saved activations, not the logits, are most of the memory.
        recompute = batch["input_ids"].shape[1] > KL_CHUNK and torch.is_grad_enabled()
        if recompute:  # transformers >= 5.2x names it activation checkpointing
            getattr(student, "activation_checkpointing_enable", student.gradient_checkpointing_enable)(
                {"use_reentrant": False, "context_fn": KEEP_ATTENTION_OUTPUTS})
        try:
            hidden = student.model(input_ids=batch["input_ids"],
                                   position_ids=batch.get("position_ids")).last_hidden_state
        finally:
            if recompute:
                getattr(student, "activation_checkpointing_disable", student.gradient_checkpointing_disable)()
        weights, hard = batch.get("weights"), batch.get("hard")
        # The token each position predicts, for the positions trained toward it (answer_target 'token').
        labels = None if hard is None else torch.roll(batch["input_ids"], -1, dims=1)
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[1], KL_CHUNK):
            chunk = slice(s, s + KL_CHUNK)
            w = None if weights is None else weights[:, chunk]
            h = None if hard is None else (hard[:, chunk], labels[:, chunk])
            total = total + checkpoint(self._kl_sum, student.lm_head, hidden[:, chunk], states[:, chunk], w, h,
                                       use_reentrant=False)
        count = batch["input_ids"].numel() if weights is None else float(weights.sum())
        return total, count

    def _kl_sum(self, lm_head: nn.Module, hidden: torch.Tensor, states: torch.Tensor,
                weights: torch.Tensor | None,
                hard: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """KL(teacher || student) summed over these positions (weighted where ``weights`` is given);
        where ``hard`` = (mask, labels) marks a position, its term is the cross-entropy of its label."""
        with torch.no_grad():
            target = torch.log_softmax(self.teacher.lm_head(states).float(), dim=-1)
        logp = torch.log_softmax(lm_head(hidden).float(), dim=-1)
        if weights is None:
            return F.kl_div(logp.flatten(0, 1), target.flatten(0, 1), log_target=True, reduction="sum")
        per_position = F.kl_div(logp, target, log_target=True, reduction="none").sum(-1)
        if hard is not None:
            mask, labels = hard
            nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            per_position = torch.where(mask, nll, per_position)
        return (per_position * weights).sum()


# Positions whose logits the distillation holds at once: a row of 8192 tokens would hold four
# [L, vocab] fp32 tensors (6.4 GB for SmolLM2's 49K vocabulary) and its backward as many again;
# chunks of 2048, recomputed in the backward, hold one chunk's. Rows up to 2048 are one chunk, and
# only longer rows recompute their decoder layers. (Keeping a one-chunk row's logits for the
# backward made the distillation jobs slower, not faster: docs/ideas.md.)
KL_CHUNK = 2048


def _attention_kernels() -> frozenset:
    """The fused softmax-attention kernels SDPA dispatches to on this build (CPU and CUDA)."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


def _keep_attention(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


_ATTENTION_KERNELS = _attention_kernels()
# What the recomputed layers keep from their first forward: the softmax layers' attention outputs.
# Over a row of 8192 tokens those kernels are most of a softmax layer's recompute and their outputs
# a few MB each, so keeping them costs no memory to speak of (docs/performance.md). Either way the
# gradients are the same numbers.
KEEP_ATTENTION_OUTPUTS = functools.partial(create_selective_checkpoint_contexts, _keep_attention)


def _causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a peft wrapper (its LoRA layers are in place), or ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _locate_nonfinite(model: nn.Module, batch: Batch, step: int) -> NonFiniteError:
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
