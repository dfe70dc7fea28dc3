"""Training checkpoints: safetensors + JSON only (no pickle).

A checkpoint directory ``step_{step:08d}/`` holds ``state.safetensors`` (trainable tensors under
``param.<name>``, the AdamW state flattened to ``optim.<index>.<key>``, RNG states as uint8 tensors)
and ``state.json`` (step, parameter names, optimizer groups and scalars, Python/numpy RNG, the
trainer's ``extra``). It is written through ``files.atomic_path``, so a kill never leaves a
half-written checkpoint that :func:`latest_checkpoint` would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hybrid_llama.files import atomic_path

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]

Named = list[tuple[str, torch.nn.Parameter]]


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
    named_params: Named,
    opt: torch.optim.Optimizer,
    extra: dict | None = None,
    keep: int = 2,
) -> Path:
    """Write ``ckpt_dir/step_{step:08d}/`` atomically and prune to the newest ``keep`` checkpoints."""
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
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
    meta = {
        "step": step,
        "param_names": [n for n, _ in named_params],
        "param_groups": sd["param_groups"],
        "optim_scalars": scalars,
        "py_rng": _py_rng(),
        "extra": extra or {},
    }
    with atomic_path(final) as tmp:
        tmp.mkdir(exist_ok=True)  # a same-pid leftover of a killed run is overwritten file by file
        save_file(tensors, str(tmp / "state.safetensors"))
        (tmp / "state.json").write_text(json.dumps(meta))
    olds = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in olds[: max(0, len(olds) - keep)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``ckpt_dir``, or None."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: str | os.PathLike, named_params: Named, opt: torch.optim.Optimizer) -> dict:
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
