"""Typed settings of the training stages, built from the config schema's defaults.

The workflow and the CLIs hand a stage a flat dict: the keys of the schema's ``transfer`` or ``lora``
section (config/schema.yaml documents each one) plus the run options of :data:`RUN_DEFAULTS`.
``TransferSettings.from_dict`` / ``LoraSettings.from_dict`` overlay it on the schema's defaults,
reject unknown keys, and split it into the groups each part of the code reads: the optimizer
(:class:`OptimizerSettings`), the loop (:class:`LoopSettings`), the LoRA adapter
(:class:`AdapterSettings`) and the stage's own fields.
Values are kept as given, so ``as_dict()`` gives back the dict the stage ran with (metrics.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, ClassVar, TypeVar

from hybrid_llama.config import schema_defaults
from hybrid_llama.names import CORPUS_KEYS  # the keys that choose run_transfer's packed rows

__all__ = [
    "RUN_DEFAULTS",
    "CORPUS_KEYS",
    "OptimizerSettings",
    "LoopSettings",
    "AdapterSettings",
    "TransferSettings",
    "LoraSettings",
]

# How a run is executed rather than what it trains: not part of the recipe, so not in the config
# schema (the workflow sets checkpoint_dir itself).
RUN_DEFAULTS: dict[str, Any] = {
    "checkpoint_dir": None,
    "resume": True,
    "progress": True,
}


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW: peak learning rates (None = ``lr``) of the parameter groups, betas, weight decay."""

    lr: float
    logits_lr: float | None
    feature_map_lr: float | None
    betas: Sequence[float]
    weight_decay: float


@dataclass(frozen=True)
class LoopSettings:
    """What the trainer needs: batching, run length, lr schedule, clipping, checkpoints, display."""

    batch_size: int
    grad_accum: int
    epochs: int
    max_steps: int | None
    seed: int
    schedule: str
    warmup_ratio: float
    min_lr_ratio: float
    grad_clip: float | None
    checkpoint_every: int
    keep_checkpoints: int
    checkpoint_dir: str | None
    resume: bool
    progress: bool


@dataclass(frozen=True)
class AdapterSettings:
    """The LoRA adapter: rank, alpha, dropout, and where it goes (``target`` or explicit ``layers``)."""

    r: int
    alpha: float
    dropout: float
    target: str
    layers: list[int] | None


# Fields of a stage's settings that group several keys of the flat dict.
_GROUPS: dict[str, type] = {"optimizer": OptimizerSettings, "loop": LoopSettings, "adapter": AdapterSettings}


def _pick(cls: type, values: dict[str, Any]) -> Any:
    """Dataclass ``cls`` from the entries of ``values`` named like its fields."""
    return cls(**{f.name: values[f.name] for f in fields(cls)})


def _flatten(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        out.update(_flatten(value) if is_dataclass(value) else {f.name: value})
    return out


S = TypeVar("S", bound="_StageSettings")


class _StageSettings:
    """``from_dict`` / ``as_dict`` / ``defaults`` shared by the stages' settings."""

    SECTION: ClassVar[str]  # the schema section
    WHAT: ClassVar[str]  # names the dict in errors
    EXCLUDED: ClassVar[tuple[str, ...]] = ()  # schema keys the stage does not read
    EXTRA: ClassVar[dict[str, Any]] = {}  # library-only options after the run options

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every accepted key with its default, in the order metrics.json records them."""
        section = {k: v for k, v in schema_defaults(cls.SECTION).items() if k not in cls.EXCLUDED}
        return {**section, **RUN_DEFAULTS, **cls.EXTRA}

    @classmethod
    def from_dict(cls: type[S], given: dict[str, Any] | None = None) -> S:
        """The defaults overlaid with ``given``; unknown keys raise, so config typos fail before training."""
        defaults = cls.defaults()
        given = dict(given or {})
        unknown = set(given) - set(defaults)
        if unknown:
            raise ValueError(f"{cls.WHAT}: unknown keys {sorted(unknown)} (allowed: {sorted(defaults)})")
        values = {**defaults, **given}
        settings = cls(**{f.name: _pick(_GROUPS[f.name], values) if f.name in _GROUPS else values[f.name]
                          for f in fields(cls)})
        # A schema key without a field would be dropped silently: fail loudly instead.
        missing = set(defaults) - set(_flatten(settings))
        if missing:
            raise TypeError(f"{cls.__name__} has no field for {sorted(missing)}: update it with the schema")
        return settings

    def as_dict(self) -> dict[str, Any]:
        """The flat dict of every setting, as given, in the order of :meth:`defaults`."""
        flat = _flatten(self)
        return {k: flat[k] for k in self.defaults()}


@dataclass(frozen=True)
class TransferSettings(_StageSettings):
    """Attention transfer: the schema's ``transfer`` section minus the corpus keys, plus ``eval_path``
    (a held-out packed file; None = the last ``eval_sequences`` training rows)."""

    SECTION: ClassVar[str] = "transfer"
    WHAT: ClassVar[str] = "transfer train config"
    EXCLUDED: ClassVar[tuple[str, ...]] = CORPUS_KEYS
    EXTRA: ClassVar[dict[str, Any]] = {"eval_path": None}

    optimizer: OptimizerSettings
    loop: LoopSettings
    trainable: str
    eval_sequences: int
    eval_path: str | None
    device: str
    dtype: str
    autocast: bool
    teacher_cache_gib: float
    teacher_states: bool
    max_position: int
    position_draw: str


@dataclass(frozen=True)
class LoraSettings(_StageSettings):
    """LoRA finetuning: the schema's ``lora`` section."""

    SECTION: ClassVar[str] = "lora"
    WHAT: ClassVar[str] = "lora config"

    optimizer: OptimizerSettings
    loop: LoopSettings
    adapter: AdapterSettings
    objective: str
    eval_sequences: int
    recall_rows: int
    recall_facts: int
    recall_asks: int
    recall_same_attribute: bool
    recall_subjects: str
    recall_seq_len: int | None
    answer_weight: float
    answer_target: str
    max_length: int | None
    max_val_examples: int | None
    device: str
    dtype: str
    autocast: bool
    max_position: int
    position_draw: str
