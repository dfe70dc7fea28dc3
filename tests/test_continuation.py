"""Several tokens continuing a decode state at once (``hybrid_attention_continue``): its outputs equal
the O(T^2) reference over the whole sequence, its final state what the token-by-token steps leave,
and a model's cache continued by a whole suffix scores it as the uncached forward does."""

from __future__ import annotations

import pytest
import torch
from op_inputs import trained_maps

from hybrid_llama.ops import (
    SparseCacheConfig,
    continues_at_once,
    hybrid_attention,
    hybrid_attention_continue,
    hybrid_attention_step,
    init_sparse_state,
    init_state,
)
from hybrid_llama.ops.hybrid import continuation as plain_continuation
from hybrid_llama.ops.sparse.continuation import closes_block

ATOL, RTOL = 2e-5, 1e-4


def make(B=2, H=4, Hk=2, T=70, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    return q, k, v, torch.randn(H, generator=g), torch.randn(H, generator=g)


def steps(q, k, v, wl, ll, state, **kw):
    outs = []
    for t in range(q.shape[2]):
        o, state = hybrid_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, wl, ll, **kw)
        outs.append(o)
    return torch.cat(outs, 2), state


def assert_same_state(got, want):
    assert got.seen == want.seen
    assert torch.equal(got.window_valid, want.window_valid)
    ok = want.window_valid[:, None, :, None]
    torch.testing.assert_close(got.k_window * ok, want.k_window * ok)
    torch.testing.assert_close(got.v_window * ok, want.v_window * ok)
    torch.testing.assert_close(got.S, want.S, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.z, want.z, atol=1e-4, rtol=1e-4)
    if want.sparse is not None:
        g, s = got.sparse, want.sparse
        assert torch.equal(g.cache_pos, s.cache_pos) and torch.equal(g.cache_valid, s.cache_valid)
        assert torch.equal(g.pend_valid, s.pend_valid) and torch.equal(g.sink_valid, s.sink_valid)
        for a, b, valid in ((g.cache_k, s.cache_k, s.cache_valid), (g.pend_k, s.pend_k, s.pend_valid[:, None]),
                            (g.sink_k, s.sink_k, s.sink_valid[:, None])):
            torch.testing.assert_close(a * valid[..., None], b * valid[..., None])


def feature_map(kind: str):
    return trained_maps(4, 2, 8) if kind == "hedgehog" else "elu1"


