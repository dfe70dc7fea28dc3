"""The `triton` backend (prefill forward/backward, decode step) against an independent naive op.

Without CUDA the kernels run in triton's interpreter. TRITON_INTERPRET is read when a kernel is
decorated, i.e. when ``hybrid_llama.ops.triton.*`` is first imported, so it is set here before
those imports; if another test module imported them earlier in the same process, the CPU tests are
skipped with that reason (run this file in its own pytest process, as tests/run.sh does).
The interpreter computes bf16 ``tl.dot`` wrongly, so bf16 is only tested on a GPU.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
_PREIMPORTED = any(m in sys.modules for m in ("hybrid_llama.ops.triton.prefill", "hybrid_llama.ops.triton.decode"))
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from hybrid_llama.ops import (  # noqa: E402
    HedgehogFeatureMap,
    hybrid_attention,
    hybrid_attention_step,
    init_state,
    prefill_state,
)
from hybrid_llama.ops.hybrid.step import hybrid_attention_step_torch  # noqa: E402
from hybrid_llama.ops.triton import prefill as triton_prefill  # noqa: E402
from hybrid_llama.ops.triton.decode import hybrid_attention_step_triton  # noqa: E402
from hybrid_llama.ops.triton.prefill import _fwd_kernel, hybrid_attention_triton  # noqa: E402

if not HAS_CUDA and (_PREIMPORTED or type(_fwd_kernel).__name__ != "InterpretedFunction"):
    pytest.skip(
        "triton kernels were imported before TRITON_INTERPRET=1 was set (another test module imported "
        "hybrid_llama.ops.triton.*); run `TRITON_INTERPRET=1 pytest tests/test_triton.py` in its own process",
        allow_module_level=True,
    )

DEV = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# ----------------------------------------------------------------------------- independent naive op


def naive_hybrid(q, k, v, window_logit, linear_logit, window, formulation="hybrid", mask=None):
    """O(T^2) masked transcription of docs/design.md "ops", in float64; k/v may hold KV heads."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T, D = q.shape[2], q.shape[3]
    t = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    win = ((j <= t) & (j >= t - window + 1))[None, None]
    lin = (j <= t - window)[None, None]
    if mask is not None:
        win = win & mask[:, None, None, :]
        lin = lin & mask[:, None, None, :]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~win, float("-inf"))
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    e = torch.exp(s - mx)
    e_sum = e.sum(-1, keepdim=True)

    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))

    A = (phi(q) @ phi(k).transpose(-1, -2)) * lin
    a = torch.sigmoid(window_logit.double())[None, :, None, None]
    b = torch.sigmoid(linear_logit.double())[None, :, None, None]
    present = e_sum > 0
    if formulation == "window":  # the softmax window alone; zeros without a real key
        return torch.where(present, e @ v / torch.where(present, e_sum, torch.ones_like(e_sum)), torch.zeros_like(q))
    if formulation == "hybrid":
        num = a * (e @ v) / torch.where(present, e_sum, torch.ones_like(e_sum)) + b * (A @ v)
        den = a * present + b * A.sum(-1, keepdim=True)
    else:
        num = a * (e @ v) + b * (A @ v)
        den = a * e_sum + b * A.sum(-1, keepdim=True)
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def make_inputs(B, H, HKV, T, D, dtype, seed=0, logit_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, HKV, HKV))
    wl, ll = torch.randn(H, generator=g) * logit_scale, torch.randn(H, generator=g) * logit_scale
    q, k, v = (x.to(DEV, dtype).requires_grad_() for x in (q, k, v))
    wl, ll = (x.to(DEV).requires_grad_() for x in (wl, ll))
    return q, k, v, wl, ll


def check_op(T, D, window, *, H=4, HKV=2, B=1, dtype=torch.float32, formulation="hybrid", mask_p=None,
             block=None, tol=None, seed=0):
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, dtype, seed)
    mask = None
    if mask_p is not None:
        mask = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1)) > mask_p
        mask[0, : min(T, 3)] = False  # leading padding: queries with an empty window (zeros out)
        mask = mask.to(DEV)
    out = hybrid_attention_triton(q, k, v, wl, ll, window=window, formulation=formulation,
                                  key_padding_mask=mask, block_size=block)[0]
    assert out.dtype == dtype and out.shape == q.shape
    ref = naive_hybrid(q, k, v, wl, ll, window, formulation, mask)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2)).to(DEV)
    grads = torch.autograd.grad(out, (q, k, v, wl, ll), dout.to(dtype))
    # (materialize: the window formulation does not use the logits, their gradients are zero)
    ref_grads = torch.autograd.grad(ref, (q, k, v, wl, ll), dout.double(), allow_unused=True, materialize_grads=True)
    atol, rtol = tol or ((2e-5, 1e-4) if dtype == torch.float32 else (2e-2, 2e-2))
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    for name, got, want in zip(("dq", "dk", "dv", "dwindow_logit", "dlinear_logit"), grads, ref_grads):
        assert torch.isfinite(got).all(), name
        # Logit gradients sum over all positions: compare relative to their scale.
        scale = max(1.0, want.abs().max().item()) if name.startswith("dw") or name.startswith("dl") else 1.0
        torch.testing.assert_close(
            got.double(), want.double(), atol=atol * scale * 4, rtol=rtol * 4, msg=lambda m, name=name: f"{name}: {m}"
        )


# --------------------------------------------------------------------------------------- prefill

# (T, D, window, block, formulation, padding probability). GQA H=4 over 2 KV heads throughout.
FP32_CASES = [
    (1, 16, 64, None, "hybrid", None),
    (7, 64, 16, None, "hybrid", None),
    (63, 16, 64, None, "hybrid", None),
    (64, 16, 16, None, "hybrid", None),
    (65, 64, 64, None, "hybrid", None),
    (200, 16, 64, None, "hybrid", None),
    (200, 16, 16, None, "hybrid", None),  # window < block
    (200, 16, 48, 32, "hybrid", None),  # window not a multiple of the block: 3 key blocks
    (150, 16, 16, 16, "hybrid", 0.3),  # padding
    (200, 16, 64, None, "lolcats", None),
    (130, 16, 20, 16, "lolcats", 0.3),
    (7, 16, 64, None, "lolcats", None),
    (40, 128, 16, None, "hybrid", None),  # D = 128 (default block 32)
    (33, 32, 8, None, "lolcats", None),
    (130, 16, 20, 16, "window", 0.3),  # window only: the linear part compiled out
]


@pytest.mark.parametrize("T,D,window,block,formulation,mask_p", FP32_CASES)
def test_prefill_fp32(T, D, window, block, formulation, mask_p):
    check_op(T, D, window, block=block, formulation=formulation, mask_p=mask_p)


