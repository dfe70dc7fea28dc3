"""Heads kept softmax (``softmax_heads``): exact attention over the whole context for chosen KV heads."""

from __future__ import annotations

import pytest
import torch
from test_models import assert_cached_generation_equals_uncached, greedy, randomize_hybrid_params
from transformers import DynamicCache

from hybrid_llama.layers.exact_heads import exact_mask
from hybrid_llama.models import (
    HybridConfig,
    HybridLlamaAttention,
    cache_nbytes_by_layer,
    convert_to_hybrid,
    load_hybrid,
    load_model,
    save_hybrid,
)

LAYERS = [0, 2]
EXACT = [[0, 1], [2, 0]]


def hybrid(lively_dir, softmax_heads=EXACT, formulation="lolcats", feature_map="hedgehog", **kw):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, LAYERS, window=4, formulation=formulation, feature_map=feature_map,
                      softmax_heads=softmax_heads, **kw)
    randomize_hybrid_params(model)
    return model.eval(), tok


def attention_inputs(model, ids):
    """The input of every hybrid layer's o_proj (its heads' outputs), from one forward."""
    seen = {}
    hooks = [m.self_attn.o_proj.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0]))
             for i, m in enumerate(model.model.layers) if isinstance(m.self_attn, HybridLlamaAttention)]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def test_every_head_exact_is_the_softmax_model(lively_dir):
    base, _ = load_model(lively_dir, dtype=torch.float32)
    every = [[layer, h] for layer in LAYERS for h in range(base.config.num_key_value_heads)]
    model, _ = hybrid(lively_dir, every, sparse_cache=4, sinks=2)
    ids = torch.randint(3, base.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base.eval()(ids).logits, atol=1e-4, rtol=1e-4)


