"""How a training run stops early: a non-finite loss or gradient, or a caller's request."""

from __future__ import annotations

import torch

__all__ = ["NonFiniteError", "StopTraining", "check_finite"]


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN/inf; the message names the step and the layer."""

    def __init__(self, step: int, where: str, what: str = "loss"):
        super().__init__(f"non-finite {what} at step {step} in {where}")
        self.step, self.where = step, where


class StopTraining(Exception):
    """Raise from a callback to stop a run early (the last checkpoint stays, a rerun resumes)."""


def check_finite(value: torch.Tensor | float, step: int, where: str, what: str = "loss") -> None:
    """Raise :class:`NonFiniteError` naming ``step`` and ``where`` if ``value`` holds a NaN or inf."""
    v = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
    if not bool(torch.isfinite(v).all()):
        raise NonFiniteError(step, where, what)
