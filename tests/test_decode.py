"""Recurrent decoding: steps equal the parallel op, prefill equals steps, the state stays constant."""

from __future__ import annotations

import pytest
import torch

from hybrid_llama.ops import (
    HedgehogFeatureMap,
    HybridState,
    hybrid_attention,
    hybrid_attention_step,
    init_state,
    prefill_state,
)

ATOL, RTOL = 1e-5, 1e-4


def inputs(B, H, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)] + [torch.randn(H, generator=g) for _ in range(2)]


def run_steps(q, k, v, wl, ll, state, mask=None, **kw):
    outs = []
    for t in range(q.shape[2]):
        sl = slice(t, t + 1)
        valid = None if mask is None else mask[:, t]
        out, state = hybrid_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], state, wl, ll, key_valid=valid, **kw)
        outs.append(out)
    return torch.cat(outs, dim=2), state


def assert_states_equal(a: HybridState, b: HybridState):
    assert a.seen == b.seen
    assert torch.equal(a.window_valid, b.window_valid)
    # Slots that hold no real key may differ (padding values are never read unmasked).
    for x, y in ((a.k_window, b.k_window), (a.v_window, b.v_window)):
        torch.testing.assert_close(x * a.window_valid[:, None, :, None], y * b.window_valid[:, None, :, None])
    torch.testing.assert_close(a.S, b.S, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(a.z, b.z, atol=ATOL, rtol=RTOL)


def hedgehog(H, D):
    fmap = HedgehogFeatureMap(H, D)
    with torch.no_grad():
        fmap.weight.add_(0.3 * torch.randn(fmap.weight.shape, generator=torch.Generator().manual_seed(7)))
    return fmap


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("T,w", [(3, 4), (4, 4), (23, 4), (40, 16)])
def test_steps_equal_parallel_op(formulation, fmap, T, w):
    B, H, D = 2, 3, 8
    q, k, v, wl, ll = inputs(B, H, T, D)
    fm = hedgehog(H, D) if fmap == "hedgehog" else "elu1"
    F_dim = fm.out_features if fmap == "hedgehog" else D
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, : T // 2] = False  # row 1 is left-padded
    with torch.no_grad():
        want = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", formulation=formulation,
                                feature_map=fm, key_padding_mask=mask)[0]
        got, _ = run_steps(q, k, v, wl, ll, init_state(B, H, D, w, feature_dim=F_dim), mask,
                           formulation=formulation, feature_map=fm)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("T,w", [(1, 4), (3, 4), (4, 4), (9, 4), (37, 8)])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
def test_prefill_state_equals_steps_and_continues(T, w, fmap):
    B, H, D = 2, 2, 8
    q, k, v, wl, ll = inputs(B, H, T + 6, D, seed=1)
    fm = hedgehog(H, D) if fmap == "hedgehog" else "elu1"
    F_dim = fm.out_features if fmap == "hedgehog" else D
    mask = torch.ones(B, T + 6, dtype=torch.bool)
    mask[0, : (T + 1) // 2] = False
    with torch.no_grad():
        pre = prefill_state(k[:, :, :T], v[:, :, :T], window=w, feature_map=fm, key_padding_mask=mask[:, :T])
        _, stepped = run_steps(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll,
                               init_state(B, H, D, w, feature_dim=F_dim), mask[:, :T], feature_map=fm)
        assert_states_equal(pre, stepped)
        # Decoding after a prefill equals the parallel op over the whole sequence.
        tail, _ = run_steps(q[:, :, T:], k[:, :, T:], v[:, :, T:], wl, ll, pre, mask[:, T:], feature_map=fm)
        full = hybrid_attention(q, k, v, wl, ll, window=w, backend="chunked", feature_map=fm, key_padding_mask=mask)[0]
    torch.testing.assert_close(tail, full[:, :, T:], atol=ATOL, rtol=RTOL)


def test_state_memory_is_constant():
    B, H, D, w = 1, 2, 8, 4
    q, k, v, wl, ll = inputs(B, H, 100, D, seed=2)
    shapes = set()
    state = init_state(B, H, D, w)
    for t in range(100):
        _, state = hybrid_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, wl, ll)
        if t in (0, 9, 99):
            shapes.add(
                tuple(tuple(x.shape) for x in (state.k_window, state.v_window, state.window_valid, state.S, state.z))
            )
    long = prefill_state(torch.randn(B, H, 5000, D), torch.randn(B, H, 5000, D), window=w)
    shapes.add(tuple(tuple(x.shape) for x in (long.k_window, long.v_window, long.window_valid, long.S, long.z)))
    assert shapes == {((B, H, w, D), (B, H, w, D), (B, w), (B, H, D, D), (B, H, D))}
    assert state.seen == 100 and long.seen == 5000
    assert state.S.dtype == torch.float32 and state.z.dtype == torch.float32