def test_prefill_fp32_d64_long():
    check_op(200, 64, 64, B=2, H=2, HKV=1)


@pytest.mark.parametrize(
    "T,D,window,formulation", [(65, 64, 16, "hybrid"), (200, 16, 64, "hybrid"), (130, 16, 64, "lolcats")]
)
def test_prefill_fp16(T, D, window, formulation):
    check_op(T, D, window, dtype=torch.float16, formulation=formulation)


def test_matches_reference_backend_through_dispatcher():
    """Expanded k/v (H_kv = H) through ``hybrid_attention(backend="triton")`` vs the `reference` backend."""
    q, k, v, wl, ll = make_inputs(2, 2, 2, 70, 16, torch.float32, seed=3, logit_scale=3.0)
    out = hybrid_attention(q, k, v, wl, ll, window=16, backend="triton")[0]
    ref = hybrid_attention(q, k, v, wl, ll, window=16, backend="reference")[0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    g = torch.autograd.grad(out.square().sum(), (q, k, v, wl, ll))
    rg = torch.autograd.grad(ref.square().sum(), (q, k, v, wl, ll))
    for got, want in zip(g, rg):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_unsupported_options_raise_not_implemented():
    q, k, v, wl, ll = make_inputs(1, 2, 2, 8, 16, torch.float32)
    with pytest.raises(NotImplementedError):  # feature width 24: not a power of two
        hybrid_attention_triton(q, k, v, wl, ll, window=4, feature_map=lambda x: torch.cat([x, x[..., :8]], -1).exp())
    q24, k24, v24, _, _ = make_inputs(1, 2, 2, 8, 24, torch.float32)
    with pytest.raises(NotImplementedError):
        hybrid_attention_triton(q24, k24, v24, wl, ll, window=4)[0]
    # Hedgehog at D = 128 (F = 256): its [F, D] state does not fit the backward's shared memory.
    q128, k128, v128, _, _ = make_inputs(1, 2, 2, 8, 128, torch.float32)
    with pytest.raises(NotImplementedError):
        hybrid_attention_triton(
            q128, k128, v128, wl, ll, window=4, feature_map=make_feature_map("pair", 2, 2, 128, None)
        )[0]


# ------------------------------------------------------------- learned feature maps, window-only


def make_hedgehog(heads, head_dim, feature_dim=None, seed=0):
    """A HedgehogFeatureMap moved away from its identity start, so the test sees its parameters act."""
    fmap = HedgehogFeatureMap(heads, head_dim, feature_dim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        fmap.weight.add_(torch.randn(fmap.weight.shape, generator=g) * 0.5)
        fmap.bias.add_(torch.randn(fmap.bias.shape, generator=g) * 0.5)
    return fmap.to(DEV)


def make_feature_map(kind, H, HKV, D, feature_dim, seed=0):
    """("pair": query map at H heads, key map at H_kv heads; "single": one map of H heads; "elu1")."""
    if kind == "pair":
        return make_hedgehog(H, D, feature_dim, seed), make_hedgehog(HKV, D, feature_dim, seed + 1)
    if kind == "single":
        return make_hedgehog(H, D, feature_dim, seed)
    return "elu1"


def assert_same_gradients(out, ref, inputs, names, seed):
    """The gradients of ``out`` and ``ref`` with respect to ``inputs`` under one random upstream
    gradient agree (finite, and parameter gradients, which sum over positions, relative to their
    scale); returns ``out``'s."""
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2)).to(DEV)
    grads = torch.autograd.grad(out, inputs, dout, allow_unused=True, materialize_grads=True)
    ref_grads = torch.autograd.grad(ref, inputs, dout, allow_unused=True, materialize_grads=True)
    for name, got, want in zip(names, grads, ref_grads):
        assert torch.isfinite(got).all(), name
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, atol=5e-5 * scale, rtol=4e-4, msg=lambda m, name=name: f"{name}: {m}")
    return grads


def map_params(fmap):
    maps = fmap if isinstance(fmap, tuple) else (fmap,) if isinstance(fmap, torch.nn.Module) else ()
    return [p for m in maps for p in m.parameters()]


def random_padding(B: int, T: int, mask_p: float | None, seed: int):
    """A key padding mask with each key padded at probability ``mask_p`` and row 0's first keys
    padded (None without ``mask_p``)."""
    if mask_p is None:
        return None
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1)) > mask_p
    mask[0, : min(T, 3)] = False
    return mask.to(DEV)


