"""The sparse cache (third memory): the fast path and the decode step against an independent naive
transcription, the reference simulation's own semantics, and the model-level cache."""

from __future__ import annotations

import math

import pytest
import torch
from op_inputs import count_calls, trained_maps
from test_models import greedy, randomize_hybrid_params

from hybrid_llama.layers import HybridCacheLayer
from hybrid_llama.models import convert_to_hybrid, hybrid_cache_nbytes, load_model
from hybrid_llama.ops import (
    HedgehogFeatureMap,
    SparseCacheConfig,
    hybrid_attention,
    hybrid_attention_step,
    init_sparse_state,
)
from hybrid_llama.ops.sparse import batched as sparse_batched
from hybrid_llama.ops.sparse.batched import hybrid_attention_sparse_batched
from hybrid_llama.ops.sparse.chunked import hybrid_attention_sparse
from hybrid_llama.ops.sparse.eviction import random_scores
from hybrid_llama.ops.sparse.reference import hybrid_attention_sparse_reference


def make(B=2, H=4, Hk=2, T=70, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    return q, k, v, torch.randn(H, generator=g), torch.randn(H, generator=g)


def naive_sparse(q, k, v, wl, ll, *, window, size, sinks, score, mask=None):
    """A second, independent transcription for elu1: per (row, query head), the exact set and the
    linear sums rebuilt from scratch for every query from the eviction history, which is replayed on
    plain Python lists of positions."""
    B, H, T, D = q.shape
    Hk = k.shape[1]
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(B, H, T, D)
    for b in range(B):
        for hk in range(Hk):
            # Replay the evictions: (time they happen, cache after, folded positions).
            cache, folded, events, acc = [], [], [], [0.0] * T
            blocks_closed = 0
            for t in range(T):
                n_old = t - window + 1 - sinks  # non-sink keys that have left the window by step t
                while n_old >= (blocks_closed + 1) * window:
                    block = list(range(sinks + blocks_closed * window, sinks + (blocks_closed + 1) * window))
                    cand = [p for p in cache + block if real[b, p]]
                    S = sum((torch.outer(phi(k[b, hk, p]), v[b, hk, p]) for p in folded), torch.zeros(D, D))
                    z = sum((phi(k[b, hk, p]) for p in folded), torch.zeros(D))
                    if score == "sre":
                        val = {p: float((v[b, hk, p] - phi(k[b, hk, p]) @ S / (phi(k[b, hk, p]) @ z + 1e-6)).norm())
                               for p in cand}
                    elif score == "random":
                        r = random_scores(torch.arange(T).view(1, 1, T).expand(1, Hk, T), Hk)[0, hk]
                        val = {p: float(r[p]) for p in cand}
                    else:
                        val = {p: acc[p] for p in cand}
                    cache = sorted(sorted(cand, key=lambda p: (-val[p], p))[:size])  # noqa: B023
                    folded += [p for p in cand if p not in cache]
                    blocks_closed += 1
                events.append((list(cache), list(folded)))
                pending_start = sinks + blocks_closed * window
                exact = [p for p in range(t + 1) if real[b, p] and (
                    p > t - window or p < sinks or p in cache or p >= pending_start)]
                S = sum((torch.outer(phi(k[b, hk, p]), v[b, hk, p]) for p in folded), torch.zeros(D, D))
                z = sum((phi(k[b, hk, p]) for p in folded), torch.zeros(D))
                for h in range(hk * H // Hk, (hk + 1) * H // Hk):
                    aw, bw = torch.sigmoid(wl[h]), torch.sigmoid(ll[h])
                    s = torch.tensor([float(q[b, h, t] @ k[b, hk, p]) / math.sqrt(D) for p in exact])
                    e = torch.exp(s - s.max()) if exact else s
                    num = aw * sum((e[i] * v[b, hk, p] for i, p in enumerate(exact)), torch.zeros(D))
                    num = num + bw * phi(q[b, h, t]) @ S
                    den = aw * e.sum() + bw * phi(q[b, h, t]) @ z
                    out[b, h, t] = num / den if den > 0 else 0
                    for i, p in enumerate(exact):
                        acc[p] += float(e[i] / e.sum())
    return out


CASES = [  # T, window, size, sinks, score, padded
    (70, 8, 6, 2, "sre", False),
    (53, 8, 3, 0, "random", True),
    (61, 8, 5, 3, "attention", False),
    (45, 8, 0, 3, "sre", False),
    (40, 16, 4, 1, "sre", True),
]


def padding(B, T):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :5] = False
    mask[-1, 20:23] = False
    return mask


@pytest.mark.parametrize("T,w,size,sinks,score,padded", CASES)
def test_fast_path_and_reference_match_naive(T, w, size, sinks, score, padded):
    q, k, v, wl, ll = make(T=T)
    mask = padding(2, T) if padded else None
    kw = dict(window=w, formulation="lolcats", key_padding_mask=mask, sparse=SparseCacheConfig(size, sinks, score))
    want = naive_sparse(q, k, v, wl, ll, window=w, size=size, sinks=sinks, score=score, mask=mask)
    fast, state = hybrid_attention(q, k, v, wl, ll, backend="chunked", output_final_state=True, **kw)
    ref, _ = hybrid_attention(q, k, v, wl, ll, backend="reference", **kw)
    torch.testing.assert_close(fast, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ref, want, atol=2e-5, rtol=1e-4)
    assert state.sparse is not None and state.seen == T


# Prompts that end before the first group (T <= sinks + w - 1), inside it, on a group's last position
# and past several closes; without a cache, without sinks, a wider window.
BATCHED_CASES = [  # T, window, size, sinks, score
    (70, 8, 6, 2, "sre"), (61, 8, 5, 3, "random"), (45, 8, 0, 3, "sre"), (88, 8, 6, 0, "sre"),
    (9, 8, 4, 2, "sre"), (10, 8, 4, 2, "sre"), (65, 8, 4, 2, "random"), (40, 16, 4, 1, "sre"),
]
SPARSE_PATHS = {"loop": hybrid_attention_sparse, "batched": hybrid_attention_sparse_batched}


def _same_sparse_state(got, want):
    assert got.seen == want.seen
    for name in vars(want.sparse):
        torch.testing.assert_close(getattr(got.sparse, name), getattr(want.sparse, name), atol=1e-5, rtol=1e-5,
                                   msg=name)
    for name in ("k_window", "v_window", "window_valid", "S", "z"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("T,w,size,sinks,score", BATCHED_CASES)
def test_batched_and_loop_paths_match_naive(T, w, size, sinks, score):
    """Both torch paths of the sparse op (one group per iteration, and the evictions first, then every
    group in one batched product) against the naive transcription, with the same decode state."""
    q, k, v, wl, ll = make(T=T)
    want = naive_sparse(q, k, v, wl, ll, window=w, size=size, sinks=sinks, score=score)
    states = {}
    for name, op in SPARSE_PATHS.items():
        got, states[name] = op(q, k, v, wl, ll, window=w, cache=SparseCacheConfig(size, sinks, score),
                               output_final_state=True)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=name)
    assert states["batched"].sparse is not None
    _same_sparse_state(states["batched"], states["loop"])


@pytest.mark.parametrize("T,w,size,sinks,score", BATCHED_CASES)
def test_batched_gradients_match_the_loop(T, w, size, sinks, score):
    """Gradients of q, k, v, the mixing logits and both Hedgehog maps' W and b (GQA: key map at the
    KV heads) through the batched path equal the loop's, which autograd follows op by op."""
    q, k, v, wl, ll = make(T=T)
    grads = {}
    for name, op in SPARSE_PATHS.items():
        maps = trained_maps(4, 2, 8)
        xs = [x.clone().requires_grad_() for x in (q, k, v, wl, ll)]
        out, _ = op(*xs, window=w, cache=SparseCacheConfig(size, sinks, score), feature_map=maps)
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
        grads[name] = [x.grad for x in xs] + [p.grad for m in maps for p in (m.weight, m.bias)]
    for got, want in zip(grads["batched"], grads["loop"]):
        if got is None:  # before any close the key map is not read, nor before the first group anything but SDPA
            assert want is None or (T <= sinks + w - 1 and want.abs().max() < 1e-5)  # the loop: a * s / (a * s)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_training_takes_the_batched_path(monkeypatch):
    """Under autograd without padding, the op runs the batched path (the native one needs no_grad);
    with a padding mask it keeps the loop."""
    calls = count_calls(monkeypatch, sparse_batched, "hybrid_attention_sparse_batched")
    q, k, v, wl, ll = (x.requires_grad_() for x in make(T=40))
    kw = dict(window=8, formulation="lolcats", sparse=SparseCacheConfig(4, 2))
    hybrid_attention(q, k, v, wl, ll, **kw)[0].sum().backward()
    assert calls["ran"] == 1
    hybrid_attention(q, k, v, wl, ll, key_padding_mask=padding(2, 40), **kw)
    assert calls["ran"] == 1


@pytest.mark.parametrize("T,w,size,sinks,score,padded", CASES)
@pytest.mark.parametrize("feature", ["elu1", "hedgehog"])
def test_decode_equals_parallel_and_continues_from_prefill(T, w, size, sinks, score, padded, feature):
    q, k, v, wl, ll = make(T=T)
    mask = padding(2, T) if padded else None
    fmap = (HedgehogFeatureMap(4, 8), HedgehogFeatureMap(2, 8)) if feature == "hedgehog" else "elu1"
    kw = dict(formulation="lolcats", feature_map=fmap, sparse=SparseCacheConfig(size, sinks, score))
    with torch.no_grad():
        full, _ = hybrid_attention(q, k, v, wl, ll, window=w, key_padding_mask=mask, **kw)
        state = init_sparse_state(2, 2, 8, w, SparseCacheConfig(size, sinks, score), feature_dim=16 if feature ==
                                  "hedgehog" else 8)
        steps = []
        for t in range(T):
            o, state = hybrid_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, wl, ll,
                                             key_valid=None if mask is None else mask[:, t], **kw)
            steps.append(o)
        torch.testing.assert_close(torch.cat(steps, 2), full, atol=2e-5, rtol=1e-4)
        cut = T - 13  # prefill cut mid-block, then decode the rest
        _, pre = hybrid_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], wl, ll, window=w,
                                  key_padding_mask=None if mask is None else mask[:, :cut], output_final_state=True,
                                  **kw)
        stepped = _state_after(q, k, v, wl, ll, w, cut, mask, kw)
        assert torch.equal(pre.sparse.cache_pos, stepped.sparse.cache_pos)
        rest = []
        for t in range(cut, T):
            o, pre = hybrid_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], pre, wl, ll,
                                           key_valid=None if mask is None else mask[:, t], **kw)
            rest.append(o)
        torch.testing.assert_close(torch.cat(rest, 2), full[:, :, cut:], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pre.S, state.S, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("score", ["sre", "random", "attention"])
def test_prompt_inside_the_window_then_decode_equals_parallel(score):
    """A prompt of T <= w takes the softmax-only path (SDPA, and for sre / random the state built
    from its keys); decoding on from that state across several closed blocks gives the parallel op."""
    q, k, v, wl, ll = make(T=60)
    w, cut = 8, 6
    kw = dict(formulation="lolcats", sparse=SparseCacheConfig(3, 2, score))
    with torch.no_grad():
        full, _ = hybrid_attention(q, k, v, wl, ll, window=w, **kw)
        head, pre = hybrid_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], wl, ll, window=w,
                                     output_final_state=True, **kw)
        stepped = _state_after(q, k, v, wl, ll, w, cut, None, {**kw, "feature_map": "elu1"})
        for name in ("sink_valid", "pend_valid", "cache_valid", "cache_pos"):
            assert torch.equal(getattr(pre.sparse, name), getattr(stepped.sparse, name)), name
        torch.testing.assert_close(pre.k_window, stepped.k_window)
        rest = []
        for t in range(cut, 60):
            o, pre = hybrid_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], pre, wl, ll, **kw)
            rest.append(o)
    torch.testing.assert_close(head, full[:, :, :cut], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(rest, 2), full[:, :, cut:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("size,sinks,score,feature", [(6, 2, "sre", "elu1"), (16, 1, "random", "hedgehog"),
                                                      (0, 3, "sre", "hedgehog"), (19, 0, "sre", "elu1")])
def test_prompts_that_fold_no_key_are_causal_softmax_with_the_ops_state(size, sinks, score, feature, monkeypatch):
    """At inference a prompt in which no close folds a key (``softmax_prompt_len``) is causal SDPA; its
    state, built from the keys alone, is the sparse op's own final state, and decoding on from it
    across later folds gives the parallel op. One token longer, the sparse op runs (the last query
    sees a fold)."""
    import hybrid_llama.ops.dispatch as ops

    w = 8
    cfg = SparseCacheConfig(size, sinks, score)
    bound = cfg.softmax_prompt_len(w)
    assert bound > w
    total = bound + 3 * w
    q, k, v, wl, ll = make(T=total, seed=3)
    fmap = (HedgehogFeatureMap(4, 8), HedgehogFeatureMap(2, 8)) if feature == "hedgehog" else "elu1"
    kw = dict(formulation="lolcats", feature_map=fmap, sparse=SparseCacheConfig(size, sinks, score))
    softmax = count_calls(monkeypatch, ops, "causal_softmax")
    with torch.no_grad():
        full, _ = hybrid_attention(q, k, v, wl, ll, window=w, **kw)
        for T in (w + 1, bound, bound + 1):
            before = softmax["ran"]
            got, state = hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w,
                                          output_final_state=True, **kw)
            assert softmax["ran"] == before + (T <= bound)
            want, want_state = hybrid_attention_sparse(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w,
                                                       cache=cfg, feature_map=fmap, output_final_state=True)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(got, full[:, :, :T], atol=2e-5, rtol=1e-4)
            assert bool(want_state.S.any()) == (T > bound)  # the op folded nothing up to the bound
            for name in ("k_window", "v_window", "window_valid", "S", "z"):
                torch.testing.assert_close(getattr(state, name), getattr(want_state, name), atol=1e-6, rtol=1e-6)
            for name in ("sink_k", "sink_valid", "pend_k", "pend_valid", "cache_k", "cache_valid", "cache_pos"):
                torch.testing.assert_close(getattr(state.sparse, name), getattr(want_state.sparse, name),
                                           atol=0, rtol=0)
            assert state.seen == want_state.seen == T
            rest = []
            for t in range(T, total):
                o, state = hybrid_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, wl, ll,
                                                 **kw)
                rest.append(o)
            torch.testing.assert_close(torch.cat(rest, 2), full[:, :, T:], atol=2e-5, rtol=1e-4)
    # under autograd only the window counts: the sparse op's gradients are what training always had
    before = softmax["ran"]
    hybrid_attention(q[:, :, :bound], k[:, :, :bound], v[:, :, :bound], wl.requires_grad_(), ll, window=w, **kw)
    assert softmax["ran"] == before


