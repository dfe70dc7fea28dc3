"""AppendKVCacheLayer against transformers' own DynamicLayer, and in a hybrid model's generation."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hybrid_llama.layers import AppendKVCacheLayer, HybridCacheLayer, append_kv_cache_layer
from hybrid_llama.layers.append_kv_cache import MAX_HEADROOM, MIN_HEADROOM
from hybrid_llama.models import cache_nbytes_by_layer, convert_to_hybrid, load_model

B, H, D = 2, 3, 8


def kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)


def assert_same(ours: AppendKVCacheLayer, theirs: DynamicLayer) -> None:
    assert ours.get_seq_length() == theirs.get_seq_length()
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)


def test_updates_return_what_dynamic_layer_returns():
    ours, theirs = AppendKVCacheLayer(), DynamicLayer()
    lengths = [5] + [1] * 40 + [3, 1, 7] + [1] * 300
    for i, t in enumerate(lengths):
        k, v = kv(t, i)
        got, want = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert_same(ours, theirs)
        # the spare room stays within the headroom rule: a quarter of the length, 16 to 256 tokens
        n = ours.get_seq_length()
        per_token = 2 * B * H * D * 4
        assert n * per_token <= ours.nbytes() <= (n + min(MAX_HEADROOM, max(MIN_HEADROOM, n // 4))) * per_token
        if i == 0:
            assert ours.nbytes() == n * per_token  # the prompt is stored without spare room


def test_steps_write_in_place_and_earlier_outputs_keep_their_values():
    layer = AppendKVCacheLayer()
    layer.update(*kv(40, 0))
    first_k, _ = layer.update(*kv(1, 1))  # grows once: 41 + 16 spare tokens
    snapshot = first_k.clone()
    buffer = layer._k_buffer.data_ptr()
    for i in range(10):
        layer.update(*kv(1, 2 + i))
    assert layer._k_buffer.data_ptr() == buffer  # no copy of the cache per step
    assert torch.equal(first_k, snapshot)


@pytest.mark.parametrize("operation", ["crop", "select", "repeat", "reorder", "reset"])
def test_cache_operations_match_dynamic_layer(operation):
    ours, theirs = AppendKVCacheLayer(), DynamicLayer()
    for i, t in enumerate([6, 1, 1, 1]):
        k, v = kv(t, i)
        ours.update(k, v)
        theirs.update(k, v)
    for layer in (ours, theirs):
        if operation == "crop":
            layer.crop(-3)
        elif operation == "select":
            layer.batch_select_indices(torch.tensor([1]))
        elif operation == "repeat":
            layer.batch_repeat_interleave(2)
        elif operation == "reorder":
            layer.reorder_cache(torch.tensor([1, 0]))
        else:
            layer.reset()
    rows = theirs.keys.shape[0] if theirs.is_initialized else B
    for i in range(20):
        k, v = kv(1, 10 + i)
        k, v = k[:1].expand(rows, -1, -1, -1).contiguous(), v[:1].expand(rows, -1, -1, -1).contiguous()
        ours.update(k, v)
        theirs.update(k, v)
        assert_same(ours, theirs)


def test_updates_autograd_sees_concatenate_and_backpropagate():
    layer = AppendKVCacheLayer()
    k1, v1 = (t.requires_grad_() for t in kv(4, 0))
    k2, v2 = (t.requires_grad_() for t in kv(1, 1))
    a = layer.update(k1, v1)[0].sum()
    keys, values = layer.update(k2, v2)
    (a + keys.square().sum() + values.sum()).backward()
    assert torch.allclose(k1.grad, 1 + 2 * k1.detach()) and torch.allclose(k2.grad, 2 * k2.detach())
    assert torch.equal(v2.grad, torch.ones_like(v2))


def test_taking_over_a_filled_dynamic_layer_keeps_its_keys():
    cache = DynamicCache()
    k, v = kv(9, 0)
    cache.update(k, v, 0)
    append_kv_cache_layer(cache, 0)
    append_kv_cache_layer(cache, 2)  # slots up to 2 are created, as Cache.update would; only 2 is swapped
    assert [type(layer) for layer in cache.layers] == [AppendKVCacheLayer, DynamicLayer, AppendKVCacheLayer]
    assert torch.equal(cache.layers[0].keys, k)
    k2, v2 = kv(1, 1)
    keys, _ = cache.update(k2, v2, 0)
    assert torch.equal(keys, torch.cat([k, k2], dim=2))


def test_hybrid_model_softmax_layers_append_in_place(lively_dir):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=4)
    enc = tok(["keys appended in place"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    kinds = [type(layer) for layer in out.past_key_values.layers]
    assert kinds == [HybridCacheLayer, AppendKVCacheLayer, HybridCacheLayer, AppendKVCacheLayer]
    n = enc["input_ids"].shape[1] + 19
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    assert n * per_token <= cache_nbytes_by_layer(out.past_key_values)[1] <= (n + MIN_HEADROOM) * per_token
