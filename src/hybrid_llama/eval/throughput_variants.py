"""The models the throughput measurement compares: the base model (SDPA) and a hybrid layout per
backend that implements it (chunked on the CPU; triton where CUDA is; the published recreation's
``seed_naive``), each built lazily from the base weights. Speed does not depend on trained weights."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybrid_llama.runtime import resolve_dtype

log = logging.getLogger(__name__)

Variant = tuple[Any, Any, str]  # (model, tokenizer or None, backend label)


def triton_available(device: str | torch.device) -> bool:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401

        from hybrid_llama.ops.triton import prefill  # noqa: F401
    except Exception:
        return False
    return True


def seed_naive_available() -> bool:
    """True once the ops dispatcher accepts ``backend="seed_naive"`` (not just once the module exists)."""
    try:
        from hybrid_llama import ops
    except Exception:
        return False
    return "seed_naive" in getattr(ops, "BACKENDS", ())


def build_throughput_variants(
    model_dir: str | Path,
    hybrid_cfg: dict,
    device: str,
    dtype: str | torch.dtype,
    backends: tuple[str, ...] = ("chunked", "triton", "seed_naive"),
) -> dict[str, Callable[[], Variant]]:
    """Lazy variants for :func:`measure_throughput`: ``base`` (SDPA) and ``hybrid_<backend>``.

    Each is loaded fresh from ``model_dir`` (a plain Llama directory) when measured, converted with
    ``convert_to_hybrid(..., backend=<backend>)`` using ``hybrid_cfg`` (HybridConfig fields; ``layers``
    defaults to every layer). ``triton`` is left out without CUDA/triton, ``seed_naive`` while
    ``hybrid_llama.ops.BACKENDS`` does not list it.
    """
    from hybrid_llama.models import convert_to_hybrid, load_model

    tdtype = resolve_dtype(dtype)
    cfg = {k: v for k, v in dict(hybrid_cfg).items() if k != "backend"}

    def base() -> Variant:
        model, tok = load_model(model_dir, dtype=tdtype, device=device)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("sdpa")
        return model, tok, "sdpa"

    def hybrid(backend: str) -> Callable[[], Variant]:
        def build() -> Variant:
            model, tok = load_model(model_dir, dtype=tdtype, device=device)
            layers = cfg.get("layers") or list(range(model.config.num_hidden_layers))
            convert_to_hybrid(model, layers, **{k: v for k, v in cfg.items() if k != "layers"}, backend=backend)
            return model.to(device=device, dtype=tdtype).eval(), tok, backend
        return build

    out: dict[str, Callable[[], Variant]] = {"base": base}
    for b in backends:
        if b == "triton" and not triton_available(device):
            log.info("throughput: no triton variant (needs CUDA and triton)")
            continue
        if b == "seed_naive" and not seed_naive_available():
            log.warning("throughput: no seed_naive variant (hybrid_llama.ops does not accept backend='seed_naive')")
            continue
        recipe = (cfg.get("formulation", "hybrid"), cfg.get("feature_map", "elu1"))
        if b == "seed_naive" and recipe != ("hybrid", "elu1"):
            log.info("throughput: seed_naive implements only the recreation's formulation (hybrid, elu1)")
            continue
        out[f"hybrid_{b}"] = hybrid(b)
    return out