def test_softmax_prompt_state_reads_the_map_width_as_the_window_prompt_does():
    """A single Hedgehog map of the query heads with GQA: the state of a prompt past the window that
    folds nothing has the KV heads and F of a prompt inside it (the map is not applied to KV-head keys)."""
    q, k, v, wl, ll = make(B=1, T=20)
    kw = dict(formulation="lolcats", feature_map=HedgehogFeatureMap(4, 8), sparse=SparseCacheConfig(6, 2))
    assert SparseCacheConfig(6, 2).softmax_prompt_len(8) >= 15
    with torch.no_grad():
        _, inside = hybrid_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], wl, ll, window=8, output_final_state=True,
                                     **kw)
        _, past = hybrid_attention(q[:, :, :15], k[:, :, :15], v[:, :, :15], wl, ll, window=8,
                                   output_final_state=True, **kw)
    assert past.k_window.shape == inside.k_window.shape == (1, 2, 8, 8)
    assert past.S.shape == inside.S.shape == (1, 2, 16, 8)


def test_model_prompt_that_folds_nothing_decodes_as_recomputed(lively_dir):
    """A first prompt past the window that folds no key takes the softmax path in the layer and defers
    the sparse state; cached greedy generation from it equals recomputing every step."""
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=4, formulation="lolcats", feature_map="hedgehog", sparse_cache=5, sinks=1)
    randomize_hybrid_params(model)
    model.eval()
    bound = SparseCacheConfig(5, 1).softmax_prompt_len(4)
    enc = tok(["a prompt long enough to leave the window but fold nothing yet"], return_tensors="pt")
    enc = {name: t[:, :bound] for name, t in enc.items()}
    assert enc["input_ids"].shape[1] == bound > 4
    with torch.no_grad():
        out = model(**enc, use_cache=True)
    slot = out.past_key_values.layers[0]
    assert isinstance(slot, HybridCacheLayer) and slot._prefix is not None  # deferred: no state built yet
    assert torch.equal(greedy(model, enc, 20), greedy(model, enc, 20, use_cache=False))


