"""Retrieval heads: the KV heads a softmax model reads a needle with, ranked on passkey prompts.

While a model copies a passkey back, a few of its heads put most of their attention on the key's
tokens (the retrieval heads of Wu et al., 2024). This ranks the KV heads of chosen layers by that
mass on the base model, so a hybrid can keep the best ones exact (``hybrid.softmax_heads``,
``layers.exact_heads``). The prompts use a seed the passkey evaluation does not use.

    python -m hybrid_llama.eval.retrieval_heads MODEL --layers 0,2,...,28 --top 1
prints the ranking and the ``softmax_heads`` pairs of the top ones. In the workflow, a variant with
``softmax_heads: {top: N}`` gets the first N of its hybrid layers from ``rank_model``'s file
(the retrieval_heads rule), through ``ranked_softmax_heads``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hybrid_llama.eval.passkey import needle_trials

SCORING_SEED = 101  # not the evaluation's seed 0: the ranking never sees the evaluated prompts


def needle_mass(q: Tensor, k: Tensor, rows: Sequence[int], needle: Sequence[int], scaling: float) -> Tensor:
    """Per query head, the mean over ``rows`` of the softmax attention (causal) on ``needle``'s
    positions: q ``[1, H, T, D]``, k ``[1, H_kv, T, D]`` after RoPE."""
    group = q.shape[1] // k.shape[1]
    rows_t = torch.tensor(list(rows))
    scores = (q[:, :, rows_t].float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)) * scaling
    future = torch.arange(k.shape[2])[None, :] > rows_t[:, None]
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return weights[0, :, :, list(needle)].sum(-1).mean(-1)


@torch.no_grad()
def rank_retrieval_heads(model, tokenizer, layers: Sequence[int], *, context_len: int = 2048,
                         trials: int = 6) -> list[tuple[int, int, float]]:
    """``(layer, kv_head, mass)`` for the KV heads of ``layers``, best first: the attention mass on the
    needle, summed over each KV head's query heads, averaged over ``trials`` passkey prompts and the
    positions that read the key back (the last prompt token and the key's tokens but its last)."""
    from hybrid_llama.layers.softmax_attention import rotary_qkv

    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    total: dict[tuple[int, int], float] = {}
    trial: dict = {}

    def score(attn, args, kwargs) -> None:
        # Reads the layer's input before it runs; the layer itself runs unchanged.
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        q, k, _ = rotary_qkv(attn, hidden, kwargs["position_embeddings"])
        mass = needle_mass(q, k, trial["rows"], trial["needle"], attn.scaling)
        for h in range(cfg.num_key_value_heads):
            key = (attn.layer_idx, h)
            total[key] = total.get(key, 0.0) + float(mass[h * group:(h + 1) * group].sum())

    cells = needle_trials(tokenizer, context_len=context_len, trials=trials, seed=SCORING_SEED)
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(score, with_kwargs=True) for i in layers]
    try:
        for i, t in enumerate(cells):
            logging.info("retrieval heads: passkey prompt %d of %d (%d tokens)", i + 1, len(cells), context_len)
            ids = t["prompt"] + t["answer"][:-1]
            trial.update(rows=range(len(t["prompt"]) - 1, len(ids)), needle=t["needle"])
            model(input_ids=torch.tensor([ids], device=model.device), use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    ranked = sorted(total, key=total.get, reverse=True)
    return [(layer, head, total[(layer, head)] / len(cells)) for layer, head in ranked]


def rank_model(model_dir: str | os.PathLike, *, context_len: int = 2048, trials: int = 6) -> dict[str, Any]:
    """The retrieval_heads rule's file: every KV head of every layer of the (base) model in
    ``model_dir``, best first, ranked in float32. Ranking each head on its own, a variant's hybrid
    layers take their order from it (``ranked_softmax_heads``)."""
    from hybrid_llama.stages import load_base

    model, tokenizer = load_base(model_dir, dtype=torch.float32)
    ranked = rank_retrieval_heads(model, tokenizer, range(model.config.num_hidden_layers),
                                  context_len=context_len, trials=trials)
    return {"context_len": context_len, "trials": trials, "seed": SCORING_SEED,
            "heads": [{"layer": layer, "kv_head": head, "needle_mass": round(mass, 6)} for layer, head, mass in ranked]}


def ranked_softmax_heads(hybrid: Mapping[str, Any],
                         ranking: str | os.PathLike | Mapping[str, Any] | None) -> dict[str, Any]:
    """``hybrid`` with ``softmax_heads: {top: N}`` replaced by the first N KV heads of ``ranking`` (the
    retrieval_heads file, or its content) that lie in the hybrid layers, as sorted [layer, kv_head]
    pairs; a hybrid block that names its heads, or none, comes back unchanged."""
    out = dict(hybrid)
    spec = out.get("softmax_heads")
    if not isinstance(spec, Mapping):
        return out
    if ranking is None:
        raise ValueError(f"softmax_heads: {dict(spec)} needs the model's retrieval_heads ranking")
    if not isinstance(ranking, Mapping):
        ranking = json.loads(Path(ranking).read_text())
    layers = set(out["layers"])
    eligible = [[h["layer"], h["kv_head"]] for h in ranking["heads"] if h["layer"] in layers]
    top = int(spec["top"])
    if top > len(eligible):
        raise ValueError(f"softmax_heads: top {top} asks for more KV heads than the ranking holds in the "
                         f"hybrid layers {sorted(layers)} ({len(eligible)})")
    out["softmax_heads"] = sorted(eligible[:top])
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description="Rank a Llama's KV heads by the attention they put on a passkey.")
    ap.add_argument("model", help="a Llama directory or Hugging Face id (the base model)")
    ap.add_argument("--layers", required=True, help="comma-separated layer indices (the hybrid layers)")
    ap.add_argument("--top", type=int, default=1, help="how many heads to print as softmax_heads")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=6)
    args = ap.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    ranked = rank_retrieval_heads(model, tokenizer, layers, context_len=args.context_len, trials=args.trials)
    for layer, head, mass in ranked[:12]:
        print(f"layer {layer:3d}  KV head {head:2d}  needle mass {mass:.3f}")
    print(json.dumps({"softmax_heads": [[layer, head] for layer, head, _ in ranked[: args.top]]}))


if __name__ == "__main__":
    main()
