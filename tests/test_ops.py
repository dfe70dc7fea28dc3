"""Every torch backend of hybrid_attention against an independent, per-query O(T^2) implementation.

``naive`` below is written from the math in docs/design.md one query at a time (lists of key
indices, no masks, no chunking); it shares no code with the backends.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import hybrid_llama.ops as ops
import hybrid_llama.ops.dispatch as dispatch
import hybrid_llama.ops.hybrid.chunked as chunked_module
from hybrid_llama.ops import HedgehogFeatureMap, elu1, hybrid_attention
from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked
from hybrid_llama.ops.hybrid.seed_naive import hybrid_attention_seed_naive

ATOL, RTOL = 1e-5, 1e-4


def wsum(weights, values):
    """Per head: sum_j weights[h, j] * values[h, j, :]."""
    return (weights[..., None] * values).sum(dim=-2)


def naive(q, k, v, window_logit, linear_logit, window, formulation="hybrid", phi=None, mask=None, k_features=None):
    """out[b, :, t] for every (b, t), straight from the definition. ``phi`` maps the queries (and the
    keys, unless their features ``k_features`` [B, H, T, F] are given); "window" drops the linear part."""
    phi = phi or (lambda x: F.elu(x) + 1)
    B, H, T, D = q.shape
    a = torch.sigmoid(window_logit)[:, None]  # [H, 1]
    b = torch.sigmoid(linear_logit)[:, None] if formulation != "window" else torch.zeros(H, 1)
    if formulation == "window":
        a = torch.ones(H, 1)
    pq = phi(q)
    pk = phi(k) if k_features is None else k_features
    rows = []
    for bi in range(B):
        cols = []
        for t in range(T):
            real = (lambda j: True) if mask is None else (lambda j, bi=bi: bool(mask[bi, j]))
            win = [j for j in range(max(0, t - window + 1), t + 1) if real(j)]
            lin = [j for j in range(0, t - window + 1) if real(j)]
            num = torch.zeros(H, v.shape[-1])
            den = torch.zeros(H, 1)
            if win:
                s = (q[bi, :, t, None, :] * k[bi, :, win]).sum(-1) / math.sqrt(D)  # [H, |win|]
                e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
                if formulation in ("hybrid", "window"):
                    num = num + a * wsum(e / e.sum(-1, keepdim=True), v[bi, :, win])
                    den = den + a
                else:
                    num = num + a * wsum(e, v[bi, :, win])
                    den = den + a * e.sum(-1, keepdim=True)
            if lin:
                ls = (pq[bi, :, t, None, :] * pk[bi, :, lin]).sum(-1)  # [H, |lin|]
                num = num + b * wsum(ls, v[bi, :, lin])
                den = den + b * ls.sum(-1, keepdim=True)
            cols.append(num / den if (den > 0).all() else num)
        rows.append(torch.stack(cols, dim=1))
    return torch.stack(rows)


def run_chunked_small_slabs(q, k, v, wl, ll, **kw):
    """Chunked with tiny chunks and slabs, so the state carry between slabs is exercised."""
    w = kw["window"]
    return hybrid_attention_chunked(q, k, v, wl, ll, chunk_size=w, slab_size=2 * w, **kw)[0]


BACKENDS = {
    "reference": lambda *a, **kw: hybrid_attention(*a, backend="reference", **kw)[0],
    "chunked": lambda *a, **kw: hybrid_attention(*a, backend="chunked", **kw)[0],
    "chunked_small_slabs": run_chunked_small_slabs,
    "auto": lambda *a, **kw: hybrid_attention(*a, backend="auto", **kw)[0],
}

# (B, H, T, D, window): T not a multiple of w, T < w, T = 1, T = w, small and large windows.
SHAPES = [
    (2, 3, 37, 16, 8),
    (1, 2, 5, 8, 8),
    (2, 2, 1, 8, 4),
    (1, 2, 8, 8, 8),
    (2, 2, 45, 8, 4),
    (1, 2, 150, 16, 64),
]


def make_inputs(B, H, T, D, seed=0, kv_heads=None):
    g = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or H
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k = torch.randn(B, kv_heads, T, D, generator=g, requires_grad=True)
    v = torch.randn(B, kv_heads, T, D, generator=g, requires_grad=True)
    wl = torch.randn(H, generator=g).requires_grad_()
    ll = torch.randn(H, generator=g).requires_grad_()
    return q, k, v, wl, ll


def expand(x, H):
    """GQA: repeat each KV head for its query heads (grads flow back to the KV heads)."""
    return x.repeat_interleave(H // x.shape[1], dim=1)


def grads(out, leaves, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad((out * g).sum(), leaves, allow_unused=True, materialize_grads=True)


def assert_same(got, want):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}T{}D{}w{}".format(*s))
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_forward_and_grads_match_naive(backend, shape, formulation):
    B, H, T, D, w = shape
    q, k, v, wl, ll = make_inputs(B, H, T, D)
    leaves = [q, k, v, wl, ll]
    want = naive(q, k, v, wl, ll, w, formulation)
    got = BACKENDS[backend](q, k, v, wl, ll, window=w, formulation=formulation)
    assert got.shape == (B, H, T, D) and got.dtype == q.dtype
    assert_same(got, want)
    for g_got, g_want in zip(grads(got, leaves), grads(want, leaves)):
        assert_same(g_got, g_want)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_gqa_expanded_kv(backend):
    B, H, T, D, w = 2, 4, 29, 8, 8
    q, k, v, wl, ll = make_inputs(B, H, T, D, kv_heads=2)
    ke, ve = expand(k, H), expand(v, H)
    want = naive(q, ke, ve, wl, ll, w)
    got = BACKENDS[backend](q, ke, ve, wl, ll, window=w)
    assert_same(got, want)
    for g_got, g_want in zip(grads(got, [q, k, v]), grads(want, [q, k, v])):
        assert_same(g_got, g_want)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_hedgehog_feature_map(backend, formulation):
    B, H, T, D, w = 2, 2, 33, 8, 8
    fmap = HedgehogFeatureMap(H, D, feature_dim=6)
    with torch.no_grad():  # move away from the identity init so the map matters
        fmap.weight.add_(0.3 * torch.randn(fmap.weight.shape, generator=torch.Generator().manual_seed(5)))
    q, k, v, wl, ll = make_inputs(B, H, T, D)
    leaves = [q, k, v, wl, ll, fmap.weight, fmap.bias]
    want = naive(q, k, v, wl, ll, w, formulation, phi=fmap)
    got = BACKENDS[backend](q, k, v, wl, ll, window=w, formulation=formulation, feature_map=fmap)
    assert_same(got, want)
    for g_got, g_want in zip(grads(got, leaves), grads(want, leaves)):
        assert_same(g_got, g_want)


def test_hedgehog_map_properties():
    fmap = HedgehogFeatureMap(3, 8)
    x = torch.randn(2, 3, 5, 8)
    y = fmap(x)
    assert y.shape == (2, 3, 5, 16) and fmap.out_features == 16
    assert (y > 0).all()
    # Identity init: the map is softmax(x) ++ softmax(-x) before any training.
    torch.testing.assert_close(y, torch.cat([x.softmax(-1), (-x).softmax(-1)], -1))
    assert sum(p.numel() for p in fmap.parameters() if p.requires_grad) == 3 * 8 * 8 + 3 * 8
    with pytest.raises(ValueError):
        fmap(torch.randn(2, 4, 5, 8))


def test_hedgehog_one_token_path_equals_many_rows_and_follows_updates():
    """A single token (a decode step) takes a product with W alone and negates it; it must give the
    rows of the [W, -W] path, and the fp32 weights kept between calls must follow an in-place update
    (an optimizer step) of the parameters."""
    fmap = HedgehogFeatureMap(3, 8)
    with torch.no_grad():
        fmap.weight.normal_()
        fmap.bias.normal_()
    x = torch.randn(1, 3, 6, 8)
    with torch.no_grad():
        for _ in range(2):
            rows = fmap(x)
            for t in range(x.shape[2]):
                torch.testing.assert_close(fmap(x[:, :, t : t + 1]), rows[:, :, t : t + 1])
            fmap.weight.mul_(-0.5)  # in place: the next round must see it
            fmap.bias.add_(1.0)
        proj = x @ fmap.weight + fmap.bias
        want = torch.cat([torch.softmax(proj, -1), torch.softmax(-proj, -1)], -1)
        torch.testing.assert_close(fmap(x[:, :, :1]), want[:, :, :1])


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_key_padding_mask_matches_naive(backend, formulation):
    """Left padding, a gap longer than the window (queries whose window is empty but whose linear
    part is not), and a fully padded row (zeros, finite gradients)."""
    B, H, T, D, w = 3, 2, 30, 8, 4
    q, k, v, wl, ll = make_inputs(B, H, T, D, seed=3)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :7] = False
    mask[1, 10:17] = False
    mask[2, :] = False
    leaves = [q, k, v, wl, ll]
    want = naive(q, k, v, wl, ll, w, formulation, mask=mask)
    got = BACKENDS[backend](q, k, v, wl, ll, window=w, formulation=formulation, key_padding_mask=mask)
    assert_same(got, want)
    assert (got[2] == 0).all()
    got_grads = grads(got, leaves)
    assert all(torch.isfinite(g).all() for g in got_grads)
    for g_got, g_want in zip(got_grads, grads(want, leaves)):
        assert_same(g_got, g_want)


@pytest.mark.parametrize("backend", ["reference", "chunked", "chunked_small_slabs"])
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
@pytest.mark.parametrize("pad", [3, 11])
def test_left_padding_equals_unpadded(backend, formulation, pad):
    H, T, D, w = 2, 21, 8, 8
    q, k, v, wl, ll = make_inputs(1, H, T, D, seed=4)
    junk = torch.randn(1, H, pad, D)
    qp, kp, vp = (torch.cat([junk, x], dim=2) for x in (q, k, v))
    mask = torch.ones(1, pad + T, dtype=torch.bool)
    mask[:, :pad] = False
    plain = BACKENDS[backend](q, k, v, wl, ll, window=w, formulation=formulation)
    padded = BACKENDS[backend](qp, kp, vp, wl, ll, window=w, formulation=formulation, key_padding_mask=mask)
    assert_same(padded[:, :, pad:], plain)


def test_seed_naive_matches_naive():
    for B, H, T, D, w in [(2, 2, 37, 8, 8), (1, 2, 5, 8, 8), (1, 2, 70, 8, 64)]:
        q, k, v, wl, ll = make_inputs(B, H, T, D)
        assert_same(hybrid_attention_seed_naive(q, k, v, wl, ll, window=w)[0], naive(q, k, v, wl, ll, w))


def test_seed_naive_through_dispatcher():
    q, k, v, wl, ll = make_inputs(1, 2, 40, 8)
    assert_same(hybrid_attention(q, k, v, wl, ll, window=8, backend="seed_naive")[0], naive(q, k, v, wl, ll, 8))
    with pytest.raises(ValueError, match="seed_naive"):
        hybrid_attention(q, k, v, wl, ll, window=8, backend="seed_naive", formulation="lolcats")[0]


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_chunked_window_longer_than_sequence(formulation):
    """w >= T: the op is causal softmax over the prefix; chunked must not pay for the full window."""
    q, k, v, wl, ll = make_inputs(2, 2, 30, 8)
    got = hybrid_attention_chunked(q, k, v, wl, ll, window=4096, formulation=formulation)[0]
    assert_same(got, naive(q, k, v, wl, ll, 4096, formulation))


def test_window_only_equals_local_softmax_and_linear_off():
    """Sanity of the semantics: with the linear part switched off the op is sliding-window softmax,
    and for T <= w it is exactly causal softmax attention."""
    B, H, T, D = 1, 2, 16, 8
    q, k, v, wl, _ = make_inputs(B, H, T, D)
    off = torch.full((H,), -1e4)  # sigmoid -> 0
    for backend in ("reference", "chunked"):
        got = hybrid_attention(q, k, v, wl, off, window=T, backend=backend)[0]
        assert_same(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_no_quadratic_or_d2_tensor_in_chunked():
    """Chunked never allocates a tensor with O(T^2) or O(T*D^2) elements (checked on every
    intermediate autograd saves and every op output via a dispatch-mode probe)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    B, H, T, D, w = 1, 1, 2048, 16, 16
    biggest = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor):
                    biggest.append(o.numel())
            return out

    q, k, v, wl, ll = make_inputs(B, H, T, D)
    with Probe():
        out = hybrid_attention_chunked(q, k, v, wl, ll, window=w)[0]
        out.sum().backward()
    # O(T*D^2) would be 2048*256 = 524288 elements; the inputs themselves are T*D = 32768.
    assert max(biggest) <= 4 * T * D