def test_exact_heads_replace_only_their_query_heads(lively_dir):
    """Layer 0 keeps KV head 1 exact: query heads 2 and 3 (GQA, 4 heads over 2) read base's
    softmax, heads 0 and 1 the hybrid op unchanged."""
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    base, _ = load_model(lively_dir, dtype=torch.float32)
    base_heads = {}
    base.model.layers[0].self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args: base_heads.__setitem__(0, args[0]))
    with torch.no_grad():
        base.eval()(ids)
    kept = attention_inputs(hybrid(lively_dir, [[0, 1]])[0], ids)[0].view(1, 30, 4, -1)
    plain = attention_inputs(hybrid(lively_dir, [])[0], ids)[0].view(1, 30, 4, -1)
    torch.testing.assert_close(kept[:, :, 2:], base_heads[0].view(1, 30, 4, -1)[:, :, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[:, :, :2], plain[:, :, :2], atol=0, rtol=0)
    assert not torch.allclose(plain[:, :, 2:], kept[:, :, 2:], atol=1e-3)


@pytest.mark.parametrize("formulation,feature_map,sparse", [("hybrid", "elu1", 0), ("lolcats", "hedgehog", 0),
                                                            ("lolcats", "hedgehog", 4)])
def test_generate_with_cache_equals_without(lively_dir, formulation, feature_map, sparse, monkeypatch):
    import hybrid_llama.layers.hybrid_attention as layer_module

    native_steps = []
    step = layer_module.native_step_in_place
    monkeypatch.setattr(layer_module, "native_step_in_place",
                        lambda *a, **k: native_steps.append(step(*a, **k)) or native_steps[-1])
    model, tok = hybrid(lively_dir, formulation=formulation, feature_map=feature_map, sparse_cache=sparse,
                        sinks=2 if sparse else 0)
    enc = tok(["exact heads over the whole context"], return_tensors="pt")
    assert_cached_generation_equals_uncached(model, enc, 30)
    if model.config.hybrid.get("backend") == "auto" and formulation == "lolcats" and not sparse:
        assert any(o is not None for o in native_steps)  # the exact heads follow the native step too


def test_chunked_prompt_continues_like_one_forward(lively_dir):
    model, _ = hybrid(lively_dir)
    ids = torch.randint(3, 200, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                 for a, b in ((0, 12), (12, 13), (13, 33))]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_left_padded_batch_generates_like_single_prompts(lively_dir, attn_implementation):
    model, tok = hybrid(lively_dir)
    model.set_attn_implementation(attn_implementation)
    prompts = ["hi", "a longer prompt that pads the others on the left", "seven words or so, here"]
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    together = greedy(model, batch, 20)
    for i, prompt in enumerate(prompts):
        assert together[i, -20:].tolist() == greedy(model, tok([prompt], return_tensors="pt"), 20)[0, -20:].tolist()
    assert torch.equal(together, greedy(model, batch, 20, use_cache=False))


def test_cache_holds_the_exact_heads_keys(lively_dir):
    """A layer's slot grows by exactly its exact heads' keys and values: k and v of one KV head, fp32."""
    sizes = {}
    for heads in ([], EXACT):
        model, tok = hybrid(lively_dir, heads)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(torch.arange(3, 43)[None], past_key_values=cache, use_cache=True)
        sizes[len(heads)] = cache_nbytes_by_layer(cache)
    head_dim = model.config.head_dim
    for layer in LAYERS:
        assert sizes[2][layer] - sizes[0][layer] == 2 * 40 * head_dim * 4


def test_config_round_trip_and_errors(lively_dir, tmp_path):
    model, tok = hybrid(lively_dir, [[2, 0], [0, 1], [2, 0]])
    assert model.config.hybrid["softmax_heads"] == [[0, 1], [2, 0]]
    assert "softmax_heads" not in HybridConfig(layers=[0]).to_dict()  # models saved without it stay exact
    save_hybrid(model, tmp_path / "m", tokenizer=tok)
    loaded = load_hybrid(tmp_path / "m")
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.model.layers[2].self_attn.exact.kv_heads == [0]
    with pytest.raises(ValueError, match="layer 1 is not a hybrid layer"):
        HybridConfig(layers=[0, 2], softmax_heads=[[1, 0]])
    with pytest.raises(ValueError, match="KV head 5 does not exist"):
        hybrid(lively_dir, [[0, 5]])


def test_exact_mask_offsets_the_causal_diagonal():
    assert exact_mask(None, 1, 9, torch.device("cpu")) is None
    assert exact_mask(None, 5, 5, torch.device("cpu")) is None
    m = exact_mask(None, 2, 5, torch.device("cpu"))[0, 0]
    assert m.tolist() == [[True] * 4 + [False], [True] * 5]
    pad = torch.tensor([[0, 1, 1, 1, 1]])
    assert exact_mask(pad, 2, 5, torch.device("cpu"))[0, 0].tolist() == [[False, True, True, True, False],
                                                                          [False, True, True, True, True]]


def test_retrieval_head_ranking_reads_the_models_own_attention(lively_dir):
    """The needle mass per KV head equals what transformers' eager attention returns as its weights."""
    from hybrid_llama.eval.passkey import needle_trials
    from hybrid_llama.eval.retrieval_heads import SCORING_SEED, rank_retrieval_heads

    model, tok = load_model(lively_dir, dtype=torch.float32)
    model.eval()
    ranked = rank_retrieval_heads(model, tok, [1, 3], context_len=400, trials=2)
    assert not any(m.self_attn._forward_pre_hooks for m in model.model.layers)  # hooks removed
    assert [m for *_, m in ranked] == sorted((m for *_, m in ranked), reverse=True)
    model.set_attn_implementation("eager")
    expected = {}
    for t in needle_trials(tok, context_len=400, trials=2, seed=SCORING_SEED):
        ids = t["prompt"] + t["answer"][:-1]
        rows = list(range(len(t["prompt"]) - 1, len(ids)))
        with torch.no_grad():
            attn = model(torch.tensor([ids]), output_attentions=True).attentions
        for layer in (1, 3):
            mass = attn[layer][0][:, rows][:, :, t["needle"]].sum(-1).mean(-1)  # per query head
            for h in range(2):
                expected[(layer, h)] = expected.get((layer, h), 0.0) + float(mass[2 * h:2 * h + 2].sum()) / 2
    assert {(layer, h) for layer, h, _ in ranked} == set(expected)
    for layer, h, m in ranked:
        assert m == pytest.approx(expected[(layer, h)], rel=1e-4, abs=1e-6)


def test_retrieval_heads_cli_prints_softmax_heads(lively_dir, capsys):
    import json

    from hybrid_llama.eval.retrieval_heads import main

    main([str(lively_dir), "--layers", "0,2", "--top", "2", "--context-len", "400", "--trials", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    pairs = json.loads(out[-1])["softmax_heads"]
    assert len(pairs) == 2 and all(layer in (0, 2) and head in (0, 1) for layer, head in pairs)
    assert len(out) == 1 + 4  # the ranking of 2 layers x 2 KV heads, then the pairs


def test_the_whole_models_ranking_orders_each_subset_of_layers_as_ranking_it_alone(lively_dir, tmp_path):
    """The workflow ranks every layer once (retrieval_heads rule) and each variant takes its hybrid
    layers' heads from that list: that must be the order ranking those layers alone gives."""
    import json

    from hybrid_llama.eval.retrieval_heads import rank_model, rank_retrieval_heads, ranked_softmax_heads

    ranking = rank_model(lively_dir, context_len=400, trials=2)
    model, tok = load_model(lively_dir, dtype=torch.float32)
    heads = [(h["layer"], h["kv_head"]) for h in ranking["heads"]]
    assert sorted(heads) == [(layer, h) for layer in range(model.config.num_hidden_layers) for h in range(2)]
    masses = [h["needle_mass"] for h in ranking["heads"]]
    assert masses == sorted(masses, reverse=True) and masses[0] > masses[-1]
    alone = rank_retrieval_heads(model.eval(), tok, [1, 2], context_len=400, trials=2)
    assert [(layer, h) for layer, h in heads if layer in (1, 2)] == [(layer, h) for layer, h, _ in alone]

    file = tmp_path / "retrieval_heads.json"
    file.write_text(json.dumps(ranking))
    spec = {"layers": [1, 2], "window": 4, "softmax_heads": {"top": 2}}
    resolved = ranked_softmax_heads(spec, file)
    assert resolved["softmax_heads"] == sorted([[layer, h] for layer, h, _ in alone[:2]])
    assert resolved["window"] == 4 and spec["softmax_heads"] == {"top": 2}  # the input is not changed
    named = {"layers": [0], "softmax_heads": [[0, 1]]}
    assert ranked_softmax_heads(named, None) == named  # named heads need no ranking
    with pytest.raises(ValueError, match="more KV heads"):
        ranked_softmax_heads({**spec, "softmax_heads": {"top": 5}}, ranking)
    with pytest.raises(ValueError, match="retrieval_heads ranking"):
        ranked_softmax_heads(spec, None)