def check_features_op(
    T, D, window, kind, *, feature_dim=None, H=4, HKV=2, B=1, formulation="hybrid", mask_p=None, block=None, seed=0
):
    """Triton (maps applied in torch, features read by the kernels) vs the `reference` backend with the
    same maps: output and the gradients of q, k, v, both logits and every parameter of the maps, fp32."""
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.float32, seed, logit_scale=2.0)
    fmap = make_feature_map(kind, H, HKV, D, feature_dim, seed)
    mask = random_padding(B, T, mask_p, seed)
    kw = dict(window=window, formulation=formulation, feature_map=fmap, key_padding_mask=mask)
    out = hybrid_attention_triton(q, k, v, wl, ll, block_size=block, **kw)[0]
    ref = hybrid_attention(q, k, v, wl, ll, backend="reference", **kw)[0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    inputs = (q, k, v, wl, ll, *map_params(fmap))
    names = ("dq", "dk", "dv", "dwindow_logit", "dlinear_logit") + tuple(f"dmap{i}" for i in range(len(inputs) - 5))
    # The window formulation leaves the logits and the maps out of the graph: their gradients are zero.
    grads = assert_same_gradients(out, ref, inputs, names, seed)
    if formulation == "window":
        assert all(not g.any() for g in grads[3:])
    return out


# (map, T, D, feature_dim -> F = 2 * feature_dim, window, block, formulation, padding probability);
# H = 4 over 2 KV heads.
FEATURE_CASES = [
    ("pair", 100, 16, 16, 16, 32, "hybrid", 0.3),  # F = 32 != D = 16, keys mapped at the KV heads
    ("pair", 90, 16, 16, 20, 16, "lolcats", 0.3),  # window not a multiple of the block
    ("pair", 70, 16, 16, 16, 32, "window", 0.3),
    ("pair", 70, 32, 8, 16, 32, "hybrid", None),  # F = 16 < D = 32
    ("single", 70, 16, 16, 16, 32, "hybrid", 0.3),  # one per-head map: k/v expanded to the 4 heads
    ("elu1", 70, 16, None, 16, 32, "window", 0.3),  # window-only on the elu1 kernels
]


@pytest.mark.parametrize("kind,T,D,feature_dim,window,block,formulation,mask_p", FEATURE_CASES)
def test_prefill_feature_maps_vs_reference(kind, T, D, feature_dim, window, block, formulation, mask_p):
    check_features_op(T, D, window, kind, feature_dim=feature_dim, block=block, formulation=formulation, mask_p=mask_p)


def test_dispatcher_runs_feature_kernels(monkeypatch):
    """``hybrid_attention(backend="triton")`` with a (query_map, key_map) pair runs the kernels on the
    features (never chunked) and gets the reference's output and map gradients; the decode dispatcher
    runs the triton step with the pair."""
    import hybrid_llama.ops.hybrid.chunked as chunked

    def no_chunked(*args, **kwargs):
        raise AssertionError("fell back to chunked")

    calls = []
    apply = triton_prefill._HybridAttentionTriton.apply

    def spy(*args):
        calls.append(args[5] is not None and args[6] is not None)  # phi_q, phi_k handed to the kernels
        return apply(*args)

    monkeypatch.setattr(chunked, "hybrid_attention_chunked", no_chunked)
    monkeypatch.setattr(triton_prefill._HybridAttentionTriton, "apply", spy)
    q, k, v, wl, ll = make_inputs(1, 4, 2, 40, 16, torch.float32, seed=21)
    pair = make_feature_map("pair", 4, 2, 16, None, seed=21)
    out = hybrid_attention(q, k, v, wl, ll, window=16, backend="triton", feature_map=pair)[0]
    ref = hybrid_attention(q, k, v, wl, ll, window=16, backend="reference", feature_map=pair)[0]
    assert calls == [True]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    params = map_params(pair)
    g = torch.autograd.grad(out.square().sum(), params)
    rg = torch.autograd.grad(ref.square().sum(), params)
    for got, want in zip(g, rg):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    import hybrid_llama.ops.dispatch as ops

    monkeypatch.setattr(ops, "hybrid_attention_step_torch", no_chunked)
    with torch.no_grad():
        st = prefill_state(k[:, :, :39], v[:, :, :39], window=16, feature_map=pair)
        o, new = hybrid_attention_step(
            q[:, :, 39:], k[:, :, 39:], v[:, :, 39:], st, wl, ll, feature_map=pair, backend="triton"
        )
    torch.testing.assert_close(o, ref[:, :, 39:].detach(), atol=2e-5, rtol=1e-4)
    assert new.S.shape == (1, 2, 32, 16) and new.seen == 40


# ---------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("formulation,window,pad", [("hybrid", 8, False), ("lolcats", 6, True), ("window", 5, True)])
def test_decode_steps_match_parallel_op_and_torch_step(formulation, window, pad):
    B, H, HKV, T, D = 2, 4, 2, 21, 16
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, HKV, T, D, torch.float32, seed=5))
    valid = torch.ones(B, T, dtype=torch.bool, device=DEV)
    if pad:
        valid[1, :4] = False  # left padding of row 1
        valid[0, 9] = False
    rep = H // HKV
    st = init_state(B, HKV, D, window, device=DEV)
    st_torch = init_state(B, H, D, window, device=DEV)
    outs = []
    for t in range(T):
        sl = slice(t, t + 1)
        o, st = hybrid_attention_step_triton(
            q[:, :, sl],
            k[:, :, sl],
            v[:, :, sl],
            st,
            wl,
            ll,
            formulation=formulation,
            key_valid=valid[:, t],
            inplace=t % 2 == 1,
        )
        ke, ve = k[:, :, sl].repeat_interleave(rep, 1), v[:, :, sl].repeat_interleave(rep, 1)
        o_t, st_torch = hybrid_attention_step_torch(
            q[:, :, sl], ke, ve, st_torch, wl, ll, formulation=formulation, key_valid=valid[:, t]
        )
        torch.testing.assert_close(o, o_t, atol=1e-5, rtol=1e-5)
        outs.append(o)
    assert st.seen == T
    torch.testing.assert_close(st.S, st_torch.S[:, ::rep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.z, st_torch.z[:, ::rep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.k_window, st_torch.k_window[:, ::rep])
    assert torch.equal(st.window_valid, st_torch.window_valid)
    pre = prefill_state(k, v, window=window, key_padding_mask=valid)
    torch.testing.assert_close(st.S, pre.S, atol=1e-5, rtol=1e-5)
    par = hybrid_attention_triton(q, k, v, wl, ll, window=window, formulation=formulation, key_padding_mask=valid)[0]
    torch.testing.assert_close(torch.cat(outs, dim=2), par, atol=1e-5, rtol=1e-5)
    naive = naive_hybrid(q, k, v, wl, ll, window, formulation, valid).float()
    torch.testing.assert_close(par, naive, atol=1e-5, rtol=1e-5)


def steps_against_torch_step(q, k, v, wl, ll, valid, w, fmap, formulation, F, log_decay=None):
    """Every token through the triton step (in place on odd steps) and the torch step from empty
    states: outputs, S and z agree at each step. Returns (the triton outputs, both final states)."""
    B, HKV, T, D = k.shape
    st = init_state(B, HKV, D, w, feature_dim=F, device=DEV)
    st_torch = init_state(B, HKV, D, w, feature_dim=F, device=DEV)
    outs = []
    for t in range(T):
        sl = slice(t, t + 1)
        kw = dict(feature_map=fmap, formulation=formulation, key_valid=valid[:, t], log_decay=log_decay)
        o, st = hybrid_attention_step_triton(q[:, :, sl], k[:, :, sl], v[:, :, sl], st, wl, ll, inplace=t % 2 == 1,
                                             **kw)
        o_t, st_torch = hybrid_attention_step_torch(q[:, :, sl], k[:, :, sl], v[:, :, sl], st_torch, wl, ll, **kw)
        torch.testing.assert_close(o, o_t, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.S, st_torch.S, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.z, st_torch.z, atol=1e-5, rtol=1e-5)
        outs.append(o)
    return outs, st, st_torch


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
def test_decode_steps_with_feature_pair_match_torch_step(formulation):
    """A Hedgehog (query_map, key_map) pair (F = 32, D = 16, GQA 4 over 2): the triton step (phi(q)
    and the evicted phi(k) computed in torch, read by the kernel) equals the torch step in outputs
    and states, including evictions of padded slots; prefill_state and the parallel op agree."""
    B, H, HKV, T, D, w = 2, 4, 2, 15, 16, 4
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, HKV, T, D, torch.float32, seed=9, logit_scale=2.0))
    pair = make_feature_map("pair", H, HKV, D, None, seed=9)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEV)
    valid[1, :3] = False  # left padding of row 1: evicted at steps 4..6
    valid[0, 5] = False  # a padded slot inside row 0, evicted at step 9
    F = 2 * D
    with torch.no_grad():
        outs, st, st_torch = steps_against_torch_step(q, k, v, wl, ll, valid, w, pair, formulation, F)
        assert st.seen == T and st.S.shape == (B, HKV, F, D)
        assert torch.equal(st.window_valid, st_torch.window_valid) and torch.equal(st.k_window, st_torch.k_window)
        pre = prefill_state(k, v, window=w, feature_map=pair, key_padding_mask=valid)
        torch.testing.assert_close(st.S, pre.S, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.z, pre.z, atol=1e-5, rtol=1e-5)
        par = hybrid_attention_triton(
            q, k, v, wl, ll, window=w, formulation=formulation, feature_map=pair, key_padding_mask=valid
        )[0]
    torch.testing.assert_close(torch.cat(outs, dim=2), par, atol=1e-5, rtol=1e-5)