def _state_after(q, k, v, wl, ll, w, n, mask, kw):
    """The decode state after n steps from an empty one."""
    fd = 16 if isinstance(kw["feature_map"], tuple) else 8
    state = init_sparse_state(2, 2, 8, w, kw["sparse"], feature_dim=fd)
    for t in range(n):
        _, state = hybrid_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], state, wl, ll,
                                         key_valid=None if mask is None else mask[:, t], **kw)
    return state


def test_off_is_bit_identical_to_the_plain_op():
    q, k, v, wl, ll = make(T=90)
    plain, s1 = hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", output_final_state=True)
    off, s2 = hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", output_final_state=True,
                               sparse=SparseCacheConfig(0, 0, "random"))
    assert torch.equal(plain, off) and s2.sparse is None and torch.equal(s1.S, s2.S)


def test_reference_history_is_the_cache_the_state_holds():
    q, k, v, wl, ll = make(B=1, T=75)
    cfg = SparseCacheConfig(5, 2, "sre")
    _, _, history = hybrid_attention_sparse_reference(q, k, v, wl, ll, window=8, cache=cfg)
    _, state = hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", output_final_state=True,
                                sparse=SparseCacheConfig(5, 2))
    # history[t] is the cache when query t attends; the state after T tokens holds the last one.
    for hk in range(2):
        got = [p for p in state.sparse.cache_pos[0, hk].tolist() if p >= 0]
        assert got == history[0][hk][-1] and len(got) == 5