def test_step_is_functional_and_reorderable():
    B, H, D, w = 3, 2, 8, 4
    q, k, v, wl, ll = inputs(B, H, 7, D, seed=3)
    state = prefill_state(k[:, :, :6], v[:, :, :6], window=w)
    before = [x.clone() for x in (state.k_window, state.v_window, state.window_valid, state.S, state.z)]
    out, new = hybrid_attention_step(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], state, wl, ll)
    for old, x in zip(before, (state.k_window, state.v_window, state.window_valid, state.S, state.z)):
        assert torch.equal(old, x)
    assert state.seen == 6 and new.seen == 7
    # Reordering the batch (beam search) reorders the results.
    idx = torch.tensor([2, 0])
    out_r, _ = hybrid_attention_step(q[idx, :, 6:], k[idx, :, 6:], v[idx, :, 6:], state.index_select(idx), wl, ll)
    torch.testing.assert_close(out_r, out[idx])


def test_step_gradients_match_parallel():
    """Decoding is differentiable too (e.g. for recurrent training)."""
    B, H, T, D, w = 1, 2, 11, 8, 4
    q, k, v, wl, ll = (x.requires_grad_() for x in inputs(B, H, T, D, seed=4))
    got, _ = run_steps(q, k, v, wl, ll, init_state(B, H, D, w))
    want = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference")[0]
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    for a, b in zip(
        torch.autograd.grad((got * g).sum(), [q, k, v, wl, ll]),
        torch.autograd.grad((want * g).sum(), [q, k, v, wl, ll]),
    ):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_step_errors():
    q, k, v, wl, ll = inputs(1, 2, 2, 8)
    state = init_state(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"\[B, H, 1, D\]"):
        hybrid_attention_step(q, k, v, state, wl, ll)
    with pytest.raises(ValueError, match="formulation"):
        hybrid_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], state, wl, ll, formulation="x")


# ------------------------------------------------------------------------------------------ GQA