def test_decode_is_functional_by_default():
    B, H, D, w = 1, 2, 16, 4
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, H, 6, D, torch.float32, seed=7))
    st = prefill_state(k[:, :, :5], v[:, :, :5], window=w)
    before = [x.clone() for x in (st.k_window, st.v_window, st.window_valid, st.S, st.z)]
    _, new = hybrid_attention_step(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], st, wl, ll, backend="triton")
    for old, now in zip(before, (st.k_window, st.v_window, st.window_valid, st.S, st.z)):
        assert torch.equal(old, now)
    assert st.seen == 5 and new.seen == 6 and not torch.equal(new.S, st.S)


def test_decode_step_with_grad_falls_back_to_torch():
    """The kernel has no backward: with grad it raises NotImplementedError and the dispatcher uses torch."""
    B, H, D, w = 1, 2, 16, 4
    q, k, v, wl, ll = make_inputs(B, H, H, 3, D, torch.float32, seed=8)
    st = init_state(B, H, D, w, device=DEV)
    with pytest.raises(NotImplementedError):
        hybrid_attention_step_triton(q[:, :, :1], k[:, :, :1], v[:, :, :1], st, wl, ll)
    out, _ = hybrid_attention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], st, wl, ll)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# -------------------------------------------------------------------------- decaying linear state

# log gamma per KV head: a long memory and a short one (gamma 0.3: ages past ~60 underflow to 0).
LOG_DECAY = (math.log(0.97), math.log(0.3))


def check_decay_op(T, D, window, kind, *, feature_dim=None, H=4, HKV=2, B=1, formulation="hybrid", mask_p=None,
                   block=None, seed=0):
    """Triton with ``log_decay`` vs the chunked torch path with it: output, final state, and the
    gradients of q, k, v, both logits, log_decay and the maps' parameters, fp32."""
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.float32, seed, logit_scale=2.0)
    ld = torch.tensor(LOG_DECAY[:HKV], device=DEV).requires_grad_()
    fmap = make_feature_map(kind, H, HKV, D, feature_dim, seed)
    mask = random_padding(B, T, mask_p, seed)
    kw = dict(window=window, formulation=formulation, feature_map=fmap, key_padding_mask=mask, log_decay=ld,
              output_final_state=True)
    out, st = hybrid_attention_triton(q, k, v, wl, ll, block_size=block, **kw)
    ref, ref_st = hybrid_attention_chunked(q, k, v, wl, ll, **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for name in ("S", "z", "k_window", "v_window", "window_valid"):
        torch.testing.assert_close(getattr(st, name), getattr(ref_st, name), atol=1e-5, rtol=1e-5, msg=name)
    assert st.seen == ref_st.seen == T
    inputs = (q, k, v, wl, ll, ld, *map_params(fmap))
    names = ("dq", "dk", "dv", "dwindow_logit", "dlinear_logit", "dlog_decay")
    names += tuple(f"dmap{i}" for i in range(len(inputs) - len(names)))
    grads = assert_same_gradients(out, ref, inputs, names, seed)
    if formulation == "window":
        assert not grads[5].any()
    else:
        assert grads[5].abs().min() > 0  # both heads' decays are trained
    return out


# (map, T, D, feature_dim, window, block, formulation, padding probability); H = 4 over 2 KV heads.
DECAY_CASES = [
    ("elu1", 150, 16, None, 20, 16, "hybrid", 0.3),  # window not a multiple of the block, padding
    ("elu1", 200, 16, None, 48, 32, "lolcats", None),  # 3 key blocks
    ("elu1", 130, 32, None, 16, None, "hybrid", None),  # default block (64 > window)
    ("elu1", 90, 16, None, 20, 16, "window", 0.3),  # no linear part: the decay's gradient is zero
    ("pair", 100, 16, 16, 16, 32, "hybrid", 0.3),  # F = 32 != D, keys mapped at the KV heads
    ("pair", 90, 16, 16, 20, 16, "lolcats", None),
    ("single", 70, 16, 16, 16, 32, "hybrid", 0.3),  # k/v (and the decay) expanded to the 4 query heads
]


@pytest.mark.parametrize("kind,T,D,feature_dim,window,block,formulation,mask_p", DECAY_CASES)
def test_prefill_with_decay_vs_chunked(kind, T, D, feature_dim, window, block, formulation, mask_p):
    check_decay_op(T, D, window, kind, feature_dim=feature_dim, block=block, formulation=formulation, mask_p=mask_p)


def test_prefill_with_decay_vs_naive_and_gamma_one():
    """Against the independent naive op with the decay written in (key j at gamma^(t-w-j)), and
    log gamma = 0 gives the undecayed kernels' output exactly."""
    B, H, HKV, T, D, w = 2, 2, 1, 80, 16, 12
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, HKV, T, D, torch.float32, seed=31))
    ld = torch.tensor([math.log(0.9)], device=DEV)
    out = hybrid_attention_triton(q, k, v, wl, ll, window=w, block_size=16, log_decay=ld)[0]
    t = torch.arange(T, device=DEV)[:, None]
    j = torch.arange(T, device=DEV)[None, :]
    age = (t - w - j).clamp(min=0).double()
    # The naive op's linear scores take the decay through phi(k): scale each (t, j) pair by hand.
    qd, kd, vd = q.double(), k.double(), v.double()

    def phi(x):
        return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))

    s = (qd @ kd.transpose(-1, -2)) / math.sqrt(D)
    win = (j <= t) & (j > t - w)
    e = torch.exp(s.masked_fill(~win, float("-inf")) - s.masked_fill(~win, float("-inf")).amax(-1, keepdim=True))
    A = (phi(qd) @ phi(kd).transpose(-1, -2)) * (j <= t - w) * torch.exp(math.log(0.9) * age)
    a = torch.sigmoid(wl.double())[None, :, None, None]
    b = torch.sigmoid(ll.double())[None, :, None, None]
    want = (a * (e @ vd) / e.sum(-1, keepdim=True) + b * (A @ vd)) / (a + b * A.sum(-1, keepdim=True))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    plain = hybrid_attention_triton(q, k, v, wl, ll, window=w, block_size=16)[0]
    at_one = hybrid_attention_triton(q, k, v, wl, ll, window=w, block_size=16, log_decay=torch.zeros(1, device=DEV))[0]
    torch.testing.assert_close(at_one, plain, atol=1e-6, rtol=1e-6)