def test_state_memory_is_fixed():
    q, k, v, wl, ll = make(B=1, T=300)
    sizes = {hybrid_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], wl, ll, window=8, formulation="lolcats",
                              output_final_state=True, sparse=SparseCacheConfig(6, 2))[1].nbytes()
             for n in (40, 150, 300)}
    assert len(sizes) == 1


def test_gradients_match_reference():
    q, k, v, wl, ll = make(B=1, T=45)
    grads = []
    for backend in ("chunked", "reference"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, wl, ll)]
        out, _ = hybrid_attention(*xs, window=8, formulation="lolcats", backend=backend,
                                  sparse=SparseCacheConfig(4, 2))
        out.square().sum().backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_shares_sum_to_one():
    from hybrid_llama.ops.sparse.chunked import hybrid_attention_sparse
    from hybrid_llama.ops.sparse.config import SparseCacheConfig as C

    q, k, v, wl, ll = make(T=80)
    _, _, shares = hybrid_attention_sparse(q, k, v, wl, ll, window=8, cache=C(4, 2, "sre"), return_shares=True)
    torch.testing.assert_close(shares.sum(-1), torch.ones(2, 4, 80))
    assert (shares[:, :, 40:, 1] > 0).all()  # past the first block the cache holds weight


@pytest.mark.parametrize("bad,match", [
    (dict(size=-1), "integer >= 0"),
    (dict(size=2.5), "integer >= 0"),
    (dict(size=4, formulation="hybrid"), "lolcats"),
    (dict(sinks=2, formulation="window"), "lolcats"),
    (dict(size=4, score="oracle"), "cache_score"),
])
def test_bad_settings_are_named(bad, match):
    q, k, v, wl, ll = make(T=20)
    formulation = bad.pop("formulation", "lolcats")
    with pytest.raises(ValueError, match=match):
        hybrid_attention(q, k, v, wl, ll, window=8, formulation=formulation, sparse=SparseCacheConfig(**bad))


