"""Shared training-loop pieces for attention transfer and LoRA finetuning.

Checkpoints are safetensors + JSON only (no pickle): trainable tensors under ``param.<name>``, the AdamW
state flattened to ``optim.<index>.<key>``, RNG states as uint8 tensors, scalars in ``state.json``.
Each checkpoint is written into a temporary directory and renamed into place, so a kill never leaves a
half-written checkpoint behind.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = [
    "NonFiniteError",
    "StopTraining",
    "RUN_DEFAULTS",
    "stage_defaults",
    "merge_config",
    "seed_everything",
    "pick_device",
    "autocast",
    "make_optimizer",
    "lr_factor",
    "set_lr",
    "clip_and_check",
    "check_finite",
    "batch_order",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "LossCSV",
    "Progress",
    "run_steps",
]


class NonFiniteError(FloatingPointError):
    """A loss or gradient became NaN/inf; the message names the step and the layer."""

    def __init__(self, step: int, where: str, what: str = "loss"):
        super().__init__(f"non-finite {what} at step {step} in {where}")
        self.step, self.where = step, where


class StopTraining(Exception):
    """Raise from a callback to stop a run early (the last checkpoint stays, a rerun resumes)."""


# How a run is executed rather than what it trains: not part of the recipe, so not in the config
# schema (the workflow sets checkpoint_dir itself). Recipe defaults come from the schema.
RUN_DEFAULTS: dict[str, Any] = {
    "checkpoint_dir": None,
    "resume": True,
    "progress": True,
}


def stage_defaults(section: str) -> dict[str, Any]:
    """The defaults of a training stage: the config schema's section ("transfer" | "lora") plus the
    run options. The workflow fills the same schema defaults, so both train the same recipe."""
    from hybrid_llama.pipeline import schema_defaults

    return {**schema_defaults(section), **RUN_DEFAULTS}


def merge_config(given: dict | None, defaults: dict, what: str) -> dict:
    """Defaults overlaid with ``given``; unknown keys raise so config typos fail before training."""
    given = dict(given or {})
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"{what}: unknown keys {sorted(unknown)} (allowed: {sorted(defaults)})")
    return {**defaults, **given}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_active(device: torch.device, enabled: bool = True) -> bool:
    """Whether ``autocast(device, enabled)`` changes anything (it does on CUDA only)."""
    return bool(enabled) and device.type == "cuda"


def autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast on CUDA; a no-op on CPU so CPU runs stay fp32 and bit-reproducible."""
    if autocast_active(device, enabled):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(named: Iterable[tuple[str, torch.nn.Parameter]], cfg: dict) -> torch.optim.AdamW:
    """AdamW over the trainable params in up to three groups: the mixing logits (names containing
    ``mixing.``) at ``logits_lr``, the feature maps (``feature_map.``) at ``feature_map_lr``, the
    rest at ``lr`` (a group's lr of None means ``lr``).

    The logits need far larger steps than the weights: moving a/b = sigmoid(logit) meaningfully takes
    O(1) changes, which lr 1e-3 does not reach in a short run; Hedgehog maps start at the identity
    and likewise want larger steps than a LoRA update of pretrained projections.
    """
    named = [(n, p) for n, p in named if p.requires_grad]
    if not named:
        raise ValueError("nothing to train: no parameter requires grad")

    def group_of(name: str) -> str:
        return "logits" if "mixing." in name else "feature_map" if "feature_map." in name else "weights"

    groups = []
    for group, key in (("weights", None), ("logits", "logits_lr"), ("feature_map", "feature_map_lr")):
        params = [p for n, p in named if group_of(n) == group]
        lr = cfg.get(key) if key and cfg.get(key) is not None else cfg["lr"]
        if params:
            groups.append({"params": params, "lr": lr, "base_lr": lr})
    return torch.optim.AdamW(groups, betas=tuple(cfg["betas"]), weight_decay=cfg["weight_decay"], foreach=False)


def lr_factor(step: int, total: int, cfg: dict) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based) of ``total``: warmup then decay."""
    warm = int(math.ceil(cfg["warmup_ratio"] * total))
    if step < warm:
        return (step + 1) / warm
    kind, floor = cfg["schedule"], cfg["min_lr_ratio"]
    if kind == "constant":
        return 1.0
    progress = (step - warm) / max(1, total - warm - 1) if total - warm > 1 else 1.0
    progress = min(1.0, progress)
    if kind == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if kind == "linear":
        return floor + (1 - floor) * (1 - progress)
    raise ValueError(f"unknown schedule {kind!r} (want cosine | linear | constant)")


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, cfg: dict) -> float:
    f = lr_factor(step, total, cfg)
    for g in opt.param_groups:
        g["lr"] = g["base_lr"] * f
    return cfg["lr"] * f


def check_finite(value: torch.Tensor | float, step: int, where: str, what: str = "loss") -> None:
    v = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
    if not bool(torch.isfinite(v).all()):
        raise NonFiniteError(step, where, what)


def clip_and_check(named: list[tuple[str, torch.nn.Parameter]], max_norm: float | None, step: int) -> float:
    """Clip the global grad norm; a non-finite norm raises naming the first parameter with a bad grad.

    The check runs before clipping: clipping by a NaN norm would spread NaN into every gradient.
    """
    grads = [(n, p.grad) for n, p in named if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for _, g in grads]))
    if not bool(torch.isfinite(norm)):
        for name, g in grads:
            if not bool(torch.isfinite(g).all()):
                raise NonFiniteError(step, name, "gradient")
        raise NonFiniteError(step, "gradient norm", "gradient")
    if max_norm:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, g in grads:
            g.mul_(coef.to(g.dtype))
    return float(norm)


def batch_order(n: int, epoch: int, seed: int) -> list[int]:
    """Row order for one epoch; a function of (seed, epoch) only, so a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