def test_dispatcher_runs_triton_with_decay(monkeypatch):
    """``backend="triton"`` takes the kernels with a decay (never chunked), prefill and step."""
    import hybrid_llama.ops.dispatch as ops
    import hybrid_llama.ops.hybrid.chunked as chunked

    def no_torch(*args, **kwargs):
        raise AssertionError("fell back to torch")

    q, k, v, wl, ll = make_inputs(1, 4, 2, 40, 16, torch.float32, seed=32)
    ld = torch.tensor(LOG_DECAY, device=DEV).requires_grad_()
    ref, ref_st = hybrid_attention(q, k, v, wl, ll, window=8, backend="chunked", log_decay=ld, output_final_state=True)
    monkeypatch.setattr(chunked, "hybrid_attention_chunked", no_torch)
    monkeypatch.setattr(ops, "hybrid_attention_step_torch", no_torch)
    out, st = hybrid_attention(q, k, v, wl, ll, window=8, backend="triton", log_decay=ld, output_final_state=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(st.S, ref_st.S, atol=1e-5, rtol=1e-5)
    g = torch.autograd.grad(out.square().sum(), (q, k, v, ld))
    rg = torch.autograd.grad(ref.square().sum(), (q, k, v, ld))
    for got, want in zip(g, rg):
        torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)
    with torch.no_grad():
        o, new = hybrid_attention_step(q[:, :, :1].detach(), k[:, :, :1].detach(), v[:, :, :1].detach(), st, wl, ll,
                                       backend="triton", log_decay=ld)
    assert new.seen == 41
    with pytest.raises(ValueError, match="no decaying linear state"):
        hybrid_attention(q, k, v, wl, ll, window=8, backend="seed_naive", log_decay=ld)
    with pytest.raises(NotImplementedError, match="inference-only"):  # log_decay requires grad
        hybrid_attention_step_triton(q[:, :, :1].detach(), k[:, :, :1].detach(), v[:, :, :1].detach(), st,
                                     wl.detach(), ll.detach(), log_decay=ld)


@pytest.mark.parametrize("kind,formulation", [("elu1", "hybrid"), ("elu1", "lolcats"), ("pair", "hybrid"),
                                              ("elu1", "window")])
def test_decode_steps_with_decay_match_torch_step(kind, formulation):
    """Step by step with a decay (GQA 4 over 2, padding evicted from the window): the triton step
    equals the torch step in outputs and states (S, z scaled by gamma before each fold); the final
    state equals prefill_state's decayed sums and the outputs the parallel triton op's."""
    B, H, HKV, T, D, w = 2, 4, 2, 17, 16, 4
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, HKV, T, D, torch.float32, seed=33, logit_scale=2.0))
    ld = torch.tensor(LOG_DECAY, device=DEV)
    fmap = make_feature_map(kind, H, HKV, D, None, seed=33)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEV)
    valid[1, :3] = False  # left padding of row 1: evicted at steps 4..6 (the state still decays)
    valid[0, 6] = False
    F = D if kind == "elu1" else 2 * D
    with torch.no_grad():
        outs, st, _ = steps_against_torch_step(q, k, v, wl, ll, valid, w, fmap, formulation, F, ld)
        pre = prefill_state(k, v, window=w, feature_map=fmap, key_padding_mask=valid, log_decay=ld)
        torch.testing.assert_close(st.S, pre.S, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.z, pre.z, atol=1e-5, rtol=1e-5)
        par = hybrid_attention_triton(q, k, v, wl, ll, window=w, formulation=formulation, feature_map=fmap,
                                      key_padding_mask=valid, log_decay=ld)[0]
    torch.testing.assert_close(torch.cat(outs, dim=2), par, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- model level (GQA layer)


@pytest.mark.parametrize("feature_map", ["elu1", "hedgehog"])
def test_hybrid_llama_on_triton_matches_chunked(tiny_model_dir, feature_map):
    """The hybrid layer hands the kernels k/v at the KV heads (tiny Llama: 4 query, 2 KV heads) and
    keeps its decode state per KV head: logits, parameter gradients (Hedgehog maps' included) and
    cached greedy generation match the same model on the chunked backend. With Hedgehog the layer
    passes a (query_map, key_map) pair: F = 32, D = 16."""
    from hybrid_llama.models import convert_to_hybrid, load_model

    models = {}
    for backend in ("triton", "chunked"):
        model, tok = load_model(tiny_model_dir, dtype=torch.float32)
        convert_to_hybrid(model, [0, 2], window=8, backend=backend, feature_map=feature_map)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # non-trivial mixing and maps, the same for both
            for i, layer in enumerate((model.model.layers[0], model.model.layers[2])):
                layer.self_attn.mixing.window_logit.copy_(torch.linspace(-1.0, 1.0, 4) + i)
                layer.self_attn.mixing.linear_logit.copy_(torch.linspace(0.5, -0.5, 4))
                for p in layer.self_attn.feature_map.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)
        models[backend] = model.to(DEV)
    attn = models["triton"].model.layers[0].self_attn
    assert attn.config.num_key_value_heads < attn.config.num_attention_heads  # the GQA path is exercised
    ids = tok(["a sequence well past the window of eight tokens"], return_tensors="pt")["input_ids"].to(DEV)
    logits, grads = {}, {}
    for backend, model in models.items():
        out = model(ids, labels=ids)
        out.loss.backward()
        logits[backend] = out.logits.detach()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if "layers.0.self_attn" in n}
    torch.testing.assert_close(logits["triton"], logits["chunked"], atol=1e-4, rtol=1e-4)
    assert grads["triton"].keys() == grads["chunked"].keys() and len(grads["triton"]) >= 6
    if feature_map == "hedgehog":
        assert sum("feature_map" in n for n in grads["triton"]) == 4  # q and k maps: weight, bias
    for name, g in grads["triton"].items():
        torch.testing.assert_close(g, grads["chunked"][name], atol=1e-4, rtol=1e-3, msg=name)
    gen = {}
    for backend, model in models.items():
        model.eval()
        with torch.no_grad():
            gen[backend] = model.generate(ids[:, :12], max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(gen["triton"], gen["chunked"])


# ------------------------------------------------------------------------------------ GPU only


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [4096, 32768])
def test_gpu_bf16_long_vs_chunked(T):
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    B, H, HKV, D = 1, 32, 8, 64
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.bfloat16, seed=11)
    out = hybrid_attention_triton(q, k, v, wl, ll, window=64)[0]
    rep = H // HKV
    with torch.no_grad():
        ref = hybrid_attention_chunked(
            q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1), wl, ll, window=64
        )[0]
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    out.float().square().sum().backward()  # runs and is finite at full size
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, wl, ll))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T", [4096, 32768])
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_gpu_bf16_decay_long_vs_chunked(T, formulation):
    """The decaying state in bf16 at a Llama-3.2-1B layer's shape, gamma from a short memory (0.9) to the
    default recipe's init (0.9995), against chunked in fp32 on the same inputs; the backward is finite,
    the decays' gradient too."""
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    B, H, HKV, D = 1, 32, 8, 64
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.bfloat16, seed=15)
    ld = torch.linspace(0.9, 0.9995, HKV, device=DEV).log().requires_grad_()
    out = hybrid_attention_triton(q, k, v, wl, ll, window=64, formulation=formulation, log_decay=ld)[0]
    with torch.no_grad():
        ref = hybrid_attention_chunked(q.float(), k.float(), v.float(), wl, ll, window=64, formulation=formulation,
                                       log_decay=ld)[0]
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    out.float().square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, wl, ll, ld)) and ld.grad.abs().min() > 0


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats"])
def test_gpu_fp32_grads_vs_chunked(formulation):
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    B, H, HKV, T, D = 2, 8, 2, 1000, 64
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.float32, seed=12)
    mask = torch.rand(B, T, device=DEV) > 0.1
    out = hybrid_attention_triton(q, k, v, wl, ll, window=64, formulation=formulation, key_padding_mask=mask)[0]
    rep = H // HKV
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    ref = hybrid_attention_chunked(q, ke, ve, wl, ll, window=64, formulation=formulation, key_padding_mask=mask)[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v, wl, ll), dout)
    rg = torch.autograd.grad(ref, (q, k, v, wl, ll), dout)
    for got, want in zip(g, rg):
        torch.testing.assert_close(got, want, atol=1e-3 * max(1.0, want.abs().max().item()), rtol=1e-3)


