"""The sparse cache's native prefill (ops/cpu_kernels.c's hybrid_sparse_group_f32, ops/cpu_sparse.py):
equal to the torch sparse op and to the naive O(T^2) one, the same keys cached, continued by the
decode steps, and out of the way wherever it does not apply; with a decaying linear state too, the
native prefill and decode step against the torch paths that compute it."""

from __future__ import annotations

import copy

import pytest
import torch
from op_inputs import count_calls, trained_maps

from hybrid_llama.ops import SparseCacheConfig, hybrid_attention, hybrid_attention_step
from hybrid_llama.ops.native import build as native
from hybrid_llama.ops.native import sparse_prefill as cpu_sparse
from hybrid_llama.ops.sparse.batched import hybrid_attention_sparse_batched
from hybrid_llama.ops.sparse.chunked import hybrid_attention_sparse

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no C compiler here: {native.why_not()}")


def problem(B, H, Hk, T, D, fmap, seed=3):
    """q, k, v as a model makes them (views of [B, T, heads, D]), logits and the map."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g).transpose(1, 2) for h in (H, Hk, Hk))
    wl, ll = 2 * torch.randn(H, generator=g), 2 * torch.randn(H, generator=g)
    return q, k, v, wl, ll, trained_maps(H, Hk, D) if fmap == "hedgehog" else "elu1"


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls the kernel ran (hybrid_attention_sparse_cpu returning a result)."""
    return count_calls(monkeypatch, cpu_sparse, "hybrid_attention_sparse_cpu")


def assert_same_state(got, want):
    assert got.seen == want.seen
    for name in ("k_window", "v_window", "window_valid", "S", "z"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5, msg=name)
    for name in vars(want.sparse):
        torch.testing.assert_close(getattr(got.sparse, name), getattr(want.sparse, name), atol=1e-5, rtol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("score", ["sre", "random"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("shape", [  # B, H, Hk, T, D, w, cache size, sinks
    (2, 4, 2, 150, 64, 8, 6, 2), (1, 9, 3, 300, 64, 64, 128, 4), (1, 3, 3, 97, 128, 16, 0, 3),
    (1, 2, 1, 40, 64, 8, 5, 0), (1, 6, 2, 21, 64, 8, 4, 10),
])
def test_matches_the_torch_and_naive_sparse_op(score, fmap, shape, native_calls):
    """Outputs equal the torch path's and the naive op's, and the decode state (ring, sinks, pending
    block, cache and its positions, S and z) the torch path's: for GQA, a batch of 2, D = 128, no
    cache, no sinks, more sinks than a window, and prompts that end inside the first group. The
    dispatcher takes the kernel for every prompt but those that fold no key (causal SDPA there)."""
    B, H, Hk, T, D, w, size, sinks = shape
    q, k, v, wl, ll, feature = problem(B, H, Hk, T, D, fmap)
    cache = SparseCacheConfig(size, sinks, score)
    kw = dict(window=w, formulation="lolcats", feature_map=feature, sparse=SparseCacheConfig(size, sinks, score))
    with torch.no_grad():
        got, state = cpu_sparse.hybrid_attention_sparse_cpu(q, k, v, wl, ll, window=w, cache=cache, feature_map=feature,
                                                            output_final_state=True)
        want, want_state = hybrid_attention_sparse(q, k, v, wl, ll, window=w, cache=cache, feature_map=feature,
                                                   output_final_state=True)
        naive, _ = hybrid_attention(q, k, v, wl, ll, backend="reference", **kw)
        dispatched, dispatched_state = hybrid_attention(q, k, v, wl, ll, backend="chunked", output_final_state=True,
                                                        **kw)
    assert native_calls["ran"] == 1 + (T > cache.softmax_prompt_len(w))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, naive, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(dispatched, naive, atol=2e-6, rtol=1e-5)
    for one in (state, dispatched_state):
        assert_same_state(one, want_state)
        assert torch.equal(one.sparse.cache_pos, want_state.sparse.cache_pos)


def test_bf16_model_takes_the_kernel_in_fp32(monkeypatch, native_calls):
    """A model evaluated in bf16 takes the native sparse prefill too (fp32 copies of its maps): the same
    keys cached as the fp32 torch op on the same values, its output rounded to bf16, and the decode
    state in the dtypes the torch path gives a bf16 model."""
    B, H, Hk, T, D, w = 1, 9, 3, 300, 64, 16
    q, k, v, wl, ll, maps = problem(B, H, Hk, T, D, "hedgehog")
    low = [t.bfloat16() for t in (q, k, v, wl, ll)]
    maps16 = tuple(copy.deepcopy(m).to(torch.bfloat16) for m in maps)
    maps32 = tuple(copy.deepcopy(m).float() for m in maps16)  # the bf16 values, in fp32
    cache = SparseCacheConfig(12, 4)
    with torch.no_grad():
        got, state = hybrid_attention(*low, window=w, formulation="lolcats", feature_map=maps16, sparse=cache,
                                      backend="chunked", output_final_state=True)
        want, want_state = hybrid_attention_sparse(*(t.float() for t in low), window=w, cache=cache,
                                                   feature_map=maps32, output_final_state=True)
        monkeypatch.setenv("HYBRID_LLAMA_NATIVE", "0")
        _, torch_state = hybrid_attention(*low, window=w, formulation="lolcats", feature_map=maps16, sparse=cache,
                                          backend="chunked", output_final_state=True)
    assert native_calls["ran"] == 1
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=8e-3)  # one bf16 rounding of the output
    assert torch.equal(state.sparse.cache_pos, want_state.sparse.cache_pos)
    for part, ref, dtypes in ((state, want_state, torch_state), (state.sparse, want_state.sparse, torch_state.sparse)):
        for name, value in vars(ref).items():
            if isinstance(value, torch.Tensor):
                mine = getattr(part, name)
                assert mine.dtype == getattr(dtypes, name).dtype, name
                torch.testing.assert_close(mine.float(), value.float(), atol=1e-5, rtol=1e-5, msg=name)


def test_decode_continues_the_native_prefill(native_calls):
    """A native prefill's state, then native decode steps across closing blocks, equal the naive op
    over the whole sequence."""
    B, H, Hk, D, w, T, n = 1, 6, 2, 64, 8, 45, 30
    q, k, v, wl, ll, feature = problem(B, H, Hk, T + n, D, "hedgehog", seed=7)
    kw = dict(formulation="lolcats", feature_map=feature, sparse=SparseCacheConfig(5, 2))
    with torch.no_grad():
        _, state = hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w, backend="chunked",
                                    output_final_state=True, **kw)
        outs = []
        for t in range(T, T + n):
            o, state = hybrid_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, wl, ll,
                                             inplace=True, **kw)
            outs.append(o)
        naive, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)
    assert native_calls["ran"] == 1
    torch.testing.assert_close(torch.cat(outs, 2), naive[:, :, T:], atol=2e-6, rtol=1e-5)


