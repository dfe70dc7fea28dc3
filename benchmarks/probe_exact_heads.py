"""Probe: passkey past 2K with the top-ranked KV heads kept exact, for several head counts.

Evaluation only, on an exported hybrid: the KV heads of its hybrid layers are ranked on the base
model (``hybrid_llama.eval.retrieval_heads``), and for each ``--keep`` count the best ones are kept
as exact softmax (``hybrid.softmax_heads``, set on the loaded layers), then passkey is scored as the
pipeline scores it (teacher-forced, the evaluation's seed). ``--keep 0`` is the model as trained.

    python benchmarks/probe_exact_heads.py resources/weights/smollm2 \
        results/smollm2/lolcats_sparse_distill/model --keep 0,1,2,3,6 --passkey 4096,8192
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybrid_llama  # noqa: F401  (registers the model type)
from hybrid_llama.eval.passkey import passkey_accuracy
from hybrid_llama.eval.retrieval_heads import rank_retrieval_heads
from hybrid_llama.layers import HybridLlamaAttention
from hybrid_llama.layers.exact_heads import ExactHeads


def keep_exact(model, pairs: list[tuple[int, int]]) -> None:
    """Set the hybrid layers' exact heads to ``pairs`` (none elsewhere)."""
    cfg = model.config
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        if isinstance(attn, HybridLlamaAttention):
            heads = [h for layer, h in pairs if layer == i]
            group = cfg.num_attention_heads // cfg.num_key_value_heads
            attn.exact = ExactHeads(heads, cfg.num_key_value_heads, group, attn.scaling) if heads else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("hybrid")
    ap.add_argument("--keep", default="0,1,2")
    ap.add_argument("--passkey", default="4096")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", help="as the default run's evaluations on a bf16-native CPU")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.hybrid)
    model = AutoModelForCausalLM.from_pretrained(args.hybrid, dtype=dtype).eval()
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=dtype).eval()
    ranked = rank_retrieval_heads(base, tok, model.config.hybrid["layers"])
    del base
    print(json.dumps({"ranked": [[layer, h, round(m, 4)] for layer, h, m in ranked[:12]]}), flush=True)
    for n in (int(x) for x in args.keep.split(",")):
        pairs = [(layer, h) for layer, h, _ in ranked[:n]]
        keep_exact(model, pairs)
        rows = passkey_accuracy(model, tok, context_lens=[int(x) for x in args.passkey.split(",")],
                                trials=args.trials, stage=f"keep{n}", dtype=dtype)
        for L in sorted({r["context_len"] for r in rows}):
            hits = [int(r["accuracy"]) for r in rows if r["context_len"] == L]
            print(json.dumps({"keep": n, "heads": pairs, "len": L, "hits": sum(hits), "trials": hits}), flush=True)


if __name__ == "__main__":
    main()
