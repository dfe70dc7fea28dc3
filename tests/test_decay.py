"""A decaying linear state (``log_decay``): key j enters query t's linear part with weight
gamma^(t - w - j), gamma learnable per KV head. Every torch path against a loop written here from
that definition, decode against the parallel form, cached against uncached generation."""

from __future__ import annotations

import math

import pytest
import torch
from op_inputs import count_calls, trained_maps
from test_models import assert_cached_generation_equals_uncached, randomize_hybrid_params

from hybrid_llama.models import HybridConfig, convert_to_hybrid, load_hybrid, load_model, save_hybrid
from hybrid_llama.ops import SparseCacheConfig, hybrid_attention, init_state
from hybrid_llama.ops.hybrid.chunked import hybrid_attention_chunked
from hybrid_llama.ops.hybrid.reference import hybrid_attention_reference
from hybrid_llama.ops.hybrid.step import hybrid_attention_step_torch
from hybrid_llama.ops.native import build as native_build
from hybrid_llama.ops.native import step as native_step
from hybrid_llama.ops.sparse.batched import hybrid_attention_sparse_batched
from hybrid_llama.ops.sparse.chunked import hybrid_attention_sparse
from hybrid_llama.ops.sparse.reference import hybrid_attention_sparse_reference
from hybrid_llama.ops.sparse.step import hybrid_attention_step_sparse, init_sparse_state

B, H, HK, D, W = 2, 4, 2, 8, 6
LOG_DECAY = torch.tensor([-0.03, -0.3])  # gamma 0.970 and 0.741: a long and a short memory


def inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (H, HK, HK))
    return q, k, v, torch.randn(H, generator=g), torch.randn(H, generator=g)


def naive_loop(q, k, v, wl, ll, phi_q, phi_k, log_decay, formulation, real=None, linear_from=lambda j: j + W):
    """Query by query and key by key, straight from the definition (no masks, no ops module). Key j
    is exact for the queries before ``linear_from(j)`` (without a cache: until it leaves the window)
    and linear from there on, at gamma^(t - w - j)."""
    T, g = q.shape[2], H // HK
    fq, fk = phi_q(q), phi_k(k)
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kh = h // g
            a, bb = torch.sigmoid(wl[h]), torch.sigmoid(ll[h])
            for t in range(T):
                lin = [j for j in range(t + 1) if t >= linear_from(j) and (real is None or real[b, j])]
                exact = [j for j in range(t + 1) if t < linear_from(j) and (real is None or real[b, j])]
                s = torch.stack([q[b, h, t] @ k[b, kh, j] / math.sqrt(D) for j in exact]) if exact else None
                num, den = torch.zeros(D), torch.zeros(())
                if s is not None:
                    e = torch.exp(s - s.max())
                    avg = sum(e[i] * v[b, kh, j] for i, j in enumerate(exact)) / e.sum()
                    weight = a * e.sum() if formulation == "lolcats" else a
                    num, den = weight * avg, weight
                for j in lin:
                    kern = bb * (fq[b, h, t] @ fk[b, kh, j]) * math.exp(float(log_decay[kh]) * (t - W - j))
                    num, den = num + kern * v[b, kh, j], den + kern
                out[b, h, t] = num / den if den > 0 else 0.0
    return out


@pytest.mark.parametrize("formulation", ["lolcats", "hybrid"])
def test_every_torch_path_is_the_definition(formulation):
    q, k, v, wl, ll = inputs(41)
    maps = trained_maps(H, HK, D)
    with torch.no_grad():
        want = naive_loop(q, k, v, wl, ll, *maps, LOG_DECAY, formulation)
        kw = dict(window=W, formulation=formulation, feature_map=maps, log_decay=LOG_DECAY)
        got = {
            "reference": hybrid_attention_reference(q, k, v, wl, ll, **kw)[0],
            "dispatch auto": hybrid_attention(q, k, v, wl, ll, **kw)[0],
            # slabs of 24 and chunks of 12 / 6: the carry crosses slabs, the last slab is padded
            "chunked 12/24": hybrid_attention_chunked(q, k, v, wl, ll, chunk_size=12, slab_size=24, **kw)[0],
            "chunked 6/18": hybrid_attention_chunked(q, k, v, wl, ll, chunk_size=6, slab_size=18, **kw)[0],
        }
    for name, o in got.items():
        torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5, msg=name)
    assert (got["reference"] - hybrid_attention_reference(q, k, v, wl, ll, window=W, formulation=formulation,
                                                          feature_map=maps)[0]).abs().max() > 1e-2