def test_model_generates_with_sparse_cache_like_without_cache(lively_dir):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=4, formulation="lolcats", feature_map="hedgehog", sparse_cache=3, sinks=1)
    randomize_hybrid_params(model)
    model.eval()
    enc = tok(["a sparse cache keeps a few keys exactly"], return_tensors="pt")
    n = 30
    with torch.no_grad():
        cached = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                return_dict_in_generate=True)
    assert torch.equal(cached.sequences, greedy(model, enc, n, use_cache=False))
    layers = cached.past_key_values.layers
    assert isinstance(layers[0], HybridCacheLayer) and layers[0].state.sparse is not None
    with torch.no_grad():
        shorter = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 return_dict_in_generate=True)
    # the hybrid layers' memory does not grow with the generated length
    assert layers[0].nbytes() == shorter.past_key_values.layers[0].nbytes()
    assert hybrid_cache_nbytes(cached.past_key_values) > hybrid_cache_nbytes(shorter.past_key_values)
    # a prompt inside the window (deferred state), decoded far past it
    short = tok(["hi"], return_tensors="pt")
    assert short["input_ids"].shape[1] <= 4
    assert torch.equal(greedy(model, short, n), greedy(model, short, n, use_cache=False))


@pytest.mark.parametrize("path", ["loop", "batched", "dispatch"])
def test_values_in_a_narrower_dtype_than_keys(path):
    """Under bf16 autocast RoPE widens k to fp32 while v stays bf16: every path takes the pair and
    gives the output and decode state of the same values widened up front (exact: bf16 -> fp32)."""
    q, k, v, wl, ll = make(T=53)
    v_bf16 = v.bfloat16()
    cache = SparseCacheConfig(5, 2, "sre")

    def run(values):
        if path == "dispatch":  # no_grad: the native CPU path where it is built
            with torch.no_grad():
                return hybrid_attention(q, k, values, wl, ll, window=8, formulation="lolcats",
                                        sparse=SparseCacheConfig(5, 2, "sre"), output_final_state=True)
        return SPARSE_PATHS[path](q, k, values, wl, ll, window=8, cache=cache, output_final_state=True)

    got, got_state = run(v_bf16)
    want, want_state = run(v_bf16.float())
    torch.testing.assert_close(got, want)
    _same_sparse_state(got_state, want_state)
