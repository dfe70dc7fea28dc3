"""The native CPU prefill (ops/cpu_kernels.c, ops/cpu_prefill.py): equal to the naive O(T^2) op and to
the chunked torch ops, split over threads without changing a number, continued by the decode step, and
out of the way wherever it does not apply (autograd, padding, other head sizes, switched off)."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
from op_inputs import count_calls, trained_maps

from hybrid_llama.ops import hybrid_attention, hybrid_attention_step
from hybrid_llama.ops.native import build as native
from hybrid_llama.ops.native import prefill as cpu_prefill

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no C compiler here: {native.why_not()}")


def problem(B, H, Hk, T, D, fmap, seed=5, model_layout=False):
    """q, k, v (optionally as a model makes them: views of [B, T, heads, D]), logits and the map."""
    g = torch.Generator().manual_seed(seed)
    if model_layout:
        q, k, v = (torch.randn(B, T, h, D, generator=g).transpose(1, 2) for h in (H, Hk, Hk))
    else:
        q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    wl, ll = 2 * torch.randn(H, generator=g), 2 * torch.randn(H, generator=g)
    return q, k, v, wl, ll, trained_maps(H, Hk, D) if fmap == "hedgehog" else "elu1"


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls the kernel ran (hybrid_attention_cpu returning a result)."""
    return count_calls(monkeypatch, cpu_prefill, "hybrid_attention_cpu")


def assert_same_state(got, want, atol=1e-5):
    assert got.seen == want.seen
    for name in ("k_window", "v_window", "window_valid", "S", "z"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=atol, rtol=1e-5, msg=name)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 150, 64, 16), (1, 3, 3, 97, 128, 64), (1, 2, 1, 40, 64, 1), (1, 6, 2, 300, 64, 100)]
)
def test_matches_the_naive_op(formulation, fmap, shape, native_calls):
    """Output and decode state equal the reference (full [T, T] masks), for GQA, batch 2, D = 128, a
    window of one key and one off the tiles (100); the model's layout (views of [B, T, H, D]) in and out."""
    B, H, Hk, T, D, w = shape
    q, k, v, wl, ll, feature = problem(B, H, Hk, T, D, fmap, model_layout=True)
    kw = dict(window=w, formulation=formulation, feature_map=feature, output_final_state=True)
    with torch.no_grad():
        got, state = hybrid_attention(q, k, v, wl, ll, backend="chunked", **kw)
        want, want_state = hybrid_attention(q, k, v, wl, ll, backend="reference", **kw)
    assert native_calls["ran"] == 1
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert got.transpose(1, 2).is_contiguous()  # what the layer's output projection reads, no copy
    assert_same_state(state, want_state)


def test_threads_split_the_positions_without_changing_a_number(monkeypatch, native_calls):
    """Segments start from the sums of the keys before them: 1 and 3 threads give the same output
    and state, to rounding."""
    monkeypatch.setattr(cpu_prefill, "MIN_SEGMENT", 16)
    q, k, v, wl, ll, feature = problem(1, 6, 2, 203, 64, "hedgehog")
    runs, threads = {}, torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert len(cpu_prefill._segments(203, n)) == n + 1
            with torch.no_grad():
                runs[n] = hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", feature_map=feature,
                                           backend="auto", output_final_state=True)
    finally:
        torch.set_num_threads(threads)
    assert native_calls["ran"] == 2
    torch.testing.assert_close(runs[3][0], runs[1][0], atol=1e-6, rtol=1e-5)
    assert_same_state(runs[3][1], runs[1][1], atol=1e-5)


