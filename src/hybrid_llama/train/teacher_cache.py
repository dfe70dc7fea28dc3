"""The frozen teacher's per-layer attention inputs and outputs, recorded once per batch or per row.

:class:`TeacherTap` hooks the teacher's attention modules of the hybrid layers: one teacher forward
records, for every hybrid layer, the input its attention received (hidden states, RoPE cos/sin,
mask) and the output it produced, and stops after the last hybrid layer. :class:`TeacherCache` keeps
those tensors of every training row after the row's first pass, so later epochs skip the teacher.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_llama.train.compute import autocast

__all__ = ["TeacherTap", "TeacherCache"]


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