def test_dtype_and_errors(monkeypatch):
    q, k, v, wl, ll = (x.detach() for x in make_inputs(1, 2, 10, 8))
    out = hybrid_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), wl, ll, window=4)[0]
    assert out.dtype == torch.bfloat16
    q16, k16, v16 = (x.bfloat16().float() for x in (q, k, v))
    torch.testing.assert_close(out.float(), naive(q16, k16, v16, wl, ll, 4), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="backend"):
        hybrid_attention(q, k, v, wl, ll, backend="flash")[0]
    with pytest.raises(ValueError, match="formulation"):
        hybrid_attention(q, k, v, wl, ll, formulation="nope")[0]
    with pytest.raises(ValueError, match="HedgehogFeatureMap"):
        hybrid_attention(q, k, v, wl, ll, feature_map="hedgehog")[0]
    with pytest.raises(ValueError, match="window_logit"):
        hybrid_attention(q, k, v, wl[:1], ll)[0]
    with pytest.raises(ValueError, match="key_padding_mask"):
        hybrid_attention(q, k, v, wl, ll, key_padding_mask=torch.ones(1, 9, dtype=torch.bool))[0]
    # backend="triton" names the cause when the kernels cannot be loaded...
    monkeypatch.setattr(dispatch, "_load_triton", lambda module, attr: (None, "ImportError: no triton"))
    with pytest.raises(RuntimeError, match="triton.*unavailable.*no triton"):
        hybrid_attention(q, k, v, wl, ll, backend="triton")[0]
    # ...while "auto" on CPU never needs them.
    assert_same(hybrid_attention(q, k, v, wl, ll, window=4, backend="auto")[0], naive(q, k, v, wl, ll, 4))


