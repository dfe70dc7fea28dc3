"""Perplexity vs context: token NLL on held-out text as a function of context length.

Every context length above `tail` scores the *same* target tokens (the windows end at the same stream
positions, only their start moves back), so the curve shows how much each model gains from longer
context and nothing else. The rows go to ``perplexity.csv`` (``hybrid_llama.eval.tables``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybrid_llama.eval.heldout import token_stream_spans
from hybrid_llama.eval.placement import eval_mode, max_positions, place_model


def window_ends(n_stream: int, longest: int, tail: int, max_windows: int | None,
                documents: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """End positions (exclusive) shared by all context lengths; scored tails never overlap.

    Candidates are longest, longest+tail, ... <= n_stream (with ``documents``, the same inside each
    ``(start, end)`` span, so a window never crosses from one document into the next); `max_windows`
    of them are taken evenly spread over the stream so a capped run still samples the whole held-out slice.
    """
    spans = documents if documents is not None else [(0, n_stream)]
    candidates = [e for a, b in spans for e in range(a + longest, min(b, n_stream) + 1, tail)]
    if not candidates:
        return []
    if max_windows is None or max_windows >= len(candidates):
        return candidates
    if max_windows <= 1:
        return candidates[:max_windows]
    step = (len(candidates) - 1) / (max_windows - 1)
    return [candidates[round(i * step)] for i in range(max_windows)]


def perplexity_windows(
    n_stream: int, context_lens: Sequence[int], *, tail: int = 64, max_windows: int | None = 32,
    max_len: int | None = None, documents: Sequence[tuple[int, int]] | None = None,
    anchor_len: int | None = None,
) -> dict[int, list[tuple[int, int]]]:
    """{L: [(start, end), ...]} stream slices of exactly L tokens scored by perplexity_vs_context.

    Lengths above `max_len` (the model's positions) or the stream (or, with ``documents``, the
    longest document) are dropped. All lengths share the end positions chosen for the longest one,
    so they score the same target tokens. ``anchor_len``: choose the ends for this length instead
    (capped like the others) when it is longer, so that runs over fewer lengths score the same
    targets as a run to ``anchor_len`` (the books' short-only variants against base's long run).
    """
    limit = min(max_len or n_stream, n_stream)
    if documents is not None:
        limit = min(limit, max((b - a for a, b in documents), default=0))
    lens = sorted({int(L) for L in context_lens if 2 <= int(L) <= limit})
    if not lens:
        return {}
    longest = max(lens[-1], min(int(anchor_len or 0), limit))
    ends = window_ends(n_stream, longest, tail, max_windows, documents)
    return {L: [(e - L, e) for e in ends] for L in lens}


@torch.no_grad()
def window_nll(model, windows: torch.Tensor, tail: int, start: int = 0) -> torch.Tensor:
    """Per-token NLL [B, tail] of the last `tail` tokens of each window [B, L] (fp32), the window's
    first token at position ``start``."""
    moved = {}
    if start:
        moved["position_ids"] = torch.arange(start, start + windows.shape[1], device=windows.device)[None]
    logits = model(input_ids=windows, logits_to_keep=tail + 1, **moved).logits[:, :-1].float()
    targets = windows[:, -tail:]
    logp = torch.log_softmax(logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def perplexity_vs_context(
    model,
    tokenizer,
    texts: list[str],
    *,
    context_lens: Sequence[int],
    tail: int = 64,
    device=None,
    dtype=None,
    stage: str,
    max_windows: int | None = 32,
    batch_size: int = 1,
    within_documents: bool = False,
    anchor_len: int | None = None,
) -> list[dict]:
    """Mean NLL over the last `tail` tokens of windows of exactly L tokens, for each L.

    The held-out `texts` are tokenized and joined with EOS (token_stream); windows come from
    perplexity_windows (at most `max_windows` per length, the same targets at every length).
    Lengths above the model's max_position_embeddings or the stream are skipped. At L <= tail only
    the last L-1 tokens can be scored (a window's first token has no context); n_tokens counts
    the scored tokens. The model is moved only if device/dtype are given. ``within_documents``: every
    window lies inside one of the texts (long documents such as books), never across two.
    ``anchor_len``: the windows' ends are chosen for this length (``perplexity_windows``).
    Rows: {stage, context_len, nll, ppl, n_tokens, window_nlls (each window's mean NLL)}.
    """
    dev = place_model(model, device, dtype)
    stream, spans = token_stream_spans(tokenizer, texts)
    windows = perplexity_windows(len(stream), context_lens, tail=tail, max_windows=max_windows,
                                 max_len=max_positions(model), documents=spans if within_documents else None,
                                 anchor_len=anchor_len)
    ids = torch.tensor(stream, dtype=torch.long)
    rows = []
    with eval_mode(model):
        for L, spans in windows.items():
            t = min(tail, L - 1)
            per_window: list[float] = []
            for i in range(0, len(spans), batch_size):
                batch = torch.stack([ids[a:b] for a, b in spans[i : i + batch_size]]).to(dev)
                per_window += window_nll(model, batch, t).double().mean(dim=1).tolist()
            mean = sum(per_window) / len(per_window)  # every window scores t tokens
            rows.append({"stage": stage, "context_len": L, "nll": mean, "ppl": math.exp(mean),
                         "n_tokens": t * len(per_window),
                         # windows are the independent units of a paired comparison (tables.paired_nll_difference)
                         "window_nlls": per_window})
    return rows