# (prompt length, continuation length, window): prompts inside and past the window, continuations
# shorter than it, crossing several windows, and longer than one slab (set small below).
PLAIN_CASES = [(1, 5, 4), (3, 9, 4), (10, 3, 4), (13, 29, 4), (37, 40, 8), (0 + 6, 70, 8)]


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("T0,L,w", PLAIN_CASES)
def test_plain_continuation_equals_reference_and_steps(formulation, fmap, decay, T0, L, w, monkeypatch):
    monkeypatch.setattr(plain_continuation, "SLAB", 16)  # several slabs in the longer cases
    q, k, v, wl, ll = make(T=T0 + L)
    fm = feature_map(fmap)
    log_decay = torch.log(torch.tensor([0.9, 0.7])) if decay and formulation != "window" else None
    kw = dict(formulation=formulation, feature_map=fm, log_decay=log_decay)
    with torch.no_grad():
        want = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)[0]
        _, pre = hybrid_attention(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], wl, ll, window=w, backend="chunked",
                                  output_final_state=True, **kw)
        assert continues_at_once(None, pre)
        got, state = hybrid_attention_continue(q[:, :, T0:], k[:, :, T0:], v[:, :, T0:], pre, wl, ll, **kw)
        stepped_out, stepped = steps(q[:, :, T0:], k[:, :, T0:], v[:, :, T0:], wl, ll, pre, **kw)
    torch.testing.assert_close(got, want[:, :, T0:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, stepped_out, atol=ATOL, rtol=RTOL)
    assert_same_state(state, stepped)
    assert pre.seen == T0  # the given state is left as it was


def test_continuation_from_an_empty_state_is_the_prompt():
    q, k, v, wl, ll = make(T=30)
    with torch.no_grad():
        want = hybrid_attention(q, k, v, wl, ll, window=4, backend="reference", formulation="lolcats")[0]
        got, state = hybrid_attention_continue(q, k, v, init_state(2, 2, 8, 4), wl, ll, formulation="lolcats")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert state.seen == 30


# (prompt length, continuation length, window, cache size, sinks): continuations that start before,
# on and after a block's close, cross several closes, and begin from a prompt inside the window.
SPARSE_CASES = [(3, 40, 4, 4, 2), (9, 7, 4, 4, 0), (13, 1, 4, 8, 1), (18, 33, 4, 4, 2), (30, 45, 8, 8, 4),
                (41, 29, 8, 16, 0)]


@pytest.mark.parametrize("T0,L,w,size,sinks", SPARSE_CASES)
@pytest.mark.parametrize("score", ["sre", "random"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("decay", [False, True])
def test_sparse_continuation_equals_parallel_op_and_steps(T0, L, w, size, sinks, score, fmap, decay):
    q, k, v, wl, ll = make(T=T0 + L)
    cache = SparseCacheConfig(size, sinks, score)
    log_decay = torch.log(torch.tensor([0.95, 0.8])) if decay else None
    kw = dict(formulation="lolcats", feature_map=feature_map(fmap), sparse=cache, log_decay=log_decay)
    with torch.no_grad():
        want = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)[0]
        _, pre = hybrid_attention(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], wl, ll, window=w,
                                  output_final_state=True, **kw)
        if pre.sparse is None:  # a prompt that folds nothing may come back without the sparse part
            pre = steps(q[:, :, :T0], k[:, :, :T0], v[:, :, :T0], wl, ll,
                        init_sparse_state(2, 2, 8, w, cache, feature_dim=16 if fmap == "hedgehog" else 8), **kw)[1]
        assert continues_at_once(cache, pre)
        got, state = hybrid_attention_continue(q[:, :, T0:], k[:, :, T0:], v[:, :, T0:], pre, wl, ll, **kw)
        stepped_out, stepped = steps(q[:, :, T0:], k[:, :, T0:], v[:, :, T0:], wl, ll, pre, **kw)
    assert any(closes_block(t, w, sinks) for t in range(T0, T0 + L)) or L < w
    torch.testing.assert_close(got, want[:, :, T0:], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, stepped_out, atol=ATOL, rtol=RTOL)
    assert_same_state(state, stepped)


def test_sparse_continuation_leaves_the_attention_score_to_the_steps():
    state = init_sparse_state(1, 2, 8, 4, SparseCacheConfig(4, 0, "attention"))
    assert not continues_at_once(SparseCacheConfig(4, 0, "attention"), state)
    assert continues_at_once(SparseCacheConfig(4, 0, "sre"), state)


def test_closes_are_the_groups_bounds():
    from hybrid_llama.ops.sparse.eviction import group_bounds

    for w, sinks in ((4, 0), (4, 3), (8, 1)):
        ends = [b for _, b in group_bounds(200, w, sinks)][:-1]
        assert [t for t in range(200) if closes_block(t, w, sinks)] == ends


@pytest.mark.parametrize("layout", [
    dict(formulation="hybrid", feature_map="elu1"),
    dict(formulation="lolcats", feature_map="hedgehog", decay=0.9),
    dict(formulation="lolcats", feature_map="hedgehog", sparse_cache=3, sinks=1, decay=0.9,
         softmax_heads=[[0, 1]]),
])
def test_a_cache_continued_by_suffixes_scores_as_the_uncached_forward(lively_dir, layout, monkeypatch):
    """The use the zero-shot suite makes of it: one prefix in a cache, copied per row, continued by
    several suffixes at once (right-padded); every real position's logits as the whole row's."""
    from test_models import randomize_hybrid_params
    from transformers import DynamicCache

    from hybrid_llama.eval.placement import cache_keyword
    from hybrid_llama.layers import hybrid_attention as layer_module
    from hybrid_llama.models import convert_to_hybrid, load_model

    model, _ = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=4, **layout)
    randomize_hybrid_params(model)
    model.eval()
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    prefix = torch.randint(0, vocab, (1, 19), generator=g)
    suffixes = [torch.randint(0, vocab, (1, n), generator=g) for n in (11, 6, 1)]
    calls = {"at_once": 0}
    real = layer_module.hybrid_attention_continue

    def counting(*args, **kwargs):
        calls["at_once"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_module, "hybrid_attention_continue", counting)
    with torch.no_grad():
        cache = DynamicCache()
        key = cache_keyword(model)
        model(prefix, use_cache=True, **{key: cache})
        cache.batch_repeat_interleave(len(suffixes))
        width = max(s.shape[1] for s in suffixes)
        batch = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1])) for s in suffixes])
        got = model(batch, use_cache=True, **{key: cache}).logits
        for row, s in enumerate(suffixes):
            whole = model(torch.cat([prefix, s], 1), use_cache=False).logits[0, prefix.shape[1]:]
            torch.testing.assert_close(got[row, : s.shape[1]], whole, atol=1e-4, rtol=1e-4)
    assert calls["at_once"] == 2  # each hybrid layer continued the batch in one call