def test_auto_falls_back_when_triton_declines(monkeypatch):
    q, k, v, wl, ll = (x.detach() for x in make_inputs(1, 2, 10, 8))
    calls = []

    def declines(*args, **kwargs):
        calls.append(1)
        raise NotImplementedError("option not supported")

    monkeypatch.setattr(dispatch, "_load_triton", lambda module, attr: (declines, ""))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    out = hybrid_attention(q, k, v, wl, ll, window=4, backend="auto")[0]
    monkeypatch.undo()
    assert calls == [1]
    assert_same(out, naive(q, k, v, wl, ll, 4))


def test_elu1_is_positive():
    x = torch.linspace(-15, 20, 101)  # (below about -17, exp(x) - 1 rounds to -1 in fp32)
    assert (elu1(x) > 0).all()
    torch.testing.assert_close(elu1(x), F.elu(x) + 1)


def test_chunked_inference_path_writes_slabs_in_place():
    """Without autograd the chunked backend fills a preallocated output slab by slab."""
    B, H, T, D, w = 2, 2, 45, 8, 4
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, T, D, seed=6))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :9] = False
    with torch.no_grad():
        got = run_chunked_small_slabs(q, k, v, wl, ll, window=w, key_padding_mask=mask)
    assert not got.requires_grad
    assert_same(got, naive(q, k, v, wl, ll, w, mask=mask))