@gpu
@pytest.mark.gpu
def test_gpu_bf16_fp16_small_vs_naive():
    for dtype in (torch.bfloat16, torch.float16):
        check_op(300, 64, 64, dtype=dtype, tol=(3e-2, 3e-2))


@gpu
@pytest.mark.gpu
def test_gpu_decode_bf16_matches_torch_step():
    B, H, HKV, D, w, T = 4, 32, 8, 64, 64, 150
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, HKV, T, D, torch.bfloat16, seed=13))
    st = prefill_state(k[:, :, : T - 1], v[:, :, : T - 1], window=w)
    o, new = hybrid_attention_step_triton(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], st, wl, ll)
    rep = H // HKV
    st_e = prefill_state(
        k[:, :, : T - 1].repeat_interleave(rep, 1), v[:, :, : T - 1].repeat_interleave(rep, 1), window=w
    )
    o_t, _ = hybrid_attention_step_torch(
        q[:, :, -1:], k[:, :, -1:].repeat_interleave(rep, 1), v[:, :, -1:].repeat_interleave(rep, 1), st_e, wl, ll
    )
    torch.testing.assert_close(o.float(), o_t.float(), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
def test_gpu_bf16_hedgehog_pair_long_vs_chunked(formulation):
    """The feature path at a Llama-3.2-1B layer's shape: Hedgehog pair, F = 128 = 2 * D, bf16 features."""
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    B, H, HKV, T, D = 1, 32, 8, 4096, 64
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.bfloat16, seed=14)
    pair = make_feature_map("pair", H, HKV, D, None, seed=14)
    out = hybrid_attention_triton(q, k, v, wl, ll, window=64, formulation=formulation, feature_map=pair)[0]
    with torch.no_grad():
        ref = hybrid_attention_chunked(
            q.float(), k.float(), v.float(), wl, ll, window=64, formulation=formulation, feature_map=pair
        )[0]
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    out.float().square().sum().backward()  # runs and is finite at full size
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, wl, ll))
    if formulation != "window":
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in map_params(pair))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
def test_gpu_fp32_hedgehog_pair_grads_vs_chunked(formulation):
    from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked

    B, H, HKV, T, D = 2, 8, 2, 1000, 64
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.float32, seed=15)
    pair = make_feature_map("pair", H, HKV, D, None, seed=15)
    mask = torch.rand(B, T, device=DEV) > 0.1
    kw = dict(window=64, formulation=formulation, feature_map=pair, key_padding_mask=mask)
    out = hybrid_attention_triton(q, k, v, wl, ll, **kw)[0]
    ref = hybrid_attention_chunked(q, k, v, wl, ll, **kw)[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    inputs = (q, k, v, wl, ll, *map_params(pair))
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, inputs, dout, allow_unused=True, materialize_grads=True)
    rg = torch.autograd.grad(ref, inputs, dout, allow_unused=True, materialize_grads=True)
    for got, want in zip(g, rg):
        torch.testing.assert_close(got, want, atol=1e-3 * max(1.0, want.abs().max().item()), rtol=1e-3)