@pytest.mark.parametrize("formulation", ["hybrid", "lolcats", "window"])
@pytest.mark.parametrize("fmap", ["elu1", "hedgehog"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 150, 64, 16), (1, 6, 3, 203, 128, 8), (1, 2, 1, 70, 64, 1)])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_decaying_state_matches_the_torch_ops(formulation, fmap, shape, threads, monkeypatch, native_calls):
    """With log_decay the kernel's output and final state (S, z as of the last position) equal the
    chunked torch ops' and the reference's, in one segment and in three (each starting from the decayed
    sums before it, segment bounds off the kernel's blocks of 16), for GQA, batch 2 and D = 128."""
    monkeypatch.setattr(cpu_prefill, "MIN_SEGMENT", 16)
    B, H, Hk, T, D, w = shape
    q, k, v, wl, ll, feature = problem(B, H, Hk, T, D, fmap, model_layout=True)
    log_decay = torch.linspace(-0.01, -0.6, Hk)
    kw = dict(window=w, formulation=formulation, feature_map=feature, output_final_state=True, log_decay=log_decay)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.no_grad():
            got, state = hybrid_attention(q, k, v, wl, ll, backend="auto", **kw)
    finally:
        torch.set_num_threads(saved)
    with torch.no_grad():
        chunked, chunked_state = hybrid_attention(q, k, v, wl, ll, backend="torch", **kw)
        want, _ = hybrid_attention(q, k, v, wl, ll, backend="reference", **kw)
        undecayed, _ = hybrid_attention(q, k, v, wl, ll, backend="torch", **dict(kw, log_decay=None))
    assert native_calls == {"ran": 1, "declined": 0}
    torch.testing.assert_close(got, chunked, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    if formulation != "window":
        assert (got - undecayed).abs().max() > 1e-3  # the decay is felt
    assert_same_state(state, chunked_state)


def test_segments_with_a_decay_start_from_the_aged_sums(monkeypatch, native_calls):
    """One, two and five segments (bounds inside the window's reach of each other and off the blocks)
    give the same output and state: each segment's starting sums are the previous ones aged by gamma
    per key that left in between, plus its own keys at their ages."""
    monkeypatch.setattr(cpu_prefill, "MIN_SEGMENT", 20)
    q, k, v, wl, ll, feature = problem(1, 4, 2, 111, 64, "hedgehog", seed=7)
    log_decay = torch.tensor([-0.05, -1.5])  # gamma 0.95 and 0.22
    runs, saved = {}, torch.get_num_threads()
    try:
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            assert len(cpu_prefill._segments(111, n)) == n + 1
            with torch.no_grad():
                runs[n] = hybrid_attention(q, k, v, wl, ll, window=12, formulation="hybrid", feature_map=feature,
                                           backend="chunked", output_final_state=True, log_decay=log_decay)
    finally:
        torch.set_num_threads(saved)
    assert native_calls["ran"] == 3
    for n in (2, 5):
        torch.testing.assert_close(runs[n][0], runs[1][0], atol=1e-6, rtol=1e-5)
        assert_same_state(runs[n][1], runs[1][1])


def test_decode_continues_the_native_prefill(native_calls):
    """Prefill T tokens natively, then step: the outputs are the naive op's over T + n positions."""
    B, H, Hk, T, n, D, w = 2, 4, 2, 90, 6, 64, 16
    q, k, v, wl, ll, feature = problem(B, H, Hk, T + n, D, "hedgehog")
    kw = dict(formulation="lolcats", feature_map=feature)
    with torch.no_grad():
        naive, _ = hybrid_attention(q, k, v, wl, ll, window=w, backend="reference", **kw)
        first, state = hybrid_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], wl, ll, window=w,
                                        output_final_state=True, **kw)
        outs = [first]
        for t in range(T, T + n):
            o, state = hybrid_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, wl,
                                             ll, inplace=True, **kw)
            outs.append(o)
    assert native_calls["ran"] == 1
    torch.testing.assert_close(torch.cat(outs, dim=2), naive, atol=2e-6, rtol=1e-5)


