"""The frozen teacher's final hidden states of packed rows, handed from attention transfer to LoRA.

Attention transfer already runs the teacher over every training row (through its last hybrid
layer). With ``transfer.teacher_states`` it runs the few remaining layers too, once per row, and
saves the final (normed) hidden states. A LoRA stage distilled from the same model on the same rows
then gets the teacher's logits from one ``lm_head`` matmul instead of a whole forward, the largest
single cost of a distillation step on CPU. Rows are matched by their token ids, so any subset or
order of the transfer rows is found; anything not found (or computed under another dtype or
autocast) is recomputed by the teacher as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid_llama.files import save_safetensors, unreadable

__all__ = ["save_teacher_states", "TeacherStates"]


def save_teacher_states(path: str | os.PathLike, input_ids: torch.Tensor, hidden: torch.Tensor | None,
                        *, dtype: str, autocast: bool) -> None:
    """Write ``hidden[i]`` (``[rows, L, d]``, the teacher's final hidden states) for ``input_ids[i]``.
    ``hidden=None`` writes a file with no rows (the workflow's output exists either way)."""
    ids = input_ids if hidden is not None else input_ids[:0]
    tensors = {"input_ids": ids.contiguous().cpu()}
    if hidden is not None:
        tensors["hidden"] = hidden.contiguous().cpu()
    save_safetensors(path, tensors, metadata={"teacher": json.dumps({"dtype": dtype, "autocast": autocast})})


class TeacherStates:
    """A saved ``save_teacher_states`` file: look up the hidden states of given rows."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                self.teacher = json.loads(f.metadata()["teacher"])
                self.input_ids = f.get_tensor("input_ids")
                self.hidden = f.get_tensor("hidden") if "hidden" in f.keys() else None
        except Exception as exc:  # a truncated or corrupt file: name it and the rule that rebuilds it
            raise unreadable(path, "transfer", exc) from exc
        self._row_of = {tuple(r.tolist()): i for i, r in enumerate(self.input_ids)}

    def __len__(self) -> int:
        return len(self.input_ids)

    def for_rows(self, rows: torch.Tensor, *, dtype: str, autocast: bool) -> tuple[torch.Tensor | None, str]:
        """(hidden states of every row of ``rows`` in order, "") or (None, why not)."""
        if not len(self):
            return None, f"{self.path} holds no rows (transfer.teacher_states is off)"
        want = {"dtype": dtype, "autocast": autocast}
        if self.teacher != want:
            return None, f"{self.path} was computed with {self.teacher}, this teacher runs with {want}"
        idx = [self._row_of.get(tuple(r.tolist())) for r in rows]
        missing = sum(i is None for i in idx)
        if missing:
            return None, f"{self.path} lacks {missing} of the {len(rows)} rows"
        return self.hidden[idx], ""