def test_torch_path_where_the_kernel_does_not_apply(native_calls, monkeypatch):
    """The attention score, padding, autograd, the shares, D = 32, the torch backend and
    HYBRID_LLAMA_NATIVE=0 all take the torch path, with its results."""
    B, H, Hk, T, D, w = 2, 4, 2, 40, 64, 8
    q, k, v, wl, ll, feature = problem(B, H, Hk, T, D, "elu1")
    kw = dict(window=w, formulation="lolcats", sparse=SparseCacheConfig(4, 1))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3] = False
    with torch.no_grad():
        hybrid_attention(q, k, v, wl, ll, **(kw | dict(sparse=SparseCacheConfig(4, 1, "attention"))))
        hybrid_attention(q, k, v, wl, ll, **kw, key_padding_mask=mask)
        hybrid_attention(q[..., :32], k[..., :32], v[..., :32], wl, ll, **kw)
        hybrid_attention(q, k, v, wl, ll, **kw, backend="torch")
        monkeypatch.setenv("HYBRID_LLAMA_NATIVE", "0")
        off, _ = hybrid_attention(q, k, v, wl, ll, **kw)
        monkeypatch.delenv("HYBRID_LLAMA_NATIVE")
        on, _ = hybrid_attention(q, k, v, wl, ll, **kw)
    with torch.enable_grad():
        hybrid_attention(q.requires_grad_(), k, v, wl, ll, **kw)
    assert native_calls["ran"] == 1  # only `on`
    torch.testing.assert_close(on, off, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
def test_native_close_keeps_the_torch_close_keys(fmap, decay):
    """One block close in C (``hybrid_sparse_close_f32``) against ``close_block`` with the ``sre``
    score: a cache with empty slots, candidates that tie exactly (block keys copied from cached
    ones: the earlier candidate stays), the same kept keys, positions and validity, S and z to fp32
    rounding; with a decay, each loser folded at gamma^(its age at the close)."""
    from hybrid_llama.ops.feature_maps import resolve_qk_maps
    from hybrid_llama.ops.native.bindings import pointers, prefill_maps, strides3
    from hybrid_llama.ops.sparse.eviction import close_block, fold_weights, gather_slots

    B, H, Hk, D, w, lam, block = 2, 4, 2, 64, 8, 12, 40
    q, k, v, _, _, feature = problem(B, H, Hk, 64, D, fmap, seed=5)
    k, v = k.contiguous().clone(), v.contiguous().clone()
    map_code, weights, F = prefill_maps(feature, H, Hk, D)
    phi_k = resolve_qk_maps(feature)[1]
    g = torch.Generator().manual_seed(6)
    cache_k, cache_v = torch.randn(B, Hk, lam, D, generator=g), torch.randn(B, Hk, lam, D, generator=g)
    cache_pos = torch.arange(lam).repeat(B, Hk, 1) * 3
    cache_ok = torch.rand(B, Hk, lam, generator=g) > 0.3
    k[:, :, block + 1], v[:, :, block + 1] = cache_k[:, :, 2], cache_v[:, :, 2]  # an exact tie with slot 2
    cache_ok[:, :, 2] = True
    fk = phi_k(torch.randn(B, Hk, 30, D, generator=g))
    S, z = fk.transpose(-1, -2) @ torch.randn(B, Hk, 30, D, generator=g), fk.sum(2)
    log_decay = torch.tensor([-0.05, -0.4]) if decay else None
    with torch.no_grad():
        cand_k = torch.cat([cache_k, k[:, :, block:block + w]], 2)
        cand_v = torch.cat([cache_v, v[:, :, block:block + w]], 2)
        cand_pos = torch.cat([cache_pos, torch.arange(block, block + w).expand(B, Hk, -1)], -1)
        cand_ok = torch.cat([cache_ok, torch.ones(B, Hk, w, dtype=torch.bool)], -1)
        # the close at block + 2w - 1: the last of the block's keys leaves the window there
        weights_at_close = fold_weights(log_decay, block + 2 * w - 1, w, cand_pos)
        keep, want_ok, want_S, want_z = close_block("sre", cand_k, cand_v, cand_ok, cand_pos, None, S, z, lam, phi_k,
                                                    weights_at_close)
    got = [t.clone() for t in (cache_k, cache_v, cache_pos, cache_ok, S, z)]
    (k_b, k_h, k_t), (v_b, v_h, v_t) = strides3(k), strides3(v)
    work = torch.empty(cpu_sparse.CLOSE_WORKSPACE(B=B, Hk=Hk, D=D, F=F, w=w, lam=lam))
    wk, bk = pointers(*weights[2:])
    assert cpu_sparse.CLOSE(
        B=B, Hk=Hk, D=D, F=F, w=w, lam=lam, map=map_code, block=block, threads=2, k=k.data_ptr(), k_b=k_b,
        k_h=k_h, k_t=k_t, v=v.data_ptr(), v_b=v_b, v_h=v_h, v_t=v_t, cache_k=got[0].data_ptr(),
        cache_v=got[1].data_ptr(), cache_pos=got[2].data_ptr(), cache_ok=got[3].data_ptr(), S=got[4].data_ptr(),
        z=got[5].data_ptr(), log_decay=None if log_decay is None else log_decay.data_ptr(), wk=wk, bk=bk,
        work=work.data_ptr()) == 0
    assert torch.equal(got[2], cand_pos.gather(-1, keep)) and torch.equal(got[3], want_ok)
    assert torch.equal(got[0], gather_slots(cand_k, keep)) and torch.equal(got[1], gather_slots(cand_v, keep))
    kept_copy, kept_slot = (keep == lam + 1).any(-1), (keep == 2).any(-1)
    assert not (kept_copy & ~kept_slot).any()  # the tie: the block's copy never stays without the earlier slot
    torch.testing.assert_close(got[4], want_S, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[5], want_z, atol=1e-5, rtol=1e-5)
    if decay:  # the weights mattered: an undecayed fold of the same losers differs
        undecayed = close_block("sre", cand_k, cand_v, cand_ok, cand_pos, None, S, z, lam, phi_k)
        assert torch.equal(undecayed[0], keep) and (undecayed[2] - want_S).abs().max() > 1e-2


# ------------------------------------------------------------------ a decaying linear state


def decays(Hk: int) -> torch.Tensor:
    """log gamma per KV head, from a long memory (gamma 0.99) to a short one (0.74)."""
    return torch.linspace(-0.01, -0.3, Hk)


def assert_same_decode_state(got, want):
    assert_same_state(got, want)
    assert torch.equal(got.sparse.cache_pos, want.sparse.cache_pos)


@pytest.mark.parametrize("score", ["sre", "random"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("shape", [  # B, H, Hk, T, D, w, cache size, sinks
    (2, 4, 2, 150, 64, 8, 6, 2), (1, 6, 3, 97, 128, 16, 5, 3), (1, 6, 2, 21, 64, 8, 4, 10),
])
def test_decaying_prefill_matches_the_torch_paths(score, fmap, shape, native_calls):
    """With ``log_decay`` the native prefill (dispatched, on 1 and 2 threads) gives the torch block
    loop's and batched path's outputs and decode state: S and z as of the last position, the same
    keys cached; the decay changes the outputs (it is not dropped on the way)."""
    B, H, Hk, T, D, w, size, sinks = shape
    q, k, v, wl, ll, feature = problem(B, H, Hk, T, D, fmap, seed=8)
    cache = SparseCacheConfig(size, sinks, score)
    lam = decays(Hk)
    kw = dict(window=w, cache=cache, feature_map=feature, output_final_state=True, log_decay=lam)
    threads = torch.get_num_threads()
    got = {}
    with torch.no_grad():
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                got[n] = hybrid_attention(q, k, v, wl, ll, window=w, formulation="lolcats", feature_map=feature,
                                          sparse=cache, backend="chunked", output_final_state=True, log_decay=lam)
        finally:
            torch.set_num_threads(threads)
        loop, loop_state = hybrid_attention_sparse(q, k, v, wl, ll, **kw)
        batched, batched_state = hybrid_attention_sparse_batched(q, k, v, wl, ll, **kw)
        undecayed, _ = hybrid_attention_sparse(q, k, v, wl, ll, **(kw | dict(log_decay=None)))
    folds = T > cache.softmax_prompt_len(w)
    assert native_calls["ran"] == 2 * folds
    torch.testing.assert_close(loop, batched, atol=2e-6, rtol=1e-5)
    for o, state in got.values():
        torch.testing.assert_close(o, loop, atol=2e-6, rtol=1e-5)
        assert_same_decode_state(state, loop_state)
        assert_same_decode_state(state, batched_state)
    if folds and T > sinks + 3 * w:  # a query that reads a state aged past its close
        assert (loop - undecayed).abs().max() > 1e-3


def test_decaying_prefill_on_expanded_heads(native_calls):
    """One map for queries and keys per query head over GQA keys (the keys and the decay repeated per
    query head) and a direct call with a decay of the wrong size (declined, for the caller's torch
    path)."""
    B, H, Hk, T, D, w = 1, 4, 2, 90, 64, 8
    q, k, v, wl, ll, _ = problem(B, H, Hk, T, D, "elu1", seed=9)
    one_map = trained_maps(H, H, D)[0]
    cache = SparseCacheConfig(4, 2)
    kw = dict(window=w, cache=cache, feature_map=one_map, output_final_state=True, log_decay=decays(Hk))
    with torch.no_grad():
        got, state = cpu_sparse.hybrid_attention_sparse_cpu(q, k, v, wl, ll, **kw)
        want, want_state = hybrid_attention_sparse(q, k, v, wl, ll, **kw)
        assert cpu_sparse.hybrid_attention_sparse_cpu(q, k, v, wl, ll, **(kw | dict(log_decay=decays(3)))) is None
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert_same_decode_state(state, want_state)


@pytest.fixture
def native_sparse_steps(monkeypatch):
    """Counts the sparse decode steps the kernel ran and those it left to the torch step."""
    from hybrid_llama.ops.native import step as cpu_step

    return count_calls(monkeypatch, cpu_step, "sparse_step_in_place")


@pytest.mark.parametrize("score", ["sre", "random"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
def test_decaying_native_step_is_the_torch_step(score, fmap, native_sparse_steps):
    """From a decaying native prefill, the in-place steps (native but on the steps that close a block)
    give the torch sparse step's outputs and states, step for step, across several closes, and the
    reference's outputs over the whole sequence; the prefill's own tensors are left as they were."""
    from hybrid_llama.ops.sparse.reference import hybrid_attention_sparse_reference
    from hybrid_llama.ops.sparse.step import hybrid_attention_step_sparse

    B, H, Hk, D, w, T, n = 2, 4, 2, 64, 6, 40, 31
    q, k, v, wl, ll, feature = problem(B, H, Hk, T + n, D, fmap, seed=10)
    cache, lam = SparseCacheConfig(5, 2, score), decays(Hk)
    kw = dict(formulation="lolcats", feature_map=feature, sparse=cache, log_decay=lam)
    head = (q[:, :, :T], k[:, :, :T], v[:, :, :T])
    with torch.no_grad():
        _, state = hybrid_attention(*head, wl, ll, window=w, backend="chunked", output_final_state=True, **kw)
        _, want_state = hybrid_attention_sparse(*head, wl, ll, window=w, cache=cache, feature_map=feature,
                                                output_final_state=True, log_decay=lam)
        prefill_S, prefill_z = state.S, state.z
        before = prefill_S.clone(), prefill_z.clone()
        outs, closing = [], 0
        for t in range(T, T + n):
            step = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            o, state = hybrid_attention_step(*step, state, wl, ll, inplace=True, **kw)
            want, want_state = hybrid_attention_step_sparse(*step, want_state, wl, ll, cache=cache,
                                                            feature_map=feature, log_decay=lam)
            torch.testing.assert_close(o, want, atol=2e-6, rtol=1e-5, msg=f"step {t}")
            assert_same_decode_state(state, want_state)
            outs.append(o)
            closing += t - w >= cache.sinks and (t - w - cache.sinks) % w == w - 1
        ref, _, _ = hybrid_attention_sparse_reference(q, k, v, wl, ll, window=w, cache=cache, feature_map=feature,
                                                      log_decay=lam)
    assert closing >= 4 and native_sparse_steps == {"ran": n - closing, "declined": closing}
    torch.testing.assert_close(torch.cat(outs, 2), ref[:, :, T:], atol=2e-6, rtol=1e-5)
    assert torch.equal(prefill_S, before[0]) and torch.equal(prefill_z, before[1])


def test_decaying_sparse_model_generates_with_the_native_paths(native_calls, native_sparse_steps):
    """A model with 64-wide heads, a sparse cache and a decay: its prompts take the native prefill and
    its cached generation the native steps, and cached greedy generation equals uncached."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_llama.eval.throughput import greedy_decode
    from hybrid_llama.models import convert_to_hybrid

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, intermediate_size=256, vocab_size=97, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    convert_to_hybrid(model, layers=[0, 1], window=8, formulation="lolcats", feature_map="hedgehog",
                      sparse_cache=4, sinks=2, decay=0.8)
    model.eval()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    cached = greedy_decode(model, ids, 12, use_cache=True)
    assert native_calls["ran"] == 2  # the prompt's two hybrid layers
    assert native_sparse_steps["ran"] >= 2 * 8 and native_sparse_steps["declined"] >= 2
    assert torch.equal(cached, greedy_decode(model, ids, 12, use_cache=False))


def test_profile_layer_times_the_native_kernels(capsys):
    """``benchmarks/profile_layer.py --native`` gives each native kernel's time per hybrid call, less
    than the call itself, and leaves the kernel library as it found it."""
    import importlib.util
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_layer.py"
    spec = importlib.util.spec_from_file_location("profile_layer", path)
    profile_layer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_layer)
    load = native.load
    assert profile_layer.main(["--sparse-cache", "16", "--sinks", "2", "--prefill-lens", "300", "--decode-contexts",
                               "100", "--calls", "20", "--native"]) == 0
    assert native.load is load
    out = capsys.readouterr().out
    hybrid_us = float(re.search(r"\| prefill \| 300 \| [\d.]+ \| ([\d.]+) \|", out)[1])
    kernels = dict(re.findall(r"(hybrid_sparse_\w+_f32) ([\d.]+)us", out.split("| decode")[0]))
    assert set(kernels) == {"hybrid_sparse_group_f32", "hybrid_sparse_close_f32"}
    assert 0 < sum(map(float, kernels.values())) < hybrid_us
    assert "hybrid_sparse_step_f32" in out.split("| decode")[1]