def test_bf16_model_takes_the_kernel_in_fp32(monkeypatch, native_calls):
    """A model evaluated in bf16 prefills natively too, with fp32 copies of its maps: the output is the
    naive fp32 op's on the same values, rounded to bf16, and the decode state that of the fp32 op
    with the dtypes the torch path gives a bf16 model (the decode step that follows reads them)."""
    B, H, Hk, T, D, w = 1, 6, 2, 200, 64, 16
    q, k, v, wl, ll, maps = problem(B, H, Hk, T, D, "hedgehog", model_layout=True)
    low = [t.bfloat16() for t in (q, k, v, wl, ll)]
    maps16 = tuple(copy.deepcopy(m).to(torch.bfloat16) for m in maps)
    maps32 = tuple(copy.deepcopy(m).float() for m in maps16)  # the bf16 values, in fp32
    kw = dict(window=w, formulation="lolcats", output_final_state=True)
    with torch.no_grad():
        got, state = hybrid_attention(*low, backend="chunked", feature_map=maps16, **kw)
        want, want_state = hybrid_attention(*(t.float() for t in low), backend="reference", feature_map=maps32, **kw)
        monkeypatch.setenv("HYBRID_LLAMA_NATIVE", "0")
        _, torch_state = hybrid_attention(*low, backend="chunked", feature_map=maps16, **kw)
    assert native_calls["ran"] == 1
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=8e-3)  # one bf16 rounding of the output
    for name in ("k_window", "v_window", "window_valid", "S", "z"):
        assert getattr(state, name).dtype == getattr(torch_state, name).dtype, name
        torch.testing.assert_close(getattr(state, name).float(), getattr(want_state, name).float(), atol=1e-5,
                                   rtol=1e-5, msg=name)


def test_torch_ops_where_the_kernel_does_not_apply(monkeypatch, native_calls):
    """Autograd, a padding mask, a head dim off the kernel's tile, backend='torch' and
    HYBRID_LLAMA_NATIVE=0 all run the chunked torch ops, with the reference's results."""
    q, k, v, wl, ll, feature = problem(1, 4, 2, 80, 64, "elu1")
    kw = dict(window=8, formulation="lolcats", feature_map=feature)
    want, _ = hybrid_attention(q, k, v, wl, ll, backend="reference", **kw)

    leaf = q.clone().requires_grad_()
    out, _ = hybrid_attention(leaf, k, v, wl, ll, backend="auto", **kw)
    out.sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    torch.testing.assert_close(out.detach(), want, atol=2e-6, rtol=1e-5)

    with torch.no_grad():
        mask = torch.ones(1, 80, dtype=torch.bool)
        mask[0, :5] = False
        padded, _ = hybrid_attention(q, k, v, wl, ll, backend="chunked", key_padding_mask=mask, **kw)
        torch.testing.assert_close(padded, hybrid_attention(q, k, v, wl, ll, backend="reference",
                                                            key_padding_mask=mask, **kw)[0], atol=2e-6, rtol=1e-5)
        q48, k48, v48, *_ = problem(1, 4, 2, 80, 48, "elu1")
        hybrid_attention(q48, k48, v48, wl, ll, backend="chunked", **kw)
        torch.testing.assert_close(hybrid_attention(q, k, v, wl, ll, backend="torch", **kw)[0], want,
                                   atol=2e-6, rtol=1e-5)
        monkeypatch.setenv("HYBRID_LLAMA_NATIVE", "0")
        torch.testing.assert_close(hybrid_attention(q, k, v, wl, ll, backend="chunked", **kw)[0], want,
                                   atol=2e-6, rtol=1e-5)
    assert native_calls["ran"] == 0