@pytest.mark.parametrize("T", [16, 45])  # whole slabs; a ragged last slab
@pytest.mark.parametrize("chunk", [4, 8])  # one window block per chunk; two
def test_chunked_inference_output_is_laid_out_for_the_layer(T, chunk):
    """At inference the output [B, H, T, D] has [B, T, H, D] memory, so the layer's transpose back
    to [B, T, H * D] copies nothing; values equal the naive formula, GQA and several slabs included."""
    B, H, Hk, D, w = 2, 4, 2, 8, 4
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, T, D, seed=8, kv_heads=Hk))
    for formulation in ("hybrid", "lolcats", "window"):
        with torch.no_grad():
            got, _ = hybrid_attention_chunked(q, k, v, wl, ll, window=w, formulation=formulation, chunk_size=chunk,
                                              slab_size=2 * chunk)
        assert got.transpose(1, 2).is_contiguous()
        want = naive(q, expand(k, H), expand(v, H), wl, ll, w, formulation=formulation)
        assert_same(got, want)


# ---- GQA: chunked reads k/v at the KV heads (phi(k), chunk states and carry once per KV head).

# T: shorter than the window; three slabs with a ragged tail; five slabs with a ragged tail.
# (T, window, chunk_size, slab_size), small blocks passed explicitly to keep the cases fast.
GQA_LAYOUTS = [(5, 8, 8, 16), (70, 8, 16, 32), (1100, 16, 32, 256)]


