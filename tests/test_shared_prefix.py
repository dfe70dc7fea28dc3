"""SharedPrefixLM (hybrid_llama.eval.shared_prefix): lm-eval loglikelihoods with shared prefixes run once.

The reference is lm-eval's own HFLM, which runs every request's whole input: the loglikelihoods and
greedy flags must be the same, request by request, on a softmax and on a hybrid model."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from hybrid_llama.eval.placement import cache_keyword
from hybrid_llama.eval.shared_prefix import MIN_SAVED, SharedPrefixLM, copy_cache, prefix_tree

MAX_LENGTH = 96


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


def _requests(seed: int = 0, preamble: int = 40, question: int = 18) -> list[tuple]:
    """Requests with shared prefixes at several levels, in a scrambled order:
    - a preamble shared by three questions, each question's context shared by its choices (multi-token
      continuations of different lengths), one question with one-token choices (identical inputs, as
      MMLU's), one with a sub-context (preamble, question, then a longer shared hint);
    - the same text split twice (one input, two scoring starts);
    - a request sharing nothing, one sharing fewer than 16 tokens, one longer than max_length."""
    rng = random.Random(seed)
    pre = _tokens(rng, preamble)
    reqs = []
    q1 = pre + _tokens(rng, question)
    reqs += [(q1, _tokens(rng, n)) for n in (3, 5, 1, 4)]
    q2 = pre + _tokens(rng, question)
    reqs += [(q2, [t]) for t in (7, 8, 9, 10)]  # one-token choices: one input
    q3 = pre + _tokens(rng, question)
    hint = q3 + _tokens(rng, 20)
    reqs += [(q3, _tokens(rng, 2)), (hint, _tokens(rng, 3)), (hint, _tokens(rng, 6)), (hint, [11])]
    split = q1 + [5, 6, 7, 8]
    reqs += [(split[:-2], split[-2:]), (split[:-3], split[-3:])]
    reqs += [(_tokens(rng, 25), _tokens(rng, 4))]  # alone
    other = _tokens(rng, 10)
    reqs += [(other + _tokens(rng, 10), [12, 13]), (other + _tokens(rng, 12), [14])]  # share 10 tokens only
    reqs += [(pre + _tokens(rng, MAX_LENGTH), _tokens(rng, 3))]  # truncated from the left
    order = list(range(len(reqs)))
    rng.shuffle(order)
    return [((f"ctx{i}", f"cont{i}"), reqs[i][0], reqs[i][1]) for i in order]


def _assert_same(ours, ref, tol):
    assert len(ours) == len(ref)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(ours, ref, strict=True):
        assert ll == pytest.approx(ll_ref, abs=tol) and greedy == greedy_ref


def _count_forwards(model):
    """Wrap ``model.forward``: the returned list collects each call's input shape."""
    seen = []
    forward = model.forward

    @functools.wraps(forward)
    def counting(*args, **kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        seen.append(tuple(ids.shape))
        return forward(*args, **kwargs)

    model.forward = counting
    return seen


class Hook:
    def __init__(self):
        self.calls = []

    def add_partial(self, kind, args, answer):
        self.calls.append((kind, args, answer))


def _score(lm_class, model, tok, requests, **kw):
    lm = lm_class(pretrained=model, tokenizer=tok, batch_size=3, max_length=MAX_LENGTH, **kw)
    lm.cache_hook = Hook()
    return lm._loglikelihood_tokens(requests), lm


def _hflm(model, tok, requests):
    """Plain HFLM's answers. Where two requests have one input but continuations of different lengths
    (one text split twice), lm-eval 0.4.13 groups them and gathers the shorter one's log-probs at the
    longer one's first positions, not its last; those requests are scored by HFLM one at a time."""
    from lm_eval.models.huggingface import HFLM

    inputs = [tuple(c + t)[:-1] for _, c, t in requests]
    alone = [i for i, r in enumerate(requests)
             if any(inputs[j] == inputs[i] and len(requests[j][2]) != len(r[2]) for j in range(len(requests)))]
    answers, _ = _score(HFLM, model, tok, requests)
    for i in alone:
        answers[i] = _score(HFLM, model, tok, [requests[i]])[0][0]
    return answers


def test_prefix_tree_groups_at_every_shared_level():
    from hybrid_llama.eval.shared_prefix import Row

    rng = random.Random(1)
    pre, q1, q2, hint = _tokens(rng, 20), _tokens(rng, 20), _tokens(rng, 20), _tokens(rng, 30)
    rows = [Row(tuple(pre + q1 + [1, 2]), 39), Row(tuple(pre + q1 + [3, 4]), 39),
            Row(tuple(pre + q2 + hint + [5]), 70), Row(tuple(pre + q2 + hint + [6]), 70),
            Row(tuple(pre + q2 + [7]), 40), Row(tuple(_tokens(rng, 30)), 20), Row(tuple(pre[:10] + q1), 25)]
    nodes, single = prefix_tree(rows, min_shared=16, min_saved=0)
    assert [r.tokens for r in single] == sorted([rows[5].tokens, rows[6].tokens])
    (root,) = nodes
    assert root.tokens == tuple(pre) and root.rows == [] and root.size() == 5
    a, b = sorted(root.children, key=lambda n: n.tokens)
    # q1's rows can share up to their first scored position (39), q2's hint rows up to 70 below q2's node
    assert {a.tokens, b.tokens} == {tuple(pre + q1[:19]), tuple(pre + q2)}
    q1_node, q2_node = (a, b) if a.tokens == tuple(pre + q1[:19]) else (b, a)
    assert len(q1_node.rows) == 2 and q1_node.children == []
    assert [r.tokens for r in q2_node.rows] == [rows[4].tokens]
    (hint_node,) = q2_node.children
    assert hint_node.tokens == tuple(pre + q2 + hint) and len(hint_node.rows) == 2
    # nodes that save fewer tokens than min_saved dissolve: q1's (1 x 19 tokens) and q2's (2 x 20) into
    # the preamble's node; the hint's saves 1 x 30 below q2's, 1 x 50 below the preamble's
    nodes, single = prefix_tree(rows, min_shared=16, min_saved=35)
    ((root,), (q2_node,)) = nodes, nodes[0].children
    assert len(single) == 2 and len(root.rows) == 2 and q2_node.children == [] and len(q2_node.rows) == 3
    nodes, single = prefix_tree(rows, min_shared=16, min_saved=45)
    ((root,), (hint_node,)) = nodes, nodes[0].children
    assert len(single) == 2 and len(root.rows) == 3 and hint_node.tokens == tuple(pre + q2 + hint)
    nodes, single = prefix_tree(rows, min_shared=16, min_saved=51)  # the hint's node goes too
    assert len(single) == 2 and nodes[0].children == [] and len(nodes[0].rows) == 5
    nodes, single = prefix_tree(rows, min_shared=16, min_saved=81)  # and the preamble's (4 x 20)
    assert nodes == [] and len(single) == 7


@pytest.mark.parametrize("min_saved", [0, MIN_SAVED])  # every node (three levels) / the default's two
def test_scores_equal_hflm_and_each_prefix_runs_once(tiny_model, min_saved):
    model, tok = tiny_model
    requests = _requests()
    ref = _hflm(model, tok, requests)
    seen = _count_forwards(model)
    ours, lm = _score(SharedPrefixLM, model, tok, requests, min_saved=min_saved)
    _assert_same(ours, ref, 1e-4)
    # the cache hook hears every request once, with its own answer
    assert sorted(c[1] for c in lm.cache_hook.calls) == sorted(r[0] for r in requests)
    assert all(c[2] == ours[[r[0] for r in requests].index(c[1])] for c in lm.cache_hook.calls)
    # shared: the three questions (12 requests) and the split text (2); the rest went to HFLM
    assert lm.stats["shared_requests"] == 14 and lm.stats["plain_requests"] == 4
    # the preamble ran once (the only batch-1 forward of 40 tokens or more), and far fewer tokens ran
    # than the requests' inputs hold
    assert [s for s in seen if s[0] == 1 and s[1] >= 40] == [(1, 40)]
    inputs = sum(min(len(c) + len(t) - 1, MAX_LENGTH) for _, c, t in requests)
    assert sum(a * b for a, b in seen) < 0.6 * inputs


def test_tokens_forwarded_are_each_prefix_once(tiny_model):
    """Three 25-token questions after one 32-token preamble, four 3-token choices each: the preamble
    runs once, each question's tokens once, and each choice only from its question's last token on."""
    model, tok = tiny_model
    rng = random.Random(2)
    pre = _tokens(rng, 32)
    requests = [(("", ""), pre + q, _tokens(rng, 3)) for q in (_tokens(rng, 25) for _ in range(3)) for _ in range(4)]
    seen = _count_forwards(model)
    lm = SharedPrefixLM(pretrained=model, tokenizer=tok, batch_size=4)
    lm._loglikelihood_tokens(requests)
    # inputs are 59 tokens (57 context + 2 of the continuation), scored from position 56
    assert sorted(seen) == sorted([(1, 32)] + [(1, 24)] * 3 + [(4, 3)] * 3)
    assert sum(a * b for a, b in seen) == 32 + 3 * 24 + 3 * 4 * 3 < 12 * 59 / 5


def test_cache_copies_are_independent(lively_dir):
    """A copy of a prefix cache (hybrid layers with the sparse cache and exact heads, softmax layers)
    runs as the prefix's own cache would, and leaves the original unchanged."""
    from test_exact_heads import hybrid
    from transformers import DynamicCache

    model, _ = hybrid(lively_dir, sparse_cache=4, sinks=2)
    ids = torch.randint(3, 200, (1, 23), generator=torch.Generator().manual_seed(3))
    more = torch.randint(3, 200, (3, 6), generator=torch.Generator().manual_seed(4))
    kw = cache_keyword(model)
    with torch.no_grad():
        full = model(torch.cat([ids.expand(3, -1), more], 1), use_cache=False).logits[:, -6:]
        cache = DynamicCache()
        model(ids, use_cache=True, **{kw: cache})
        first = model(more, use_cache=True, **{kw: copy_cache(cache, 3)}).logits
        again = model(more, use_cache=True, **{kw: copy_cache(cache, 3)}).logits
        single = model(more[1:2], use_cache=True, **{kw: copy_cache(cache)}).logits
    torch.testing.assert_close(first, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    torch.testing.assert_close(single, first[1:2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decay,min_saved", [(None, 0), (0.95, 0), (None, MIN_SAVED)])
def test_hybrid_scores_equal_hflm(lively_dir, decay, min_saved):
    """A hybrid model (window 4, the sparse cache with sinks, exact heads): prefixes and suffixes
    cross the window and close sparse blocks; with min_saved 0 every shared prefix is a node (a
    question's context below the preamble, 17 tokens), so caches are continued and copied twice."""
    from test_exact_heads import hybrid

    model, tok = hybrid(lively_dir, sparse_cache=4, sinks=2, decay=decay)
    requests = _requests(seed=5, preamble=20, question=17)[:12]
    ref = _hflm(model, tok, requests)
    ours, lm = _score(SharedPrefixLM, model, tok, requests, min_saved=min_saved)
    _assert_same(ours, ref, 1e-4)
    assert lm.stats["shared_requests"] >= 6


def test_run_suite_with_shared_prefixes_scores_as_without(tiny_model, shared_data_dir):
    from hybrid_llama.eval.zeroshot import run_suite
    from hybrid_llama.tasks import LOCAL_FILES

    tasks = ["arc_easy", "hellaswag", "mmlu"]
    if not all((shared_data_dir / rel).exists() for t in tasks for rel in LOCAL_FILES[t]):
        pytest.skip(f"no offline copy of {tasks} under {shared_data_dir}")
    model, tok = tiny_model
    limit = {"arc_easy": 4, "hellaswag": 3, "mmlu": 6}
    kw = dict(tasks=tasks, limit=limit, seed=1, source="local", shared_data=str(shared_data_dir), batch_size=3)
    seen = _count_forwards(model)
    shared = run_suite(model, tok, share_prefixes=True, **kw)
    shared_tokens = sum(a * b for a, b in seen)
    seen.clear()
    plain = run_suite(model, tok, share_prefixes=False, **kw)
    plain_tokens = sum(a * b for a, b in seen)
    assert shared["share_prefixes"] is True and plain["share_prefixes"] is False
    assert len(shared["examples"]) == len(plain["examples"]) == 13
    for a, b in zip(shared["examples"], plain["examples"], strict=True):
        assert (a["task"], a["doc_id"]) == (b["task"], b["doc_id"])
        assert a["loglikelihoods"] == pytest.approx(b["loglikelihoods"], rel=1e-6, abs=1e-4)  # sums of ~100 tokens
    assert shared_tokens < 0.8 * plain_tokens
