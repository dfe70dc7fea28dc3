"""Probe: keyed recall on fresh recall rows, base against a hybrid, by how far back the fact lies.

The multi-key needles are missed past about 2,000 tokens by base and the recommended variant alike
(docs/long-context.md, "What to build next"). This asks the same of the recall rows' own format:
fresh rows (a seed the training rows do not use, the training books), questions at the row's end
only, and for each fact whether every token of its value is the model's argmax when the row is
teacher-forced. Counts are binned by the distance from the fact to its answer.

    python benchmarks/probe_recall_reach.py results/smollm2/lolcats_retrieval/model --rows 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import hybrid_llama  # noqa: F401  (registers the model type)
from hybrid_llama.models.io import load_model
from hybrid_llama.recall_rows import load_recall_rows, prepare_recall_rows

BINS = ((0, 2000), (2000, 4000), (4000, None))


@torch.no_grad()
def values_read_back(model, tokens: torch.Tensor, answers: torch.Tensor, manifest: dict) -> list[dict]:
    """One record per fact: its distance and whether every token of its value is the argmax."""
    out = []
    for r, row in enumerate(manifest["rows"]):
        pred = model(tokens[r : r + 1]).logits[0].argmax(-1)
        for fact in row["facts"]:
            at, end = fact["answer_at"], fact["answer_at"]
            while end < tokens.shape[1] and answers[r, end]:
                end += 1
            whole = bool((pred[at - 1 : end - 1] == tokens[r, at:end]).all())
            out.append({"distance": at - fact["fact_at"], "whole": whole})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hybrid", help="an exported hybrid model directory")
    ap.add_argument("--base", default="resources/weights/smollm2")
    ap.add_argument("--books", default="../shared/data/gutenberg")
    ap.add_argument("--heldout", default="pg174,pg1342")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--facts", type=int, default=8)
    ap.add_argument("--own-attributes", action="store_true", help="each fact its own attribute (default: one a row)")
    ap.add_argument("--subjects", default="names", choices=("names", "words"),
                    help="facts about people (default) or about things named by a word (lora.recall_subjects)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    path = Path(tempfile.mkdtemp()) / "rows.safetensors"
    manifest = prepare_recall_rows({"dir": args.books, "heldout": args.heldout.split(",")}, args.base, path,
                                   seq_len=args.seq_len, rows=args.rows, facts=args.facts,
                                   same_attribute=not args.own_attributes, subjects=args.subjects, seed=args.seed)
    tokens, answers = load_recall_rows(path)
    for name, model_dir in (("base", args.base), ("hybrid", args.hybrid)):
        model, _ = load_model(model_dir, dtype=args.dtype)
        facts = values_read_back(model, tokens, answers, manifest)
        for lo, hi in BINS:
            cell = [f for f in facts if f["distance"] >= lo and (hi is None or f["distance"] < hi)]
            print(json.dumps({"model": name, "distance": [lo, hi], "whole": sum(f["whole"] for f in cell),
                              "facts": len(cell)}), flush=True)
        del model


if __name__ == "__main__":
    main()
