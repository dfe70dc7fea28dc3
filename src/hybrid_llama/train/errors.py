"""How a training run stops early: a non-finite loss or gradient, a loss no trained parameter
reaches, or a caller's request."""

from __future__ import annotations

import torch

__all__ = ["NoGradientError", "NonFiniteError", "StopTraining", "check_finite"]


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN/inf; the message names the step and the layer."""

    def __init__(self, step: int, where: str, what: str = "loss"):
        super().__init__(f"non-finite {what} at step {step} in {where}")
        self.step, self.where = step, where


class NoGradientError(RuntimeError):
    """The loss does not depend on any trained parameter, so no step could change the model."""

    def __init__(self, step: int, objective: str):
        super().__init__(
            f"the {objective} loss at step {step} does not depend on any trained parameter, so nothing would "
            "train: check what the stage trains (transfer.trainable, the LoRA target) and, for the linear "
            "part, that its rows are longer than the window"
        )
        self.step = step


class StopTraining(Exception):
    """Raise from a callback to stop a run early (the last checkpoint stays, a rerun resumes)."""


def check_finite(value: torch.Tensor | float, step: int, where: str, what: str = "loss") -> None:
    """Raise :class:`NonFiniteError` naming ``step`` and ``where`` if ``value`` holds a NaN or inf."""
    v = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
    if not bool(torch.isfinite(v).all()):
        raise NonFiniteError(step, where, what)
