"""lm-eval loglikelihood requests scored with their shared token prefixes computed once.

Many requests of the zero-shot suite begin with the same tokens: an MMLU subject's 5-shot questions
all start with the same five-shot preamble (lm-eval samples the shots ``first_n``), and the choices
of PIQA, ARC and HellaSwag share their question's context. HFLM runs every request's whole input
through the model. ``SharedPrefixLM`` builds the same model inputs HFLM does
(``(context + continuation)[-(max_length + 1):][:-1]``, the continuation scored at its last
positions), groups them by shared prefixes, runs each prefix once with a cache and scores the
remaining suffixes from batch-expanded copies of that cache.

Grouping. Requests with the same model input become one row (scored once; each request reads its own
continuation from the end, as HFLM's one-token-continuation grouping does). The rows are sorted
lexicographically; the prefix two rows may share is their longest common prefix, capped at each
row's first scored position (the suffix must hold the token whose logits predict the continuation's
first token, so a prefix ends at or before it). In a sorted list the common prefix of a run of rows
is the minimum over its adjacent pairs, so a prefix tree follows from the adjacent pairs alone: at
depth ``d`` the rows split into maximal runs whose adjacent pairs share at least ``d + min_shared``
tokens; each run of two or more rows becomes a node at the run's common prefix, split again the same
way below it. MMLU thus gets the subject's preamble as one node, with each question's row below it
(its four choices being one row); a deeper node would form wherever questions share more.

Scoring. A node's own tokens (past its parent's prefix) run once, batch 1, from a copy of the
parent's cache (a fresh ``DynamicCache`` at the root). Its rows' suffixes then run in right-padded
batches from a copy of the node's cache expanded to the batch (``batch_repeat_interleave``); no
attention mask is needed since the model is causal and padding only follows real tokens. A forward
mutates the cache it is given, so every forward gets its own copy (``copy_cache``), but for a node's
last batch, which expands the node's own cache in place. Rows that share no prefix with
another (at the root) and requests truncated by ``max_length`` go through ``TailLogitsLM`` unchanged.

Where sharing pays. A node costs a forward of its own, and its rows' batches are cut at its edges. A
node is kept only where it saves enough tokens (``MIN_SAVED``: (its rows - 1) x its own tokens);
otherwise its rows are scored from the prefix above it (at the root: by ``TailLogitsLM``, batched
with the others) and its children are judged against that prefix. PIQA's two choices sharing a short
question thus go through ``TailLogitsLM``, while an MMLU preamble always pays.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybrid_llama.eval.placement import cache_keyword
from hybrid_llama.eval.tail_logits import PAD, TailLogitsLM

MIN_SHARED = 16  # a node must share at least this many tokens beyond its parent's prefix
# ... and save at least this many tokens of forward: (rows below it - 1) x its own tokens. A forward
# costs about as much as 35 more tokens whatever its size (SmolLM2 base, bf16, one thread: 50 ms for
# one token, +1.4 ms a token), and a node adds one forward and may split a batch.
MIN_SAVED = 64
DEFAULT_BATCH = 8  # suffixes per forward when lm-eval's batch size is 'auto'


@dataclass
class Row:
    """One model input, scored once for every request whose input it is."""

    tokens: tuple[int, ...]
    start: int  # first scored position: the logits there predict the first continuation token
    requests: list[int] = field(default_factory=list)


@dataclass
class Node:
    """Rows sharing ``tokens`` (their first ``len(tokens)`` inputs), with deeper shared prefixes as children."""

    tokens: tuple[int, ...]
    children: list[Node]
    rows: list[Row]  # scored from this node's cache

    def size(self) -> int:
        return len(self.rows) + sum(c.size() for c in self.children)


def _common(a: Row, b: Row) -> int:
    """How many leading tokens rows ``a`` and ``b`` can share: their common prefix, at most either's start."""
    limit = min(a.start, b.start)
    n = 0
    while n < limit and a.tokens[n] == b.tokens[n]:
        n += 1
    return n


def split(rows: list[Row], common: list[int], depth: int, min_shared: int) -> tuple[list[Node], list[Row]]:
    """(nodes, rows left at this level) of sorted ``rows`` that share ``depth`` tokens; ``common[k]``
    is what rows k and k + 1 can share. A node takes a maximal run of rows whose neighbours share at
    least ``depth + min_shared`` tokens."""
    nodes: list[Node] = []
    single: list[Row] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) - 1 and common[j] >= depth + min_shared:
            j += 1
        if j == i:
            single.append(rows[i])
        else:
            inner = common[i:j]
            shared = min(inner)
            children, own = split(rows[i:j + 1], inner, shared, min_shared)
            nodes.append(Node(rows[i].tokens[:shared], children, own))
        i = j + 1
    return nodes, single


def prune(nodes: list[Node], depth: int, min_saved: int) -> tuple[list[Node], list[Row]]:
    """(nodes kept, rows set loose) of ``nodes`` below a prefix of ``depth`` tokens: a node stays where
    it saves ``min_saved`` tokens or more ((its rows - 1) x its tokens past ``depth``); one that does
    not is dissolved, its rows scored from the prefix above and its children judged against it."""
    kept: list[Node] = []
    loose: list[Row] = []
    for node in nodes:
        if (node.size() - 1) * (len(node.tokens) - depth) >= min_saved:
            node.children, rows = prune(node.children, len(node.tokens), min_saved)
            node.rows += rows
            kept.append(node)
        else:
            children, rows = prune(node.children, depth, min_saved)
            kept += children
            loose += node.rows + rows
    return kept, loose