def test_padding_and_per_query_head_maps():
    """Left padding (keys that never count) and elu1 on expanded heads (the chunked backend repeats
    the decay with the keys)."""
    q, k, v, wl, ll = inputs(30, seed=1)
    real = torch.ones(B, 30, dtype=torch.bool)
    real[1, :7] = False
    elu = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    with torch.no_grad():
        want = naive_loop(q, k, v, wl, ll, elu, elu, LOG_DECAY, "lolcats", real)
        kw = dict(window=W, formulation="lolcats", key_padding_mask=real, log_decay=LOG_DECAY)
        ref, _ = hybrid_attention_reference(q, k, v, wl, ll, **kw)
        ch, _ = hybrid_attention_chunked(q, k, v, wl, ll, chunk_size=6, slab_size=12, **kw)
    torch.testing.assert_close(ref[1, :, 7:], want[1, :, 7:], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ch[:, :, 7:], ref[:, :, 7:], atol=2e-5, rtol=2e-5)


def test_no_decay_is_log_decay_zero():
    q, k, v, wl, ll = inputs(40)
    maps = trained_maps(H, HK, D)
    with torch.no_grad():
        plain, _ = hybrid_attention_chunked(q, k, v, wl, ll, window=W, formulation="lolcats", feature_map=maps)
        zero, _ = hybrid_attention_chunked(q, k, v, wl, ll, window=W, formulation="lolcats", feature_map=maps,
                                           log_decay=torch.zeros(HK), chunk_size=12, slab_size=24)
    torch.testing.assert_close(zero, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inplace", [False, True])
def test_decode_continues_the_parallel_form(inplace):
    """A prefill's final state (chunked, padded last slab) and then one step per token give the
    parallel op's outputs; so do steps from an empty state. The state's sums are the definition's."""
    q, k, v, wl, ll = inputs(50, seed=2)
    maps = trained_maps(H, HK, D)
    kw = dict(formulation="lolcats", feature_map=maps, log_decay=LOG_DECAY)
    with torch.no_grad():
        full, _ = hybrid_attention_chunked(q, k, v, wl, ll, window=W, **kw)
        for split, state in ((0, init_state(B, HK, D, W, feature_dim=maps[1].out_features)), (31, None)):
            outs = []
            if split:
                o, state = hybrid_attention_chunked(q[:, :, :split], k[:, :, :split], v[:, :, :split], wl, ll,
                                                    window=W, chunk_size=12, slab_size=24, output_final_state=True,
                                                    **kw)
                outs.append(o)
                age = torch.arange(split - W - 1, -1, -1, dtype=torch.float32)
                fk = maps[1](k[:, :, : split - W]) * torch.exp(LOG_DECAY[:, None] * age)[None, :, :, None]
                torch.testing.assert_close(state.S, fk.transpose(-1, -2) @ v[:, :, : split - W], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(state.z, fk.sum(2), atol=1e-5, rtol=1e-5)
            for t in range(split, 50):
                o, state = hybrid_attention_step_torch(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                                       state, wl, ll, inplace=inplace, **kw)
                outs.append(o)
            torch.testing.assert_close(torch.cat(outs, 2), full, atol=2e-5, rtol=2e-5)


def test_the_decay_learns_through_the_chunked_form():
    q, k, v, wl, ll = inputs(45, seed=3)
    maps = trained_maps(H, HK, D)
    grads = {}
    for name, fn, extra in (("reference", hybrid_attention_reference, {}),
                            ("chunked", hybrid_attention_chunked, {"chunk_size": 12, "slab_size": 24})):
        lam = LOG_DECAY.clone().requires_grad_()
        o, _ = fn(q, k, v, wl, ll, window=W, formulation="lolcats", feature_map=maps, log_decay=lam, **extra)
        (o * torch.linspace(-1, 1, D)).sum().backward()
        grads[name] = lam.grad
    torch.testing.assert_close(grads["chunked"], grads["reference"], atol=1e-4, rtol=1e-4)
    # and against a central difference of the op (fp32 inside: a step of 2e-3, a relative 1e-3)
    def f(lam: torch.Tensor) -> float:
        with torch.no_grad():
            o, _ = hybrid_attention_reference(q, k, v, wl, ll, window=W, formulation="lolcats", feature_map=maps,
                                              log_decay=lam)
        return float((o.double() * torch.linspace(-1, 1, D, dtype=torch.float64)).sum())

    for h in range(HK):
        step = torch.zeros(HK)
        step[h] = 2e-3
        fd = (f(LOG_DECAY + step) - f(LOG_DECAY - step)) / 4e-3
        assert abs(float(grads["reference"][h]) - fd) < 1e-3 * max(1.0, abs(fd)), (h, grads["reference"][h], fd)


def test_the_sparse_cache_keeps_the_definition():
    """With no slots every closed block folds whole: the keys of block J (positions J w .. J w + w - 1)
    stay exact until it closes at (J + 2) w - 1, then they are linear. Each path equals the definition."""
    q, k, v, wl, ll = inputs(40, seed=4)
    maps = trained_maps(H, HK, D)
    cache = SparseCacheConfig(0, 0, "random")
    with torch.no_grad():
        want = naive_loop(q, k, v, wl, ll, *maps, LOG_DECAY, "lolcats", linear_from=lambda p: (p // W + 2) * W - 1)
        kw = dict(window=W, cache=cache, feature_map=maps, log_decay=LOG_DECAY)
        for name, o in (("reference", hybrid_attention_sparse_reference(q, k, v, wl, ll, **kw)[0]),
                        ("loop", hybrid_attention_sparse(q, k, v, wl, ll, **kw)[0]),
                        ("batched", hybrid_attention_sparse_batched(q, k, v, wl, ll, **kw)[0])):
            torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("score", ["sre", "random", "attention"])
def test_sparse_paths_and_decode_agree(score):
    """A cache that keeps and evicts: the loop (with padding too), the batched path, the decode step
    from empty and after a prefill all give the token-by-token reference's outputs, and their final
    states agree."""
    q, k, v, wl, ll = inputs(70, seed=5)
    maps = trained_maps(H, HK, D)
    cache = SparseCacheConfig(5, 2, score)
    kw = dict(window=W, cache=cache, feature_map=maps, log_decay=LOG_DECAY)
    real = torch.ones(B, 70, dtype=torch.bool)
    real[1, :9] = False
    with torch.no_grad():
        ref = hybrid_attention_sparse_reference(q, k, v, wl, ll, **kw)[0]
        assert (ref - hybrid_attention_sparse_reference(q, k, v, wl, ll, window=W, cache=cache,
                                                        feature_map=maps)[0]).abs().max() > 1e-2
        loop, final = hybrid_attention_sparse(q, k, v, wl, ll, output_final_state=True, **kw)
        torch.testing.assert_close(loop, ref, atol=2e-5, rtol=2e-5)
        padded = hybrid_attention_sparse_reference(q, k, v, wl, ll, key_padding_mask=real, **kw)[0]
        torch.testing.assert_close(hybrid_attention_sparse(q, k, v, wl, ll, key_padding_mask=real, **kw)[0][:, :, 9:],
                                   padded[:, :, 9:], atol=2e-5, rtol=2e-5)
        if score != "attention":
            batched, final_b = hybrid_attention_sparse_batched(q, k, v, wl, ll, output_final_state=True, **kw)
            torch.testing.assert_close(batched, ref, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(final_b.S, final.S, atol=1e-5, rtol=1e-5)
        for split in (0, 47):
            if split:
                o, state = hybrid_attention_sparse(q[:, :, :split], k[:, :, :split], v[:, :, :split], wl, ll,
                                                   output_final_state=True, **kw)
                outs = [o]
            else:
                state, outs = init_sparse_state(B, HK, D, W, cache, feature_dim=maps[1].out_features), []
            for t in range(split, 70):
                o, state = hybrid_attention_step_sparse(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
                                                        state, wl, ll, cache=cache, feature_map=maps,
                                                        log_decay=LOG_DECAY)
                outs.append(o)
            torch.testing.assert_close(torch.cat(outs, 2), ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state.S, hybrid_attention_sparse(q, k, v, wl, ll, output_final_state=True,
                                                                    **kw)[1].S, atol=1e-5, rtol=1e-5)


def test_the_decay_learns_through_the_sparse_cache():
    q, k, v, wl, ll = inputs(60, seed=6)
    maps = trained_maps(H, HK, D)
    grads = []
    for fn in (hybrid_attention_sparse, hybrid_attention_sparse_batched):
        lam = LOG_DECAY.clone().requires_grad_()
        o, _ = fn(q, k, v, wl, ll, window=W, cache=SparseCacheConfig(5, 2), feature_map=maps, log_decay=lam)
        (o * torch.linspace(-1, 1, D)).sum().backward()
        grads.append(lam.grad)
    assert grads[0].abs().min() > 1e-3
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-4)


def test_seed_naive_and_bad_arguments_refuse_a_decay():
    q, k, v, wl, ll = inputs(20)
    # (the triton kernels compute it: tests/test_triton.py)
    with pytest.raises(ValueError, match="no decaying linear state"):
        hybrid_attention(q, k, v, wl, ll, window=W, backend="seed_naive", log_decay=LOG_DECAY)
    with pytest.raises(ValueError, match=r"log_decay must be \[H_kv\]"):
        hybrid_attention_reference(q, k, v, wl, ll, window=W, log_decay=torch.zeros(H))
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\)"):
        HybridConfig(layers=[0], decay=1.0)


@pytest.mark.parametrize("sparse", [{}, {"sparse_cache": 4, "sinks": 2}])
def test_a_decaying_model_generates_saves_and_trains(lively_dir, tmp_path, monkeypatch, sparse):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=4, formulation="lolcats", feature_map="hedgehog", decay=0.9, **sparse)
    randomize_hybrid_params(model)
    layer = model.model.layers[0].self_attn
    assert layer.mixing.decay_logit.shape == (model.config.num_key_value_heads,)
    torch.testing.assert_close(torch.sigmoid(layer.mixing.decay_logit), torch.full((2,), 0.9))
    with torch.no_grad():
        layer.mixing.decay_logit.copy_(torch.tensor([0.5, 3.0]))  # gamma 0.62 and 0.95: the decay matters
    assert layer.hybrid.native_steps  # the native steps compute the decay, with the sparse cache too
    enc = tok(["the decay keeps the state bounded"], return_tensors="pt")
    model.eval()
    native = count_calls(monkeypatch, native_step, "sparse_step_in_place" if sparse else "step_in_place")
    assert_cached_generation_equals_uncached(model, enc, 20)
    if native_build.load() is not None and not sparse:
        assert native["ran"] == 2 * 19 and native["declined"] == 0  # every cached step after the prompt
    elif native_build.load() is not None:
        # every cached step but the ones that close a block, each of those declined twice (by the
        # layer's call, then by the general step's)
        assert native["ran"] >= 2 * 19 * 3 // 4 and native["ran"] + native["declined"] // 2 == 2 * 19

    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
        undecayed = layer.mixing.decay_logit.clone()
        layer.mixing.decay_logit.fill_(30.0)  # gamma = 1 in fp32
        assert (model(ids).logits - logits).abs().max() > 1e-3
        layer.mixing.decay_logit.copy_(undecayed)
    save_hybrid(model, tmp_path / "m", tok)
    loaded = load_hybrid(tmp_path / "m").eval()
    assert loaded.config.hybrid["decay"] == 0.9
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits)

    model.train()
    model(ids, labels=ids).loss.backward()
    assert layer.mixing.decay_logit.grad is not None and layer.mixing.decay_logit.grad.abs().sum() > 0


def test_no_decay_keeps_the_saved_config():
    """Models without a decay keep their exact config.json and rule params (no ``decay`` key)."""
    assert "decay" not in HybridConfig(layers=[0]).to_dict()
    assert HybridConfig(layers=[0], decay=0.99).to_dict()["decay"] == 0.99