def test_expand_kv_matches_transformers_repeat_kv():
    from transformers.models.llama.modeling_llama import repeat_kv

    from hybrid_llama.ops import expand_kv

    q, k, v, _, _ = inputs(2, 6, 5, 4)
    k2, v2 = k[:, :2], v[:, :2]
    ek, ev = expand_kv(q, k2, v2)
    assert torch.equal(ek, repeat_kv(k2, 3)) and torch.equal(ev, repeat_kv(v2, 3))
    assert expand_kv(q, k, v)[0] is k  # already per query head: untouched
    with pytest.raises(ValueError, match="H % H_kv"):
        expand_kv(q, k[:, :4], v[:, :4])


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
@pytest.mark.parametrize("T,w", [(5, 4), (30, 8)])
def test_gqa_state_decodes_like_expanded_kv(formulation, T, w):
    """A state kept per KV head (H_kv = 2 for H = 6) gives the outputs of the parallel op on
    repeated k/v, and holds exactly the heads 0, 3 of the expanded state."""
    from hybrid_llama.ops import expand_kv

    B, H, Hkv, D = 2, 6, 2, 8
    q, k, v, wl, ll = inputs(B, H, T, D, seed=3)
    k, v = k[:, :Hkv], v[:, :Hkv]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False
    ek, ev = expand_kv(q, k, v)
    with torch.no_grad():
        want = hybrid_attention(
            q, ek, ev, wl, ll, window=w, backend="reference", formulation=formulation, key_padding_mask=mask
        )[0]
        got, gqa_state = run_steps(q, k, v, wl, ll, init_state(B, Hkv, D, w), mask, formulation=formulation)
        # the dispatcher takes GQA k/v too (repeating them for the torch backends)
        par = hybrid_attention(
            q, k, v, wl, ll, window=w, backend="chunked", formulation=formulation, key_padding_mask=mask
        )[0]
        _, full_state = run_steps(q, ek, ev, wl, ll, init_state(B, H, D, w), mask, formulation=formulation)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(par, want, atol=ATOL, rtol=RTOL)
    pick = torch.arange(0, H, H // Hkv)
    assert_states_equal(
        gqa_state,
        HybridState(
            full_state.k_window[:, pick],
            full_state.v_window[:, pick],
            full_state.window_valid,
            full_state.S[:, pick],
            full_state.z[:, pick],
            full_state.seen,
        ),
    )
    assert_states_equal(gqa_state, prefill_state(k, v, window=w, key_padding_mask=mask))


def test_gqa_step_rejects_per_head_feature_map_and_wrong_state():
    q, k, v, wl, ll = inputs(1, 4, 1, 8)
    with pytest.raises(ValueError, match="HedgehogFeatureMap"):
        hybrid_attention_step(
            q, k[:, :2], v[:, :2], init_state(1, 2, 8, 4, feature_dim=16), wl, ll, feature_map=hedgehog(4, 8)
        )
    with pytest.raises(ValueError, match="state of H_kv heads"):
        hybrid_attention_step(q, k[:, :2], v[:, :2], init_state(1, 4, 8, 4), wl, ll)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("T,w", [(5, 4), (30, 8)])
def test_query_key_map_pair_decodes_at_kv_heads(formulation, T, w):
    """Hedgehog as a (query_map, key_map) pair: the state stays at the KV heads with width F = 2D,
    the steps equal the parallel op, and prefill_state equals the steps."""
    B, H, Hkv, D = 2, 4, 2, 8
    q, k, v, wl, ll = inputs(B, H, T, D, seed=5)
    k, v = k[:, :Hkv], v[:, :Hkv]
    fm = (hedgehog(H, D), hedgehog(Hkv, D))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        want = hybrid_attention(
            q,
            k,
            v,
            wl,
            ll,
            window=w,
            backend="reference",
            formulation=formulation,
            feature_map=fm,
            key_padding_mask=mask,
        )[0]
        got, state = run_steps(
            q, k, v, wl, ll, init_state(B, Hkv, D, w, feature_dim=2 * D), mask, formulation=formulation, feature_map=fm
        )
        pre = prefill_state(k, v, window=w, feature_map=fm, key_padding_mask=mask)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert state.S.shape == (B, Hkv, 2 * D, D)
    assert_states_equal(pre, state)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
def test_in_place_steps_equal_functional_steps(formulation, fmap):
    """The lean path a generation cache takes (state updated in place) gives the functional step's
    outputs and states, across the window's fill and many folds, with GQA."""
    B, H, Hk, T, D, w = 2, 4, 2, 40, 8, 6
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    wl, ll = torch.randn(H, generator=g), torch.randn(H, generator=g)
    feature = (HedgehogFeatureMap(H, D), HedgehogFeatureMap(Hk, D)) if fmap == "hedgehog" else "elu1"
    kw = dict(feature_map=feature, formulation=formulation, backend="torch")
    fdim = 2 * D if fmap == "hedgehog" else D
    with torch.no_grad():
        functional = init_state(B, Hk, D, w, feature_dim=fdim)
        owned = init_state(B, Hk, D, w, feature_dim=fdim)
        for t in range(T):
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            want, functional = hybrid_attention_step(*step, functional, wl, ll, **kw)
            got, owned = hybrid_attention_step(*step, owned, wl, ll, inplace=True, **kw)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert_states_equal(owned, functional)


@pytest.mark.parametrize("padded", [False, True])
def test_in_place_steps_after_a_prefill_equal_functional_steps(padded):
    """From a prefill's state (which records whether every key was real, so the in-place step may
    skip reading the window's mask), the in-place steps still equal the functional ones; with a
    padded key in the prefill's window the mask must be read, and it is."""
    B, H, Hk, T, D, w = 2, 4, 2, 9, 8, 6
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, T + 12, D, generator=g) for h in (H, Hk, Hk))
    wl, ll = torch.randn(H, generator=g), torch.randn(H, generator=g)
    feature = (HedgehogFeatureMap(H, D), HedgehogFeatureMap(Hk, D))
    mask = torch.ones(B, T, dtype=torch.bool)
    if padded:
        mask[0, T - 2] = False  # still inside the window when decoding starts
    kw = dict(feature_map=feature, formulation="lolcats", backend="torch")
    with torch.no_grad():
        pre = dict(window=w, feature_map=feature, key_padding_mask=mask if padded else None)
        functional = prefill_state(k[:, :, :T], v[:, :, :T], **pre)
        owned = prefill_state(k[:, :, :T], v[:, :, :T], **pre)
        assert owned.all_real is (None if padded else True)
        for t in range(T, T + 12):
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            want, functional = hybrid_attention_step(*step, functional, wl, ll, **kw)
            got, owned = hybrid_attention_step(*step, owned, wl, ll, inplace=True, **kw)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert_states_equal(owned, functional)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_in_place_step_follows_changed_mixing_logits(formulation):
    """The in-place step keeps sigmoid/logsigmoid of the mixing logits between tokens; an optimizer
    step (an in-place update of the logits) or new logit tensors must be seen at the next token. A
    window logit so negative that its sigmoid underflows stays finite (it enters as logsigmoid)."""
    B, H, Hk, T, D, w = 1, 4, 2, 14, 8, 4
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    wl, ll = torch.randn(H, generator=g), torch.randn(H, generator=g)
    kw = dict(feature_map="elu1", formulation=formulation, backend="torch")
    with torch.no_grad():
        functional, owned = init_state(B, Hk, D, w), init_state(B, Hk, D, w)
        for t in range(T):
            if t == 8:
                wl.add_(torch.tensor([1.5, -2.0, 0.0, -200.0]))  # in place: same tensor, new version
            if t == 11:
                wl, ll = wl.clone() - 1.0, ll.clone() + 1.0  # new tensors
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            want, functional = hybrid_attention_step(*step, functional, wl, ll, **kw)
            got, owned = hybrid_attention_step(*step, owned, wl, ll, inplace=True, **kw)
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_in_place_steps_with_modules_built_under_inference_mode():
    """Feature maps and mixing logits made under ``torch.inference_mode`` are inference tensors, which
    keep no version counter: the step must not key its kept values on one, and still decode right."""
    B, H, Hk, T, D, w = 1, 4, 2, 12, 8, 4
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    logits = torch.randn(2, H, generator=g)
    normal = (HedgehogFeatureMap(H, D), HedgehogFeatureMap(Hk, D))
    with torch.inference_mode():
        frozen = (HedgehogFeatureMap(H, D), HedgehogFeatureMap(Hk, D))
        wl, ll = logits[0].clone(), logits[1].clone()
        assert wl.is_inference() and frozen[0].weight.is_inference()
        for t in range(T):
            if t == 7:  # an in-place change inside inference mode must be seen as well
                wl.add_(1.0)
                logits[0].add_(1.0)
                for new, old in zip(frozen, normal):
                    new.bias.add_(0.5)
                    old.bias.data.add_(0.5)
            if t == 0:
                want_state = init_state(B, Hk, D, w, feature_dim=2 * D)
                got_state = init_state(B, Hk, D, w, feature_dim=2 * D)
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            kw = dict(formulation="lolcats", backend="torch", inplace=True)
            want, want_state = hybrid_attention_step(*step, want_state, logits[0], logits[1], feature_map=normal, **kw)
            got, got_state = hybrid_attention_step(*step, got_state, wl, ll, feature_map=frozen, **kw)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