def gqa_mask(B, T, w):
    """Left padding in row 0, a gap longer than the window in row 1."""
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, : min(3, T - 1)] = False
    mask[1, T // 3 : T // 3 + 2 * w + 1] = False
    return mask


def group_sum(x, kv_heads):
    """Gradient w.r.t. expanded k/v [B, H, T, D] -> w.r.t. the KV heads: sum over each group."""
    B, H, T, D = x.shape
    return x.view(B, kv_heads, H // kv_heads, T, D).sum(dim=2)


@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=lambda h: "H{}Hkv{}".format(*h))
@pytest.mark.parametrize("layout", GQA_LAYOUTS, ids=lambda s: "T{}w{}C{}P{}".format(*s))
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_chunked_native_gqa_matches_reference_on_expanded_kv(heads, layout, formulation, padded):
    (H, Hk), (T, w, C, P), B, D = heads, layout, 2, 8
    q, k, v, wl, ll = make_inputs(B, H, T, D, seed=7, kv_heads=Hk)
    mask = gqa_mask(B, T, w) if padded else None
    kw = dict(window=w, formulation=formulation, key_padding_mask=mask)
    got = hybrid_attention_chunked(q, k, v, wl, ll, chunk_size=C, slab_size=P, **kw)[0]
    assert got.shape == (B, H, T, D) and got.dtype == q.dtype
    ke, ve = (expand(x, H).detach().requires_grad_() for x in (k, v))  # leaves: grads per query head
    want = hybrid_attention(q, ke, ve, wl, ll, backend="reference", **kw)[0]
    assert_same(got, want)
    g_q, g_k, g_v, g_wl, g_ll = grads(got, [q, k, v, wl, ll])
    w_q, w_ke, w_ve, w_wl, w_ll = grads(want, [q, ke, ve, wl, ll])
    assert g_k.shape == k.shape and g_v.shape == v.shape
    pairs = [(g_q, w_q), (g_k, group_sum(w_ke, Hk)), (g_v, group_sum(w_ve, Hk)), (g_wl, w_wl), (g_ll, w_ll)]
    for g_got, g_want in pairs:
        assert_same(g_got, g_want)
    # Same blocks, k/v expanded first (the former dispatcher path): the same numbers.
    old = hybrid_attention_chunked(q, expand(k, H), expand(v, H), wl, ll, chunk_size=C, slab_size=P, **kw)[0]
    torch.testing.assert_close(got, old, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_dispatcher_passes_gqa_kv_to_chunked_unexpanded(monkeypatch, formulation):
    """backend='chunked' with elu1 never repeats k/v (default chunk and slab sizes: two slabs, the
    second ragged); the result matches the reference on expanded k/v."""
    B, H, Hk, T, D, w = 1, 6, 2, 1100, 8, 16
    q, k, v, wl, ll = make_inputs(B, H, T, D, seed=8, kv_heads=Hk)
    mask = gqa_mask(2, T, w)[1:]
    want = hybrid_attention(q, *ops.expand_kv(q, k, v), wl, ll, window=w, formulation=formulation,
                            key_padding_mask=mask, backend="reference")[0]

    def no_expand(*args):
        raise AssertionError("expand_kv called on the native GQA path")

    monkeypatch.setattr(chunked_module, "expand_kv", no_expand)  # chunked must read the KV heads in place
    got, _ = hybrid_attention(
        q, k, v, wl, ll, window=w, formulation=formulation, key_padding_mask=mask, backend="chunked"
    )
    assert_same(got, want)


def test_chunked_gqa_with_per_head_feature_map_expands_kv(monkeypatch):
    """A per-head callable map (Hedgehog) sees k at the H query heads: chunked expands k/v first."""
    B, H, Hk, T, D, w = 2, 4, 2, 45, 8, 4
    fmap = HedgehogFeatureMap(H, D, feature_dim=6)
    with torch.no_grad():
        fmap.weight.add_(0.3 * torch.randn(fmap.weight.shape, generator=torch.Generator().manual_seed(5)))
    q, k, v, wl, ll = make_inputs(B, H, T, D, seed=9, kv_heads=Hk)
    leaves = [q, k, v, wl, ll, fmap.weight, fmap.bias]
    want = naive(q, expand(k, H), expand(v, H), wl, ll, w, phi=fmap)
    calls = []
    expand_kv = ops.expand_kv
    monkeypatch.setattr(chunked_module, "expand_kv", lambda *a: calls.append(1) or expand_kv(*a))
    got = hybrid_attention_chunked(q, k, v, wl, ll, window=w, feature_map=fmap, chunk_size=w, slab_size=2 * w)[0]
    assert calls == [1]
    assert_same(got, want)
    for g_got, g_want in zip(grads(got, leaves), grads(want, leaves)):
        assert_same(g_got, g_want)


def test_chunked_gqa_shape_errors():
    q = torch.randn(1, 6, 10, 8)
    for k, v in [
        (torch.randn(1, 4, 10, 8), torch.randn(1, 4, 10, 8)),  # 6 % 4 != 0
        (torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)),  # T differs
        (torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)),  # D differs
        (torch.randn(1, 2, 10, 8), torch.randn(1, 3, 10, 8)),  # v's heads differ from k's
    ]:
        with pytest.raises(ValueError, match="GQA"):
            hybrid_attention_chunked(q, k, v, torch.zeros(6), torch.zeros(6), window=4)[0]
    with pytest.raises(ValueError, match="window_logit"):
        hybrid_attention_chunked(q, q[:, :2], q[:, :2], torch.zeros(2), torch.zeros(6), window=4)[0]


