"""The softmax layers' native decode step against its written-out reference and SDPA, and the
``SoftmaxLlamaAttention`` layer against transformers' own ``LlamaAttention`` in generation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import LlamaAttention

from hybrid_llama.eval.throughput import greedy_decode
from hybrid_llama.layers import AppendKVCacheLayer, SoftmaxLlamaAttention, as_softmax_layers, softmax_attention
from hybrid_llama.models import convert_to_hybrid, load_model
from hybrid_llama.models.convert import decoder_layers
from hybrid_llama.ops.native import build as native
from hybrid_llama.ops.native.softmax_decode import (
    KEYS_PER_CHUNK,
    keys_per_chunk,
    softmax_decode,
    softmax_decode_reference,
)

needs_kernels = pytest.mark.skipif(native.load() is None, reason=f"no native kernels: {native.why_not()}")


def cache_views(B: int, Hk: int, L: int, D: int, spare: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v ``[B, Hk, L, D]`` as a cache with spare capacity hands them out: views of bigger buffers."""
    g = torch.Generator().manual_seed(seed)
    kb, vb = (torch.randn(B, Hk, L + spare, D, generator=g) for _ in range(2))
    return kb[:, :, :L], vb[:, :, :L]


def sdpa_gqa(q, k, v, scale):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=scale)