# ------------------------------------------------------------------------------------ checkpoints


def _rng_tensors() -> dict[str, torch.Tensor]:
    t = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            t[f"rng.cuda.{i}"] = s
    return t


def _py_rng() -> dict:
    v, state, gauss = random.getstate()
    out: dict[str, Any] = {"python": [v, list(state), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return out


def _restore_rng(tensors: dict[str, torch.Tensor], py: dict) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    v, state, gauss = py["python"]
    random.setstate((v, tuple(state), gauss))
    if "numpy" in py:
        import numpy as np

        kind, keys, pos, has_gauss, cached = py["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    step: int,
    named_params: list[tuple[str, torch.nn.Parameter]],
    opt: torch.optim.Optimizer,
    extra: dict | None = None,
    keep: int = 2,
) -> Path:
    """Write ``ckpt_dir/step_{step:08d}/`` atomically and prune to the newest ``keep`` checkpoints."""
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {f"param.{n}": p.detach().cpu().contiguous().clone() for n, p in named_params}
    sd = opt.state_dict()
    scalars: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optim.{idx}.{key}"] = val.detach().cpu().contiguous().clone()
            else:
                scalars[f"{idx}.{key}"] = val
    tensors.update(_rng_tensors())
    save_file(tensors, str(tmp / "state.safetensors"))
    meta = {
        "step": step,
        "param_names": [n for n, _ in named_params],
        "param_groups": sd["param_groups"],
        "optim_scalars": scalars,
        "py_rng": _py_rng(),
        "extra": extra or {},
    }
    (tmp / "state.json").write_text(json.dumps(meta))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    olds = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in olds[: max(0, len(olds) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(
    path: str | os.PathLike,
    named_params: list[tuple[str, torch.nn.Parameter]],
    opt: torch.optim.Optimizer,
) -> dict:
    """Restore params, optimizer and RNG from a checkpoint dir; returns its JSON (step, extra, ...)."""
    path = Path(path)
    meta = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "state.safetensors"))
    names = [n for n, _ in named_params]
    if names != meta["param_names"]:
        raise ValueError(f"{path}: checkpoint holds different trainable parameters than this run")
    with torch.no_grad():
        for n, p in named_params:
            p.copy_(tensors[f"param.{n}"])
    state: dict[int, dict[str, Any]] = {}
    for key, val in tensors.items():
        if key.startswith("optim."):
            _, idx, k = key.split(".", 2)
            state.setdefault(int(idx), {})[k] = val
    for key, val in meta["optim_scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = val
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    _restore_rng(tensors, meta["py_rng"])
    return meta


# ----------------------------------------------------------------------------------- logging


class LossCSV:
    """Append-only CSV log. On resume, rows after the checkpoint's step are dropped, so none repeat."""

    def __init__(self, path: str | os.PathLike, header: list[str], resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[list[str]] = []
        if resume_step is not None and self.path.is_file():
            with open(self.path, newline="") as f:
                r = csv.reader(f)
                next(r, None)
                rows = [row for row in r if row and int(row[0]) <= resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(header)
            w.writerows(rows)
        os.replace(tmp, self.path)
        self._f = open(self.path, "a", newline="")
        self._w = csv.writer(self._f)

    def write(self, *row: Any) -> None:
        self._w.writerow([f"{v:.8g}" if isinstance(v, float) else v for v in row])

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Progress:
    """tqdm bar over optimizer steps showing loss and tokens/s (silent when disabled)."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4g}", tok_s=f"{tokens_per_s:.0f}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


Callback = Callable[[int, dict], None]
StepFn = Callable[[int, int, int], tuple[torch.Tensor, dict[str, float], int]]


def run_steps(
    *,
    named_trainables: list[tuple[str, torch.nn.Parameter]],
    n_micro: int,
    step_fn: StepFn,
    cfg: dict,
    ckpt_dir: Path,
    on_step: Callable[[int, dict[str, float]], None],
    on_epoch_end: Callable[[int, int], None] | None = None,
    callback: Callback | None = None,
    desc: str = "train",
    before_resume: Callable[[int | None], None] | None = None,
    state: dict | None = None,
    clip_groups: list[list[tuple[str, torch.nn.Parameter]]] | None = None,
) -> dict:
    """The shared optimizer loop: lr schedule, grad accumulation, clipping, checkpoints and resume.

    ``step_fn(step, epoch, micro_index)`` runs forward on one micro-batch and returns
    (loss, per-item logs, tokens); it must raise NonFiniteError itself when it can name a layer.
    Optimizer step ``s`` (0-based) of epoch ``e`` uses micro-batches ``[k*accum, (k+1)*accum)`` of that
    epoch's order, so a resumed run replays exactly the batches an uninterrupted one would.
    ``before_resume(step)`` is called with the checkpoint step (or None) before the loop starts, so the
    caller can open its CSV log truncated to that step. ``state`` (JSON-able dict owned by the caller,
    e.g. per-epoch validation losses) is saved in each checkpoint and restored in place on resume.
    ``clip_groups``: parameter groups clipped to ``grad_clip`` separately (default: one global group);
    transfer clips per layer, since its layers are independent problems with very different scales.
    Returns ``{steps, start_step, tokens, elapsed_s, tokens_this_run, elapsed_this_run_s}``.
    """
    accum = int(cfg["grad_accum"])
    steps_per_epoch = math.ceil(n_micro / accum)
    if steps_per_epoch == 0:
        raise ValueError("no training batches")
    total = steps_per_epoch * int(cfg["epochs"])
    if cfg["max_steps"] is not None:
        total = min(total, int(cfg["max_steps"]))
    opt = make_optimizer(named_trainables, cfg)
    start, elapsed_before, tokens_before = 0, 0.0, 0
    ckpt = latest_checkpoint(ckpt_dir) if cfg["resume"] else None
    if ckpt is not None:
        meta = load_checkpoint(ckpt, named_trainables, opt)
        if meta["extra"].get("total_steps", total) != total:
            raise ValueError(
                f"{ckpt}: checkpoint of a run with {meta['extra']['total_steps']} steps, this run has {total}; "
                "remove it or use another checkpoint_dir"
            )
        start = int(meta["step"])
        elapsed_before = float(meta["extra"].get("elapsed_s", 0.0))
        tokens_before = int(meta["extra"].get("tokens", 0))
        if state is not None:
            state.clear()
            state.update(meta["extra"].get("state", {}))
    if before_resume is not None:
        before_resume(start if ckpt is not None else None)
    t0, tokens = time.perf_counter(), 0
    bar = Progress(total, start, desc, cfg["progress"])
    every = int(cfg["checkpoint_every"] or 0)
    try:
        for step in range(start, total):
            epoch, k = divmod(step, steps_per_epoch)
            micro = range(k * accum, min((k + 1) * accum, n_micro))
            set_lr(opt, step, total, cfg)
            opt.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for m in micro:
                loss, logs, ntok = step_fn(step, epoch, m)
                (loss / len(micro)).backward()
                tokens += ntok
                for key, v in logs.items():
                    sums[key] = sums.get(key, 0.0) + v / len(micro)
            for group in clip_groups or [named_trainables]:
                clip_and_check(group, cfg["grad_clip"], step + 1)
            opt.step()
            on_step(step + 1, sums)
            if on_epoch_end is not None and ((step + 1) % steps_per_epoch == 0 or step + 1 == total):
                on_epoch_end(epoch, step + 1)
            elapsed = elapsed_before + time.perf_counter() - t0
            if every and ((step + 1) % every == 0 or step + 1 == total):
                extra = {"elapsed_s": elapsed, "tokens": tokens_before + tokens, "total_steps": total,
                         "state": state or {}}
                save_checkpoint(ckpt_dir, step + 1, named_trainables, opt, extra, int(cfg["keep_checkpoints"]))
            bar.update(sums.get("loss", float("nan")), tokens / max(1e-9, time.perf_counter() - t0))
            if callback is not None:
                callback(step + 1, sums)
    finally:
        bar.close()
    return {
        "steps": total,
        "start_step": start,
        "tokens": tokens_before + tokens,
        "elapsed_s": elapsed_before + time.perf_counter() - t0,
        "tokens_this_run": tokens,
        "elapsed_this_run_s": time.perf_counter() - t0,
    }


def add_hybrid_arguments(ap, *, layers_help: str, layers_required: bool) -> None:
    """The hybrid-layout flags shared by the training CLIs (defaults from the config schema)."""
    from hybrid_llama.pipeline import hybrid_defaults

    d = hybrid_defaults()
    ap.add_argument("--layers", required=layers_required, default=None, help=layers_help)
    ap.add_argument("--window", type=int, default=d["window"])
    ap.add_argument("--feature-map", default=d["feature_map"])
    ap.add_argument("--formulation", default=d["formulation"])
    ap.add_argument("--backend", default=d["backend"])


def hybrid_from_arguments(args) -> dict | None:
    """The hybrid config dict from :func:`add_hybrid_arguments`' flags (None without --layers)."""
    if not args.layers:
        return None
    return {"layers": [int(x) for x in args.layers.split(",")], "window": args.window,
            "feature_map": args.feature_map, "formulation": args.formulation, "backend": args.backend}