def prefix_tree(rows: list[Row], min_shared: int = MIN_SHARED,
                min_saved: int = MIN_SAVED) -> tuple[list[Node], list[Row]]:
    """The shared-prefix nodes of ``rows`` and the rows that share with none (``split`` at depth 0, then
    ``prune``)."""
    rows = sorted(rows, key=lambda r: r.tokens)
    common = [_common(a, b) for a, b in zip(rows, rows[1:])]
    nodes, single = split(rows, common, 0, min_shared)
    nodes, loose = prune(nodes, 0, min_saved)
    return nodes, single + loose


def _materialize(cache) -> None:
    """Build any deferred hybrid prompt state (``HybridCacheLayer.state`` does it when read), so that a
    copy of the cache copies tensors only."""
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "defer_state"):
            _ = layer.state


def copy_cache(cache, batch: int = 1):
    """An independent copy of ``cache``, its batch of one repeated ``batch`` times."""
    _materialize(cache)
    out = copy.deepcopy(cache)
    if batch != 1:
        out.batch_repeat_interleave(batch)
    return out


class SharedPrefixLM(TailLogitsLM):
    """TailLogitsLM that runs the token prefixes requests share once per group (see the module doc)."""

    def __init__(self, *args, min_shared: int = MIN_SHARED, min_saved: int = MIN_SAVED, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_shared, self.min_saved = min_shared, min_saved
        self._cache_kw = cache_keyword(self.model)
        # tokens through the model: prefixes, suffixes (padding included) and what went to the parent
        self.stats = {"prefix_tokens": 0, "suffix_tokens": 0, "shared_requests": 0, "plain_requests": 0}

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        rows: dict[tuple[int, ...], Row] = {}
        plain: list[int] = []
        for i, (_, context, continuation) in enumerate(requests):
            if len(context) + len(continuation) > self.max_length + 1:  # truncated: as HFLM does it
                plain.append(i)
                continue
            inp = tuple(context + continuation)[:-1]
            start = len(inp) - len(continuation)
            row = rows.setdefault(inp, Row(inp, start))
            row.start = min(row.start, start)
            row.requests.append(i)
        nodes, single = prefix_tree(list(rows.values()), self.min_shared, self.min_saved)
        plain += [i for row in single for i in row.requests]
        plain.sort()

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        shared = len(requests) - len(plain)
        self.stats["shared_requests"] += shared
        self.stats["plain_requests"] += len(plain)
        if override_bs:
            batch = int(override_bs)
        else:
            batch = self.batch_size if isinstance(self.batch_size, int) else DEFAULT_BATCH
        pbar = tqdm(total=shared, disable=disable_tqdm or self.rank != 0,
                    desc="Running loglikelihood requests (shared prefixes)")
        dtype = self.mixed_precision_dtype
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None):
            for node in nodes:
                self._score_node(node, None, 0, requests, results, batch, pbar)
        pbar.close()

        if plain:
            for i, answer in zip(plain, super()._loglikelihood_tokens(
                    [requests[i] for i in plain], disable_tqdm=disable_tqdm, override_bs=override_bs), strict=True):
                results[i] = answer
        return results

    def _forward(self, tokens: torch.Tensor, cache, keep: int) -> torch.Tensor:
        return self.model(tokens, use_cache=True, logits_to_keep=keep, **{self._cache_kw: cache}).logits

    def _score_node(self, node: Node, parent_cache, parent_depth: int, requests, results, batch: int, pbar) -> None:
        """Run ``node``'s tokens past ``parent_depth`` from a copy of ``parent_cache`` (None: a fresh cache),
        then its children and its rows from the cache this leaves."""
        if parent_cache is None:
            from transformers import DynamicCache

            cache = DynamicCache()
        else:
            cache = copy_cache(parent_cache)
        own = torch.tensor([node.tokens[parent_depth:]], dtype=torch.long, device=self.device)
        self._forward(own, cache, 1)
        self.stats["prefix_tokens"] += own.numel()
        depth = len(node.tokens)
        for child in node.children:
            self._score_node(child, cache, depth, requests, results, batch, pbar)
        rows = sorted(node.rows, key=lambda r: -len(r.tokens))
        for b in range(0, len(rows), batch):
            last = b + batch >= len(rows)  # the cache's last use: expanded in place, not copied
            self._score_rows(rows[b:b + batch], cache, depth, requests, results, pbar, own=last)

    def _score_rows(self, rows: list[Row], cache, depth: int, requests, results, pbar, own: bool = False) -> None:
        """Score ``rows`` (which share their first ``depth`` tokens, held by ``cache``) in one forward,
        from a copy of ``cache`` or, ``own``, from ``cache`` itself."""
        width = max(len(r.tokens) for r in rows) - depth
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        for k, row in enumerate(rows):
            ids[k, :len(row.tokens) - depth] = torch.tensor(row.tokens[depth:], dtype=torch.long)
        keep = width - min(r.start for r in rows) + depth
        if own:
            if len(rows) > 1:
                cache.batch_repeat_interleave(len(rows))
        else:
            cache = copy_cache(cache, len(rows))
        logits = self._forward(ids.to(self.device), cache, keep)
        self.stats["suffix_tokens"] += ids.numel()
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)
        first = width - keep  # the suffix position of logits[:, 0]
        for k, row in enumerate(rows):
            end = len(row.tokens) - depth - first
            for i in row.requests:
                request_args, _, continuation = requests[i]
                cont = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
                scored = logprobs[k, end - len(continuation):end]
                greedy = bool((scored.argmax(dim=-1) == cont).all())
                answer = (float(scored.gather(1, cont[:, None]).sum()), greedy)
                results[i] = answer
                if request_args is not None:
                    self.cache_hook.add_partial("loglikelihood", request_args, answer)
                pbar.update(1)
