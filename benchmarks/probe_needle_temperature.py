"""Probe: the multi-key needle test with every softmax attention's logits scaled by ``s``.

Evaluation only. Base (and the recommended variant) miss the needles that lie more than about
1,800 tokens back; one reading is that softmax attention spreads too thin over a long context to
single out the needle whose key the question names. Scaling the logits (a lower temperature, as
YaRN's attention factor or log-length scaling do for contexts past the training length) sharpens
it. ``--scope softmax`` scales the full-attention layers and a hybrid's exact heads, ``exact`` the
exact heads only; the hybrid op's own window softmax is left as trained. The test is the
pipeline's (``hybrid_llama.eval.niah``, its seed and trials, a held-out book as the haystack).

    python benchmarks/probe_needle_temperature.py resources/weights/smollm2 --scales 1,1.1,1.2,1.35
"""

from __future__ import annotations

import argparse
import json

import torch

import hybrid_llama  # noqa: F401  (registers the model type)
from hybrid_llama.books import heldout_books
from hybrid_llama.eval.niah import niah_accuracy
from hybrid_llama.eval.tables import niah_misses
from hybrid_llama.layers import HybridLlamaAttention
from hybrid_llama.models.io import load_model


def scaled_attentions(model, scope: str) -> list:
    """The objects whose ``scaling`` multiplies a softmax's logits: full-attention layers (unless
    ``scope`` is ``exact``) and the exact heads of hybrid layers."""
    out = []
    for block in model.model.layers:
        attn = block.self_attn
        if isinstance(attn, HybridLlamaAttention):
            if attn.exact is not None:
                out.append(attn.exact)
        elif scope == "softmax":
            out.append(attn)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a model directory (base or an exported hybrid)")
    ap.add_argument("--scales", default="1,1.1,1.2,1.35")
    ap.add_argument("--scope", choices=("softmax", "exact"), default="softmax")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--books", default="../shared/data/gutenberg")
    ap.add_argument("--heldout", default="pg174,pg1342")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    books = heldout_books(args.books, args.heldout.split(","))
    targets = scaled_attentions(model, args.scope)
    for s in (float(x) for x in args.scales.split(",")):
        trained = [t.scaling for t in targets]
        for t in targets:
            t.scaling *= s
        with torch.no_grad():
            rows = niah_accuracy(model, tokenizer, context_lens=[args.context], trials=args.trials, n_keys=4,
                                 haystacks=["book"], book_texts=books, seed=args.seed, stage="probe")
        for t, v in zip(targets, trained, strict=True):
            t.scaling = v
        print(json.dumps({"scale": s, "scope": args.scope, "scaled": len(targets),
                          "found": sum(r["accuracy"] == 1.0 for r in rows), "trials": len(rows),
                          "misses": niah_misses(rows, args.context)}), flush=True)


if __name__ == "__main__":
    main()