@gpu
@pytest.mark.gpu
def test_gpu_decode_bf16_hedgehog_pair_matches_torch_step():
    B, H, HKV, D, w, T = 4, 32, 8, 64, 64, 150
    q, k, v, wl, ll = (x.detach() for x in make_inputs(B, H, HKV, T, D, torch.bfloat16, seed=16))
    pair = make_feature_map("pair", H, HKV, D, None, seed=16)
    with torch.no_grad():
        st = prefill_state(k[:, :, : T - 1], v[:, :, : T - 1], window=w, feature_map=pair)
        o, new = hybrid_attention_step_triton(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], st, wl, ll, feature_map=pair)
        o_t, new_t = hybrid_attention_step_torch(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], st, wl, ll, feature_map=pair)
    torch.testing.assert_close(o.float(), o_t.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(new.S, new_t.S, atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------- the sparse cache's eviction plan

PLAN_CASES = [  # B, Hk, T, D, window, size, sinks, score, decay, map
    (2, 2, 203, 16, 8, 16, 0, "sre", True, "elu1"),
    (1, 2, 150, 16, 8, 8, 3, "random", False, "elu1"),
    (1, 3, 170, 16, 16, 16, 4, "sre", True, "hedgehog"),  # F = 2 D
    (2, 1, 100, 32, 8, 24, 2, "sre", False, "hedgehog"),  # λ + w = 32 candidates, no padding slots
    (1, 2, 139, 16, 8, 4, 2, "random", True, "elu1"),  # ends on a close's position
    (1, 2, 10, 16, 8, 4, 2, "sre", False, "elu1"),  # one group, no close
    (1, 2, 420, 16, 16, 64, 4, "sre", True, "hedgehog"),  # 80 candidates padded to 128: 2 row tiles
    (1, 1, 300, 16, 16, 112, 0, "random", False, "elu1"),  # 128 candidates, the cache full from close 7
]


@pytest.mark.parametrize("B,Hk,T,D,window,size,sinks,score,decay,kind", PLAN_CASES)
def test_sparse_plan_matches_the_torch_plan(B, Hk, T, D, window, size, sinks, score, decay, kind):
    """The triton plan decides every close as ``plan_evictions`` does: the same cache per group (empty
    slots included), the same folds, and the same sums."""
    from hybrid_llama.ops import SparseCacheConfig
    from hybrid_llama.ops.feature_maps import resolve_qk_maps
    from hybrid_llama.ops.sparse.batched import plan_evictions
    from hybrid_llama.ops.triton.sparse_plan import plan_evictions_triton

    g = torch.Generator().manual_seed(T)
    k, v = torch.randn(B, Hk, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g)
    phi_k = HedgehogFeatureMap(Hk, D) if kind == "hedgehog" else resolve_qk_maps("elu1")[1]
    if kind == "hedgehog":
        with torch.no_grad():
            phi_k.weight.add_(0.3 * torch.randn(phi_k.weight.shape, generator=g))
    log_decay = -0.05 * torch.rand(Hk, generator=g) if decay else None
    cache = SparseCacheConfig(size, sinks, score)
    want = plan_evictions(k, v, T, window, cache, phi_k, log_decay)
    got = plan_evictions_triton(k.to(DEV), v.to(DEV), T, window, cache, phi_k.to(DEV) if kind == "hedgehog" else phi_k,
                                None if log_decay is None else log_decay.to(DEV))
    for name in ("cache_pos", "cache_ok", "fold_pos", "fold_ok", "final_pos", "final_ok"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    torch.testing.assert_close(got.S.cpu(), want.S, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.z.cpu(), want.z, atol=1e-4, rtol=1e-4)


def test_sparse_plan_breaks_ties_toward_the_earlier_key():
    """Keys and values repeat with period 3, so the sre scores come in exact ties; the torch plan
    keeps the earlier key of a tie (its stable sort), and so must the kernel.

    The entries are small integers (keys 0-2, so elu(k) + 1 = k + 1 with no exp), so S, z and
    every product are integers, exact whatever order a BLAS sums them in: with Gaussian entries a
    CPU's matmul can round a repeated key's score differently by its row in the tile (seen under
    the interpreter on an AVX-512 machine, 2026-11-30), and the tie is gone before the kernel sees it."""
    from hybrid_llama.ops import SparseCacheConfig
    from hybrid_llama.ops.feature_maps import resolve_qk_maps
    from hybrid_llama.ops.sparse.batched import plan_evictions
    from hybrid_llama.ops.triton.sparse_plan import plan_evictions_triton

    g = torch.Generator().manual_seed(5)
    period = torch.arange(120) % 3
    k = torch.randint(0, 3, (1, 2, 3, 16), generator=g).float()[:, :, period]
    v = torch.randint(-3, 4, (1, 2, 3, 16), generator=g).float()[:, :, period]
    cache = SparseCacheConfig(8, 2, "sre")
    phi_k = resolve_qk_maps("elu1")[1]
    want = plan_evictions(k, v, 120, 8, cache, phi_k)
    got = plan_evictions_triton(k.to(DEV), v.to(DEV), 120, 8, cache, phi_k)
    assert torch.equal(got.cache_pos.cpu(), want.cache_pos) and torch.equal(got.fold_pos.cpu(), want.fold_pos)


@pytest.fixture
def triton_plans(monkeypatch):
    """How many times the dispatcher's sparse path ran the triton plan."""
    from hybrid_llama.ops.triton import sparse_plan

    calls = []
    real = sparse_plan.plan_evictions_triton

    def spy(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(sparse_plan, "plan_evictions_triton", spy)
    return calls


@pytest.mark.parametrize("T,w,size,sinks,score", [(70, 8, 6, 2, "sre"), (61, 8, 5, 3, "random"), (88, 8, 8, 0, "sre")])
def test_sparse_op_on_the_triton_plan_matches_naive(T, w, size, sinks, score, triton_plans):
    """``hybrid_attention(backend="triton")`` with a sparse cache: the batched op on the triton plan
    against the naive per-query transcription, and the same decode state as the chunked backend."""
    from test_sparse_cache import _same_sparse_state, make, naive_sparse

    from hybrid_llama.ops import SparseCacheConfig

    q, k, v, wl, ll = make(T=T, D=16)
    want = naive_sparse(q, k, v, wl, ll, window=w, size=size, sinks=sinks, score=score)
    kw = dict(window=w, formulation="lolcats", sparse=SparseCacheConfig(size, sinks, score), output_final_state=True)
    got, state = hybrid_attention(*(x.to(DEV) for x in (q, k, v, wl, ll)), backend="triton", **kw)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)
    assert triton_plans == [T]
    with torch.no_grad():
        _, cpu_state = hybrid_attention(q, k, v, wl, ll, backend="chunked", **kw)
    _same_sparse_state(state.to("cpu"), cpu_state)


def test_sparse_recipe_on_the_triton_plan_matches_chunked(triton_plans):
    """The default run's layer (GQA, a Hedgehog pair, a decaying state, sinks) with the triton plan:
    outputs and gradients of the maps and the decay as the chunked backend's torch path."""
    from hybrid_llama.ops import SparseCacheConfig

    B, H, HKV, T, D, w = 1, 4, 2, 150, 16, 8
    q, k, v, wl, ll = make_inputs(B, H, HKV, T, D, torch.float32, seed=31)
    pair = make_feature_map("pair", H, HKV, D, None, seed=31)
    log_decay = torch.log(torch.tensor([0.97, 0.995], device=DEV)).requires_grad_()
    kw = dict(window=w, formulation="lolcats", feature_map=pair, sparse=SparseCacheConfig(8, 4, "sre"),
              log_decay=log_decay)
    out = hybrid_attention(q, k, v, wl, ll, backend="triton", **kw)[0]
    ref = hybrid_attention(q, k, v, wl, ll, backend="torch", **kw)[0]
    assert triton_plans == [T]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    params = [log_decay, *map_params(pair)]
    for got, want in zip(torch.autograd.grad(out.square().sum(), params),
                         torch.autograd.grad(ref.square().sum(), params)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sparse_triton_refuses_what_the_plan_does_not_cover():
    """``backend="triton"`` says what its sparse path does not take instead of running torch's."""
    from hybrid_llama.ops import SparseCacheConfig

    q, k, v, wl, ll = make_inputs(1, 2, 2, 40, 16, torch.float32, seed=7)
    for sparse, mask in ((SparseCacheConfig(4, 2, "attention"), None),
                         (SparseCacheConfig(4, 2, "sre"), torch.ones(1, 40, dtype=torch.bool, device=DEV))):
        with pytest.raises(NotImplementedError, match="eviction plan"):
            hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", backend="triton", sparse=sparse,
                             key_padding_mask=mask)
    q, k, v, wl, ll = make_inputs(1, 2, 2, 40, 8, torch.float32, seed=7)  # D = 8: too narrow for tl.dot
    with pytest.raises(NotImplementedError, match="eviction plan"):
        hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", backend="triton",
                         sparse=SparseCacheConfig(4, 2, "sre"))


def test_hybrid_llama_with_a_sparse_cache_on_the_triton_plan(lively_dir, triton_plans):
    """The recipe's hybrid layers (lolcats, a Hedgehog pair, a decay, a sparse cache with sinks) in the
    tiny Llama on ``backend="triton"``: the prompt runs on the triton plan and gives the chunked
    backend's logits and parameter gradients, and cached greedy generation equals uncached."""
    from test_models import assert_cached_generation_equals_uncached, randomize_hybrid_params

    from hybrid_llama.models import convert_to_hybrid, load_model

    recipe = dict(window=4, formulation="lolcats", feature_map="hedgehog", decay=0.99, sparse_cache=4, sinks=2)
    models = {}
    for backend in ("triton", "chunked"):
        model, _ = load_model(lively_dir, dtype=torch.float32)
        convert_to_hybrid(model, [0, 2], backend=backend, **recipe)
        randomize_hybrid_params(model)
        models[backend] = model.to(DEV)
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(0)).to(DEV)
    logits, grads = {}, {}
    for backend, model in models.items():
        out = model(ids, labels=ids)
        out.loss.backward()
        logits[backend] = out.logits.detach()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and "self_attn" in n}
    assert len(triton_plans) == 2  # both hybrid layers' prompts
    torch.testing.assert_close(logits["triton"], logits["chunked"], atol=1e-4, rtol=1e-4)
    assert grads["triton"].keys() == grads["chunked"].keys()
    assert any("decay" in n for n in grads["triton"]) and any("feature_map" in n for n in grads["triton"])
    for name, g in grads["triton"].items():
        torch.testing.assert_close(g, grads["chunked"][name], atol=1e-4, rtol=1e-3, msg=name)
    models["triton"].eval()
    enc = {"input_ids": ids[:, :40], "attention_mask": torch.ones_like(ids[:, :40])}
    assert_cached_generation_equals_uncached(models["triton"], enc, 12)