def test_kernel_declines_what_it_cannot_index():
    """The entry point itself refuses sizes it was not built for, rather than reading past a buffer
    (every tensor pointer here is NULL: a call that went ahead would crash)."""
    lib = native.load()

    def call(D=64, F=64, map_code=0, bounds=(0, 10), T=10, stride=1 << 20):
        strided = [None, 0, 0, 0]
        edges = (ctypes.c_longlong * len(bounds))(*bounds)
        return lib.hybrid_prefill_f32(1, 2, 1, T, D, 4, F, 1, map_code, len(bounds) - 1, edges, *strided * 3,
                                      *[None] * 9, *strided, None, stride)  # wq .. z: log_decay NULL

    assert call(D=48, F=48) == -1  # not a multiple of the tile
    assert call(F=32) == -1  # elu1 keeps the head dim
    assert call(map_code=1, F=63) == -1  # Hedgehog's two halves
    assert call(map_code=7) == -1
    assert call(bounds=(0, 11)) == -1  # a segment past T
    assert call(bounds=(0, 6, 5, 10)) == -1  # segments out of order
    assert call(stride=10) == -1  # a workspace too small


def test_model_prefill_and_generation_with_the_kernel(monkeypatch, native_calls):
    """A hybrid model with 64-wide heads: logits with the kernel equal those without it, and cached
    greedy generation after a prompt longer than the window equals generation without a cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_llama.eval.throughput import greedy_decode
    from hybrid_llama.models import convert_to_hybrid

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, intermediate_size=256, vocab_size=97, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    convert_to_hybrid(model, layers=[0, 1], window=8, formulation="lolcats", feature_map="hedgehog")
    model.eval()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native_logits = model(ids).logits
        assert native_calls["ran"] == 2
        with monkeypatch.context() as mp:
            mp.setenv("HYBRID_LLAMA_NATIVE", "0")
            torch_logits = model(ids).logits
        assert native_calls["ran"] == 2
    torch.testing.assert_close(native_logits, torch_logits, atol=1e-5, rtol=1e-5)
    cached = greedy_decode(model, ids, 10, use_cache=True)
    assert native_calls["ran"] == 4  # the prefill's two hybrid layers
    assert torch.equal(cached, greedy_decode(model, ids, 10, use_cache=False))


def test_a_decaying_model_prefills_and_decodes_natively(monkeypatch, native_calls):
    """A hybrid model with a decay and 64-wide heads: the prompt takes the native prefill and every
    generate step the native step, with the decay (logits equal the torch paths', cached greedy
    generation equals generation without a cache, and a decay changed in place is followed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_llama.eval.throughput import greedy_decode
    from hybrid_llama.models import convert_to_hybrid
    from hybrid_llama.ops.native import step as cpu_step

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, intermediate_size=256, vocab_size=97, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    convert_to_hybrid(model, layers=[0, 1], window=8, formulation="lolcats", feature_map="hedgehog", decay=0.9)
    model.eval()
    layers = [block.self_attn for block in model.model.layers]
    assert all(layer.hybrid.native_steps for layer in layers)
    steps = count_calls(monkeypatch, cpu_step, "step_in_place")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native_logits = model(ids).logits
        with monkeypatch.context() as mp:
            mp.setenv("HYBRID_LLAMA_NATIVE", "0")
            torch_logits = model(ids).logits
        for layer in layers:
            layer.mixing.decay_logit.fill_(30.0)  # gamma = 1 in fp32: the undecayed model
        undecayed = model(ids).logits
    assert native_calls["ran"] == 4  # two forwards' two hybrid layers
    torch.testing.assert_close(native_logits, torch_logits, atol=1e-5, rtol=1e-5)
    assert (native_logits - undecayed).abs().max() > 1e-4  # the decay is felt

    with torch.no_grad():
        for layer in layers:
            layer.mixing.decay_logit.fill_(-1.0)  # gamma 0.27, changed in place after the last forward
    cached = greedy_decode(model, ids, 10, use_cache=True)
    assert native_calls["ran"] == 6  # the prefill's two hybrid layers
    assert steps == {"ran": 10 * 2, "declined": 0}
    assert torch.equal(cached, greedy_decode(model, ids, 10, use_cache=False))
