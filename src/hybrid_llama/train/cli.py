"""The command-line flags shared by the training CLIs (``python -m hybrid_llama.train.transfer``, ``.finetune``)."""

from __future__ import annotations

import argparse
from dataclasses import fields

__all__ = ["add_hybrid_arguments", "hybrid_from_arguments"]


def add_hybrid_arguments(ap: argparse.ArgumentParser, *, layers_help: str, layers_required: bool) -> None:
    """The hybrid-layout flags, defaulting as ``HybridConfig`` does (the schema's hybrid defaults)."""
    from hybrid_llama.layers import HybridConfig  # imports transformers: only when a CLI is built

    d = {f.name: f.default for f in fields(HybridConfig) if f.name != "layers"}
    ap.add_argument("--layers", required=layers_required, default=None, help=layers_help)
    ap.add_argument("--window", type=int, default=d["window"])
    ap.add_argument("--feature-map", default=d["feature_map"])
    ap.add_argument("--formulation", default=d["formulation"])
    ap.add_argument("--backend", default=d["backend"])
    ap.add_argument("--decay", type=float, default=d["decay"],
                    help="initial gamma of a decaying linear state, trained with the mixing logits (default: none)")


def hybrid_from_arguments(args: argparse.Namespace) -> dict | None:
    """The hybrid config dict from :func:`add_hybrid_arguments`' flags (None without --layers)."""
    if not args.layers:
        return None
    return {"layers": [int(x) for x in args.layers.split(",")], "window": args.window,
            "feature_map": args.feature_map, "formulation": args.formulation, "backend": args.backend,
            **({} if args.decay is None else {"decay": args.decay})}