def test_sparse_plan_that_fails_leaves_auto_on_torch(monkeypatch, caplog):
    """A plan kernel that fails (a GPU it does not compile for, say) sends ``auto`` back to the torch
    plan, says why once and stops asking it; ``backend="triton"`` raises the error itself."""
    import hybrid_llama.ops.dispatch as dispatch
    from hybrid_llama.ops import SparseCacheConfig
    from hybrid_llama.ops.triton import sparse_plan

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(sparse_plan, "plan_evictions_triton", broken)
    monkeypatch.setattr(dispatch, "_PLAN_FAILED", [])
    q, k, v, wl, ll = (x.detach() for x in make_inputs(1, 2, 2, 60, 16, torch.float32, seed=3))
    cache = SparseCacheConfig(8, 2, "sre")
    kw = dict(window=8, feature_map="elu1", key_padding_mask=None, output_final_state=False)
    with pytest.raises(RuntimeError, match="out of shared memory"):
        dispatch._sparse_on_triton(q, k, v, wl, ll, cache, "triton", True, None, kw)
    with caplog.at_level("WARNING", logger="hybrid_llama.ops.dispatch"):
        for _ in range(2):
            assert dispatch._sparse_on_triton(q, k, v, wl, ll, cache, "auto", True, None, kw) is None
    assert len(calls) == 2  # triton's, then auto's first; auto's second did not ask
    assert "out of shared memory" in caplog.text

@gpu
@pytest.mark.gpu
def test_gpu_sparse_plan_at_the_recipes_size():
    """The default run's layer at 4096 tokens on the GPU (9 heads of Hedgehog keys, F = 128, λ = 128,
    w = 64, 4 sinks, a decay): the triton plan keeps the torch plan's keys but for near-ties, and the
    batched op on it gives the torch plan's output."""
    from hybrid_llama.ops import SparseCacheConfig
    from hybrid_llama.ops.sparse.batched import hybrid_attention_sparse_batched, plan_evictions
    from hybrid_llama.ops.triton.sparse_plan import plan_evictions_triton

    H, T, D = 9, 4096, 64
    q, k, v, wl, ll = (x.detach() for x in make_inputs(1, H, H, T, D, torch.float32, seed=41))
    phi_k = make_hedgehog(H, D, None, 41)
    log_decay = torch.log(torch.full((H,), 0.9995, device=DEV))
    cache = SparseCacheConfig(128, 4, "sre")
    want = plan_evictions(k, v, T, 64, cache, phi_k, log_decay)
    got = plan_evictions_triton(k, v, T, 64, cache, phi_k, log_decay)
    assert (got.cache_pos == want.cache_pos).float().mean() > 0.999
    with torch.no_grad():
        kw = dict(window=64, cache=cache, feature_map=(make_hedgehog(H, D, None, 42), phi_k), log_decay=log_decay)
        out = hybrid_attention_sparse_batched(q, k, v, wl, ll, planner=plan_evictions_triton, **kw)[0]
        ref = hybrid_attention_sparse_batched(q, k, v, wl, ll, **kw)[0]
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
