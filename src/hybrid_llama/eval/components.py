"""Component diagnostic: how much of each hybrid layer's output comes from each of its memories.

A hybrid layer's output is ``share * (window average) + (1 - share) * (linear readout)``, where
``share`` is the window's part of the shared normalizer (``hybrid_llama.ops.hybrid.reference.window_share``).
A share near 0 beyond the window means the linear part drowns the window (the published recreation's
formulation does this: every older key adds about D to the denominator); a share near 1 means the
layer bypasses its linear part and acts as window-only attention. Either can hide behind a decent
perplexity, so the report shows the share per layer at a few context lengths. A layer with the sparse
cache has a third part, the exact keys beyond the window (sinks, cache, pending block): its
``cache_share`` (0 for the other layers, whose two shares are computed as before).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from hybrid_llama.eval.heldout import token_stream
from hybrid_llama.eval.perplexity import perplexity_windows
from hybrid_llama.eval.placement import eval_mode, max_positions


@torch.no_grad()
def window_shares(
    model,
    tokenizer,
    texts: list[str],
    *,
    context_lens: Sequence[int],
    tail: int = 64,
    max_windows: int | None = 2,
    stage: str,
) -> list[dict]:
    """Mean window share per hybrid layer over the last ``tail`` queries of held-out windows of each
    context length (the windows of ``perplexity_vs_context``). Rows: ``tables.COMPONENT_COLUMNS``."""
    from hybrid_llama.layers import HybridLlamaAttention
    from hybrid_llama.ops.hybrid.reference import window_share
    from hybrid_llama.ops.sparse.chunked import hybrid_attention_sparse

    layers = {m.layer_idx: m for m in model.modules() if isinstance(m, HybridLlamaAttention)}
    if not layers:
        return []
    dev = next(model.parameters()).device
    stream = torch.tensor(token_stream(tokenizer, texts), dtype=torch.long)
    windows = perplexity_windows(len(stream), context_lens, tail=tail, max_windows=max_windows,
                                 max_len=max_positions(model))
    sums: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    length = {"L": 0}

    def hook(layer: HybridLlamaAttention):
        def pre(_mod, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            q, k, v = layer.project(hidden, kwargs["position_embeddings"])
            T = q.shape[2]
            queries = torch.arange(max(0, T - tail), T, device=q.device)
            cfg = layer.hybrid
            wl, ll = layer.op_logits()
            if cfg.sparse.active:  # three parts: window, sinks + cache + pending, linear state
                _, _, shares = hybrid_attention_sparse(
                    q, k, v, wl, ll, window=cfg.window, feature_map=layer.op_feature_map(), return_shares=True,
                    cache=cfg.sparse, log_decay=layer.op_log_decay(),
                )
                window, cache = shares[:, :, queries, 0], shares[:, :, queries, 1]
            else:
                window = window_share(q, k, wl, ll, window=cfg.window, formulation=cfg.formulation,
                                      feature_map=layer.op_feature_map(), query_positions=queries,
                                      log_decay=layer.op_log_decay())
                cache = None
            acc = sums[layer.layer_idx, length["L"]]
            acc[0] += float(window.nansum())
            acc[1] += int(window.isfinite().sum())
            acc[2] += 0.0 if cache is None else float(cache.nansum())

        return pre

    handles = [m.register_forward_pre_hook(hook(m), with_kwargs=True) for m in layers.values()]
    try:
        with eval_mode(model):
            for L, spans in windows.items():
                length["L"] = L
                for a, b in spans:
                    model(input_ids=stream[a:b][None].to(dev), logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for (layer, L), (total, n, cached) in sorted(sums.items()):
        share = total / n if n else float("nan")
        cache = cached / n if n else float("nan")
        rows.append({"stage": stage, "layer": layer, "context_len": L, "window_share": share,
                     "linear_share": 1.0 - share - cache, "n_queries": n, "cache_share": cache})
    return rows
