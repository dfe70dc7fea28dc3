"""Greedy decoding with the model's cache, one call per phase: what the throughput measurement times
(``prefill``, ``decode_step``) and the reference it is checked against (``greedy_decode`` without
the cache recomputes the whole sequence at every step)."""

from __future__ import annotations

import torch

from hybrid_llama.eval.placement import cache_keyword, output_cache


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor):
    """Cache-building forward that keeps only the last position's logits: (next token [B, 1], cache)."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1), output_cache(out)


@torch.inference_mode()
def decode_step(model, token: torch.Tensor, cache):
    """One greedy step from ``cache``, feeding ``token`` [B, 1]: (next token [B, 1], cache)."""
    out = model(input_ids=token, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1), output_cache(out)


def decode_steps(model, token: torch.Tensor, cache, n: int) -> torch.Tensor:
    """``n`` greedy steps from ``cache``, feeding ``token`` first; returns the n fed tokens [B, n]."""
    fed = []
    for _ in range(n):
        fed.append(token)
        token, cache = decode_step(model, token, cache)
    return torch.cat(fed, dim=1)


@torch.inference_mode()
def greedy_decode(model, input_ids: torch.Tensor, n: int, *, use_cache: bool = True) -> torch.Tensor:
    """``n`` greedily generated tokens [B, n]: with the cache (the benchmarked path) or by
    recomputing the whole sequence at every step (no cache), for checking one against the other."""
    if use_cache:
        token, cache = prefill(model, input_ids)
        return decode_steps(model, token, cache, n)
    seq = input_ids
    for _ in range(n):
        logits = model(input_ids=seq, use_cache=False).logits
        seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
    return seq[:, input_ids.shape[1] :]