def test_reference_is_sdpa():
    q = torch.randn(2, 6, 1, 32)
    k, v = cache_views(2, 3, 77, 32, 5, 0)
    torch.testing.assert_close(softmax_decode_reference(q, k, v, 0.2), sdpa_gqa(q, k, v, 0.2), atol=1e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize(
    "B,H,Hk,D,L",
    [
        (1, 9, 3, 64, 1),  # SmolLM2's heads, the first step
        (1, 9, 3, 64, 63),
        (1, 9, 3, 64, KEYS_PER_CHUNK),  # exactly one chunk
        (1, 9, 3, 64, KEYS_PER_CHUNK + 1),  # a chunk of one key
        (2, 32, 8, 64, 3000),  # Llama-3.2-1B's heads, several chunks per KV head
        (3, 4, 4, 128, 700),  # no GQA, D = 128
        (2, 16, 1, 16, 130),  # multi-query, the smallest head dim covered
    ],
)
def test_native_step_matches_reference(B, H, Hk, D, L):
    g = torch.Generator().manual_seed(L)
    q = torch.randn(B, H, 1, D, generator=g) * 3  # peaked softmaxes too
    k, v = cache_views(B, Hk, L, D, spare=19, seed=L)
    with torch.no_grad():
        out = softmax_decode(q, k, v, D**-0.5)
    assert out is not None and out.shape == (B, H, 1, D)
    want = softmax_decode_reference(q, k, v, D**-0.5)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, sdpa_gqa(q, k, v, D**-0.5), atol=2e-6, rtol=1e-5)
    # the output projection reads [B, 1, H, D]: the op's output is a view of that memory
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("L", [1, 63, 200, 1024, 5000])
@pytest.mark.parametrize("heads", [1, 3, 8])
def test_chunks_cover_the_keys_and_the_threads_share_them(L, heads, threads):
    chunk = keys_per_chunk(L, heads, threads)
    n = -(-L // chunk)
    assert 1 <= chunk <= max(KEYS_PER_CHUNK, L // 2 + 1) and (n - 1) * chunk < L
    if L >= 64 * 2 * threads:  # room for two chunks of at least a block per thread
        assert n * heads >= 2 * threads and (n * heads) % threads == 0


@needs_kernels
def test_any_thread_count_gives_the_same_step():
    q = torch.randn(1, 9, 1, 64)
    k, v = cache_views(1, 3, 2500, 64, 3, 2)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.no_grad():
                outs.append(softmax_decode(q, k, v, 0.125))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-5)


@needs_kernels
def test_query_views_of_a_projection_are_read_in_place():
    # q as a Llama layer makes it: [B, 1, H*D] -> [B, 1, H, D] -> transposed to [B, H, 1, D]
    q = torch.randn(2, 1, 6 * 32).view(2, 1, 6, 32).transpose(1, 2)
    k, v = cache_views(2, 2, 100, 32, 7, 1)
    with torch.no_grad():
        torch.testing.assert_close(softmax_decode(q, k, v, 0.1), softmax_decode_reference(q, k, v, 0.1),
                                   atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("case", ["head_dim", "fp64", "two_queries", "group", "autograd", "last_dim_strided"])
def test_uncovered_arguments_return_none(case):
    B, H, Hk, D, L = 1, 4, 2, 32, 50
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hk, L, D), torch.randn(B, Hk, L, D)
    if case == "head_dim":
        q, k, v = q[..., :24], k[..., :24].contiguous(), v[..., :24].contiguous()
    elif case == "fp64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "two_queries":
        q = torch.randn(B, H, 2, D)
    elif case == "group":
        q = torch.randn(B, 34, 1, D)
    elif case == "autograd":
        q.requires_grad_(True)
    elif case == "last_dim_strided":
        k = torch.randn(B, Hk, D, L).transpose(-1, -2)
    assert softmax_decode(q, k, v, 0.1) is None


def count_native_steps(monkeypatch, from_keys: int = 1) -> list[int]:
    """Every call of the kernel by the layers (True where it ran), with steps native from ``from_keys``
    keys (the tiny models' contexts are far below the default)."""
    monkeypatch.setattr(softmax_attention, "NATIVE_FROM_KEYS", from_keys)
    calls = []

    def spy(*args, **kwargs):
        out = softmax_decode(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(softmax_attention, "softmax_decode", spy)
    return calls


def plain_and_converted(model_dir):
    """The model as transformers loads it, the same with every layer a SoftmaxLlamaAttention, and the
    tokenizer."""
    plain, tok = load_model(model_dir, dtype=torch.float32)
    ours, _ = load_model(model_dir, dtype=torch.float32)
    as_softmax_layers([block.self_attn for block in decoder_layers(ours)])
    return plain, ours, tok


def test_conversion_swaps_the_class_and_keeps_everything_else(lively_dir):
    model, _ = load_model(lively_dir, dtype=torch.float32)
    names = {k: v.data_ptr() for k, v in model.state_dict().items()}
    attns = [block.self_attn for block in decoder_layers(model)]
    as_softmax_layers(attns)
    as_softmax_layers(attns)  # again: nothing changes
    assert [type(a) for a in attns] == [SoftmaxLlamaAttention] * len(attns)
    assert all(isinstance(a, LlamaAttention) for a in attns)
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == names


def test_prompt_keeps_transformers_slot_and_first_step_adopts_it(lively_dir):
    """A prompt runs in transformers' own DynamicLayer; the first one-token step swaps in the in-place
    slot holding the prompt's keys and appends to them, as transformers' layers compute it."""
    plain, ours, tok = plain_and_converted(lively_dir)
    ids = tok(["a prompt keeps its slot"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got = ours(ids, use_cache=True)
        cache = got.past_key_values
        assert all(type(layer) is DynamicLayer for layer in cache.layers)
        prompt_keys = [layer.keys for layer in cache.layers]
        token = got.logits[:, -1:].argmax(-1)
        step = ours(token, past_key_values=cache, use_cache=True)
        want = plain(torch.cat([ids, token], dim=1), use_cache=False)
    torch.testing.assert_close(step.logits[:, -1], want.logits[:, -1], atol=1e-5, rtol=1e-5)
    assert all(type(layer) is AppendKVCacheLayer for layer in cache.layers)
    for layer, keys in zip(cache.layers, prompt_keys):
        assert layer.get_seq_length() == ids.shape[1] + 1
        torch.testing.assert_close(layer.keys[:, :, :-1], keys, atol=0, rtol=0)


@needs_kernels
def test_decode_equals_transformers_attention(lively_dir, monkeypatch):
    """Base with every layer converted decodes as transformers' own layers do, step by step; every
    step after the prompt ran the kernel."""
    plain, ours, tok = plain_and_converted(lively_dir)
    calls = count_native_steps(monkeypatch)
    ids = tok(["the native step reads the whole cache"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = plain(ids, use_cache=True)
        got = ours(ids, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits)
        assert calls == []  # the prompt is LlamaAttention's own forward
        token = want.logits[:, -1:].argmax(-1)
        cache_w, cache_g = want.past_key_values, got.past_key_values
        for _ in range(12):
            w = plain(token, past_key_values=cache_w, use_cache=True)
            g = ours(token, past_key_values=cache_g, use_cache=True)
            torch.testing.assert_close(g.logits, w.logits, atol=1e-5, rtol=1e-5)
            token, cache_w, cache_g = w.logits.argmax(-1), w.past_key_values, g.past_key_values
    n_layers = len(decoder_layers(ours))
    assert calls == [True] * (12 * n_layers)
    assert all(type(layer) is AppendKVCacheLayer for layer in cache_g.layers)


@needs_kernels
def test_hybrid_generation_cached_equals_uncached(lively_dir, monkeypatch):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=4)
    assert [type(b.self_attn) for b in decoder_layers(model)][1::2] == [SoftmaxLlamaAttention] * 2
    calls = count_native_steps(monkeypatch)
    ids = tok(["a hybrid decodes its softmax layers natively"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        cached = greedy_decode(model, ids, 24)
        uncached = greedy_decode(model, ids, 24, use_cache=False)
    assert torch.equal(cached, uncached)
    assert calls and all(calls)


@needs_kernels
def test_steps_run_natively_from_the_threshold(lively_dir, monkeypatch):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    as_softmax_layers([block.self_attn for block in decoder_layers(model)])
    ids = tok(["a cache that grows past the threshold"], return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    calls = count_native_steps(monkeypatch, from_keys=n + 5)
    with torch.no_grad():
        greedy_decode(model, ids, 10)
    # the 10 steps hold n + 1 .. n + 10 keys: those from n + 5 on run natively, in every layer
    assert calls == [True] * 6 * len(decoder_layers(model))


def test_short_context_steps_make_llama_attentions_sdpa_call_themselves(lively_dir, monkeypatch):
    """Below the native threshold an unmasked one-token step skips LlamaAttention's forward (its
    attention-interface dispatch) and makes the same SDPA call: the logits are transformers' own,
    step by step, and only the prompt ran LlamaAttention's forward."""
    plain, ours, tok = plain_and_converted(lively_dir)
    calls = count_native_steps(monkeypatch, from_keys=10**6)
    generic = []
    original = LlamaAttention.forward

    def spy(self, hidden_states, *args, **kwargs):
        if type(self) is SoftmaxLlamaAttention:
            generic.append(hidden_states.shape[-2])
        return original(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(LlamaAttention, "forward", spy)
    ids = tok(["short steps are one sdpa call"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = plain(ids, use_cache=True)
        got = ours(ids, use_cache=True)
        token, cache_w, cache_g = want.logits[:, -1:].argmax(-1), want.past_key_values, got.past_key_values
        for _ in range(10):
            w = plain(token, past_key_values=cache_w, use_cache=True)
            g = ours(token, past_key_values=cache_g, use_cache=True)
            torch.testing.assert_close(g.logits, w.logits, atol=1e-6, rtol=1e-6)
            token, cache_w, cache_g = w.logits.argmax(-1), w.past_key_values, g.past_key_values
    assert generic == [ids.shape[1]] * len(decoder_layers(ours))  # the prompt only
    assert calls == []


def test_masked_batches_and_training_run_llama_attention(lively_dir, monkeypatch):
    """A padded batch decodes with a mask, and training needs autograd: both are LlamaAttention's
    forward, so they give what the plain model gives."""
    plain, ours, tok = plain_and_converted(lively_dir)
    calls = count_native_steps(monkeypatch)
    tok.padding_side = "left"
    enc = tok(["short", "a much longer prompt than that"], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = plain.generate(**enc, max_new_tokens=8, do_sample=False)
        got = ours.generate(**enc, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)
    ids = enc["input_ids"][1:]
    loss_w = plain(ids, labels=ids).loss
    loss_g = ours(ids, labels=ids).loss
    loss_w.backward()
    loss_g.backward()
    torch.testing.assert_close(loss_g, loss_w)
    q_w = decoder_layers(plain)[0].self_attn.q_proj.weight.grad
    torch.testing.assert_close(decoder_layers(ours)[0].self_attn.q_proj.weight.grad, q_w)
    assert not any(calls)


def test_without_native_kernels_the_step_is_sdpa(lively_dir, monkeypatch):
    monkeypatch.setenv("HYBRID_LLAMA_NATIVE", "0")
    plain, ours, tok = plain_and_converted(lively_dir)
    calls = count_native_steps(monkeypatch)
    ids = tok(["no kernels"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(greedy_decode(ours, ids, 10), greedy_decode(plain, ids, 10))
    assert calls == []