def perturbed_hedgehog(heads, D, seed, feature_dim=None):
    fmap = HedgehogFeatureMap(heads, D, feature_dim=feature_dim)
    with torch.no_grad():  # move away from the identity init so the map matters
        fmap.weight.add_(0.3 * torch.randn(fmap.weight.shape, generator=torch.Generator().manual_seed(seed)))
        fmap.bias.add_(0.1 * torch.randn(fmap.bias.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return fmap


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("padded", [False, True])
def test_query_key_map_pair_with_gqa(backend, formulation, padded):
    """A (query_map, key_map) pair: the key map works at the KV heads, its features are shared by
    the query heads of a group; gradients reach both maps' parameters."""
    B, H, Hk, T, D, w = 2, 4, 2, 29, 8, 4
    q, k, v, wl, ll = make_inputs(B, H, T, D, seed=3, kv_heads=Hk)
    fq, fk = perturbed_hedgehog(H, D, 11), perturbed_hedgehog(Hk, D, 13)
    mask = None
    if padded:
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, :6] = False
    leaves = [q, k, v, wl, ll, fq.weight, fq.bias, fk.weight, fk.bias]
    want = naive(q, expand(k, H), expand(v, H), wl, ll, w, formulation, phi=fq, mask=mask,
                 k_features=expand(fk(k), H))
    got = BACKENDS[backend](q, k, v, wl, ll, window=w, formulation=formulation, feature_map=(fq, fk),
                            key_padding_mask=mask)
    assert_same(got, want)
    for g_got, g_want in zip(grads(got, leaves), grads(want, leaves)):
        assert_same(g_got, g_want)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_window_formulation_is_sliding_window_softmax(backend):
    """formulation='window' is softmax over the last w keys, whatever the logits."""
    B, H, T, D, w = 2, 2, 23, 8, 5
    q, k, v, wl, ll = make_inputs(B, H, T, D, seed=4)
    band = torch.ones(T, T, dtype=torch.bool).tril() & ~torch.ones(T, T, dtype=torch.bool).tril(-w)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    got = BACKENDS[backend](q, k, v, wl, ll, window=w, formulation="window")
    assert_same(got, want)
    g_ll = torch.autograd.grad(got.sum(), ll, allow_unused=True, materialize_grads=True)[0]
    assert torch.equal(g_ll, torch.zeros_like(ll))


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "pair"])
def test_window_share_splits_the_output(formulation, fmap):
    """The output is share * (window average) + (1 - share) * (linear average), per query: solve for
    the share from three runs of the op (full, window-only, linear-only) and compare."""
    from hybrid_llama.ops.hybrid.reference import window_share

    B, H, Hk, T, D, w = 1, 4, 2, 40, 8, 6
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, T, D, seed=8, kv_heads=Hk))
    feature_map = "elu1" if fmap == "elu1" else (perturbed_hedgehog(H, D, 1), perturbed_hedgehog(Hk, D, 2))
    run = lambda f, wl_, ll_: hybrid_attention(q, k, v, wl_, ll_, window=w, formulation=f, feature_map=feature_map,  # noqa: E731
                                               backend="reference")[0]
    with torch.no_grad():
        full = run(formulation, wl, ll)
        win_avg = run("window", wl, ll)
        lin_avg = run("hybrid", torch.full_like(wl, -1e4), ll)  # a = 0: the linear readout alone
        pos = torch.tensor([0, 5, 6, 20, 39])
        share = window_share(q, k, wl, ll, window=w, formulation=formulation, feature_map=feature_map,
                             query_positions=pos)
    assert share.shape == (B, H, len(pos))
    if formulation == "window":
        assert torch.equal(share, torch.ones_like(share))
        return
    solved = ((full - lin_avg) / (win_avg - lin_avg))[:, :, pos]  # [B, H, Q, D]: the same in every channel
    has_lin = pos >= w
    torch.testing.assert_close(solved[:, :, has_lin], share[:, :, has_lin, None].expand_as(solved[:, :, has_lin]),
                               atol=1e-4, rtol=1e-3)
    assert torch.equal(share[:, :, ~has_lin], torch.ones_like(share[:, :, ~has_lin]))  # no old keys yet


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
def test_auto_inside_the_window_is_softmax_attention(formulation):
    """No key has left the window: 'auto' runs SDPA, which must equal the reference and keep the state."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 40, 16, generator=g) for h in (4, 2, 2))
    wl, ll = torch.randn(4, generator=g), torch.randn(4, generator=g)
    got, state = hybrid_attention(q, k, v, wl, ll, window=40, formulation=formulation, backend="auto",
                                  output_final_state=True)
    want, ref_state = hybrid_attention(q, k, v, wl, ll, window=40, formulation=formulation, backend="reference",
                                       output_final_state=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(state.k_window, ref_state.k_window) and not state.S.any()
