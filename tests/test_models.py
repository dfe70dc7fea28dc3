"""The hybrid layer, conversion, hybrid-aware cache, save/load."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hybrid_llama.layers import HybridCacheLayer, keys_valid_from_mask
from hybrid_llama.models import (
    HybridConfig,
    HybridLlamaAttention,
    HybridLlamaConfig,
    HybridLlamaForCausalLM,
    cache_nbytes_by_layer,
    convert_to_hybrid,
    hybrid_cache_nbytes,
    hybrid_config_of,
    hybrid_parameter_names,
    load_hybrid,
    load_hybrid_layers,
    load_model,
    make_hybrid_attention,
    save_hybrid,
)
from hybrid_llama.weights import resolve_model

BACKEND = "auto"
HYBRID_LAYERS = [0, 2]
VARIANTS = [("hybrid", "elu1"), ("lolcats", "hedgehog")]


# ------------------------------------------------------------------------------------ helpers


def randomize_hybrid_params(model, seed: int = 0) -> None:
    """Move mixing logits (and hedgehog maps) away from their init so every term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, HybridLlamaAttention):
                for p in (mod.mixing.window_logit, mod.mixing.linear_logit):
                    p.copy_(torch.randn(p.shape, generator=g) * 1.5)
                for p in mod.feature_map.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.3)


def naive_hybrid(q, k, v, window_logit, linear_logit, window, key_valid=None, formulation="hybrid", phi=None,
                 k_features=None):
    """O(T^2) masked transcription of docs/design.md, written independently of hybrid_llama.ops.
    ``phi`` maps the queries (and the keys, unless their features ``k_features`` are given)."""
    phi = phi or (lambda x: F.elu(x) + 1)
    k_features = phi(k) if k_features is None else k_features
    B, H, T, D = q.shape
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    win = (j <= i) & (j > i - window)
    lin = j <= i - window
    if key_valid is not None:
        win = win & key_valid[:, None, None, :]
        lin = lin & key_valid[:, None, None, :]
    else:
        win, lin = win.expand(B, 1, T, T), lin.expand(B, 1, T, T)
    a = torch.sigmoid(window_logit)[None, :, None, None]
    b = torch.sigmoid(linear_logit)[None, :, None, None]
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    m = s.masked_fill(~win, -torch.inf).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * win
    lin_w = (phi(q) @ k_features.transpose(-1, -2)) * lin
    if formulation == "hybrid":
        has_win = win.any(-1, keepdim=True)
        win_out = (e @ v) / e.sum(-1, keepdim=True).clamp_min(1e-30)
        a = a * has_win
        return (a * win_out + b * (lin_w @ v)) / (a + b * lin_w.sum(-1, keepdim=True))
    return (a * (e @ v) + b * (lin_w @ v)) / (a * e.sum(-1, keepdim=True) + b * lin_w.sum(-1, keepdim=True))


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def hybrid_lively(lively_dir, formulation="hybrid", feature_map="elu1", window=4, layers=HYBRID_LAYERS):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, layers, window=window, formulation=formulation, feature_map=feature_map,
                      backend=BACKEND)
    randomize_hybrid_params(model)
    return model.eval(), tok


def greedy(model, enc, n, **kw):
    with torch.no_grad():
        return model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def assert_cached_generation_equals_uncached(model, enc, n: int):
    """Greedy generation of ``n`` tokens with the cache gives the uncached tokens and scores; returns
    the cached run (``return_dict_in_generate``)."""
    with torch.no_grad():
        cached = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                                output_scores=True, return_dict_in_generate=True)
        uncached = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=False,
                                  output_scores=True, return_dict_in_generate=True)
    assert torch.equal(cached.sequences, uncached.sequences)
    new = cached.sequences[0, enc["input_ids"].shape[1]:]
    assert len(set(new.tolist())) > 5  # the model is not stuck repeating one token
    for a, b in zip(cached.scores, uncached.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    return cached


# ---------------------------------------------------------------------------------- conversion


def test_convert_keeps_untouched_layers_bit_identical(tiny_model):
    model, _ = tiny_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old_attn = [blk.self_attn for blk in model.model.layers]
    convert_to_hybrid(model, HYBRID_LAYERS, window=8, backend=BACKEND)
    after = model.state_dict()
    for name, value in before.items():
        assert name in after, name
        assert torch.equal(after[name], value), name  # hybrid q/k/v/o are copied, everything else untouched
    for i, blk in enumerate(model.model.layers):
        if i in HYBRID_LAYERS:
            assert isinstance(blk.self_attn, HybridLlamaAttention)
            assert blk.self_attn.q_proj.weight.data_ptr() != old_attn[i].q_proj.weight.data_ptr()
        else:
            assert blk.self_attn is old_attn[i]
    new_names = set(after) - set(before)
    assert new_names == {f"model.layers.{i}.self_attn.mixing.{p}" for i in HYBRID_LAYERS
                         for p in ("window_logit", "linear_logit")}
    assert model.config.hybrid == {"layers": HYBRID_LAYERS, "window": 8, "formulation": "hybrid",
                                   "feature_map": "elu1", "backend": BACKEND}
    mix = model.model.layers[0].self_attn.mixing
    assert mix.window_logit.shape == (model.config.num_attention_heads,)
    assert torch.equal(mix.window_logit, torch.zeros(4)) and torch.equal(mix.linear_logit, torch.zeros(4))


def test_hybrid_parameter_names(tiny_model):
    model, _ = tiny_model
    convert_to_hybrid(model, [1], feature_map="hedgehog", backend=BACKEND)
    names = hybrid_parameter_names(model)
    prefix = "model.layers.1.self_attn."
    assert set(names) == {prefix + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                               "mixing.window_logit", "mixing.linear_logit",
                                               "feature_map.q.weight", "feature_map.q.bias",
                                               "feature_map.k.weight", "feature_map.k.bias")}
    params = dict(model.named_parameters())
    assert all(n in params for n in names)


def test_teacher_never_drifts_when_student_trains(tiny_model):
    teacher, tok = tiny_model
    teacher.requires_grad_(False)
    frozen = {k: v.clone() for k, v in teacher.state_dict().items()}
    # The student shares every tensor with the teacher except the converted attention modules.
    student = type(teacher)(copy.deepcopy(teacher.config))
    student.load_state_dict(teacher.state_dict(), assign=True)
    q_teacher = teacher.model.layers[0].self_attn.q_proj.weight
    assert student.model.layers[0].self_attn.q_proj.weight.data_ptr() == q_teacher.data_ptr()
    convert_to_hybrid(student, HYBRID_LAYERS, window=4, backend=BACKEND)
    names = set(hybrid_parameter_names(student))
    trainable = [p for n, p in student.named_parameters() if n in names]
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.SGD(trainable, lr=1.0)
    enc = tok(["the teacher stays put"], return_tensors="pt")
    student.train()
    loss = student(**enc, labels=enc["input_ids"], use_cache=False).loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        for p in trainable:
            p.add_(1.0)  # and an in-place edit, for good measure
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, frozen[name]), name
    assert not torch.equal(student.model.layers[0].self_attn.q_proj.weight,
                           teacher.model.layers[0].self_attn.q_proj.weight)


def test_convert_errors(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="out of range"):
        convert_to_hybrid(model, [4])
    with pytest.raises(ValueError, match="window"):
        convert_to_hybrid(model, [0], window=0)
    with pytest.raises(ValueError, match="feature_map"):
        convert_to_hybrid(model, [0], feature_map="relu")
    convert_to_hybrid(model, [0])
    with pytest.raises(ValueError, match="already"):
        convert_to_hybrid(model, [1])
    with pytest.raises(ValueError, match="already hybrid"):
        make_hybrid_attention(model.model.layers[0].self_attn, HybridConfig(layers=[0]))


def test_sparse_settings_follow_the_config_fields():
    """``HybridConfig.sparse`` is kept between reads, and follows fields set after the first read;
    the config's dict and equality stay its fields'."""
    cfg = HybridConfig(layers=[0], formulation="lolcats")
    first = cfg.sparse
    assert cfg.sparse is first and not first.active
    cfg.sparse_cache, cfg.sinks, cfg.cache_score = 8, 2, "random"
    assert (cfg.sparse.size, cfg.sparse.sinks, cfg.sparse.score) == (8, 2, "random")
    assert cfg == HybridConfig(layers=[0], formulation="lolcats", sparse_cache=8, sinks=2, cache_score="random")
    assert "_sparse" not in cfg.to_dict()


# ------------------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("formulation,feature_map", VARIANTS)
@pytest.mark.parametrize("mask_kind", ["none", "bool4d", "float4d", "2d"])
def test_layer_matches_naive_formula(tiny_model, formulation, feature_map, mask_kind):
    model, _ = tiny_model
    torch.manual_seed(0)
    attn = model.model.layers[1].self_attn
    cfg = HybridConfig(layers=[1], window=3, formulation=formulation, feature_map=feature_map, backend=BACKEND)
    layer = make_hybrid_attention(attn, cfg)
    randomize_hybrid_params(layer, seed=3)
    B, T, C = 2, 11, model.config.hidden_size
    x = torch.randn(B, T, C)
    valid = torch.ones(B, T, dtype=torch.bool)
    if mask_kind != "none":
        valid[1, :4] = False  # left padding in row 1
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    cos, sin = model.model.rotary_emb(x, pos)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    mask4 = causal[None, None] & valid[:, None, None, :]
    mask = {"none": None, "bool4d": mask4, "2d": valid.long(),
            "float4d": torch.zeros(B, 1, T, T).masked_fill(~mask4, torch.finfo(torch.float32).min)}[mask_kind]
    with torch.no_grad():
        out, weights = layer(x, position_embeddings=(cos, sin), attention_mask=mask)
        H, Hkv, D = 4, 2, model.config.hidden_size // 4
        q = rope(attn.q_proj(x).view(B, T, H, D).transpose(1, 2), cos, sin)
        k_kv = rope(attn.k_proj(x).view(B, T, Hkv, D).transpose(1, 2), cos, sin)
        k = k_kv.repeat_interleave(H // Hkv, dim=1)
        v = attn.v_proj(x).view(B, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        # Hedgehog: a query map per query head, a key map per KV head (its features shared by the group).
        phi = None if feature_map == "elu1" else layer.feature_map.q
        k_features = None if feature_map == "elu1" else layer.feature_map.k(k_kv).repeat_interleave(H // Hkv, dim=1)
        ref = naive_hybrid(q, k, v, layer.mixing.window_logit, layer.mixing.linear_logit, 3,
                           key_valid=None if mask_kind == "none" else valid, formulation=formulation, phi=phi,
                           k_features=k_features)
        expected = attn.o_proj(ref.transpose(1, 2).reshape(B, T, -1))
    assert weights is None
    assert torch.allclose(out[valid], expected[valid], atol=1e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


def test_keys_valid_from_mask():
    assert keys_valid_from_mask(None, 3) is None
    valid = torch.tensor([[False, True, True, True], [True, True, True, True]])
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    mask4 = causal[None, None] & valid[:, None, None, :]
    assert torch.equal(keys_valid_from_mask(mask4, 4), valid)
    assert keys_valid_from_mask(mask4[:, :, -1:], 1) is None  # the last key is real in both rows
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~mask4, -torch.inf)
    assert torch.equal(keys_valid_from_mask(additive, 4), valid)
    # Decode: one query row over 4 cached + 1 new key; only the last column is the new key.
    step = torch.tensor([[True, False, True, True, False], [True] * 5])[:, None, None, :]
    assert torch.equal(keys_valid_from_mask(step, 1), torch.tensor([[False], [True]]))
    assert keys_valid_from_mask(torch.ones(2, 1, 1, 5, dtype=torch.bool), 1) is None


# ------------------------------------------------------------------- equivalence to softmax attention


@pytest.mark.parametrize("formulation,feature_map", VARIANTS)
def test_window_covering_sequence_equals_softmax_model(tiny_model, formulation, feature_map):
    """With T <= w the linear set is empty, so any mixing logits give exact softmax attention."""
    model, tok = tiny_model
    reference = copy.deepcopy(model)
    convert_to_hybrid(model, list(range(4)), window=32, formulation=formulation, feature_map=feature_map,
                      backend=BACKEND)
    randomize_hybrid_params(model)
    enc = tok(["short prompt", "a longer prompt, still <= 32"], return_tensors="pt", padding=True)
    assert enc["input_ids"].shape[1] <= 32
    with torch.no_grad():
        got = model(**enc, use_cache=False).logits
        want = reference(**enc, use_cache=False).logits
    real = enc["attention_mask"].bool()
    assert torch.allclose(got[real], want[real], atol=1e-5, rtol=0)


def test_window_covering_sequence_generates_like_softmax(tiny_model):
    model, tok = tiny_model
    reference = copy.deepcopy(model)
    convert_to_hybrid(model, HYBRID_LAYERS, window=64, backend=BACKEND)
    randomize_hybrid_params(model)
    enc = tok(["abc", "longer prompt"], return_tensors="pt", padding=True)
    assert torch.equal(greedy(model, enc, 20), greedy(reference, enc, 20))


# ---------------------------------------------------------------------------------- save / load


@pytest.mark.parametrize("formulation,feature_map", VARIANTS)
def test_save_load_equal_logits(lively_dir, tmp_path, formulation, feature_map):
    model, tok = hybrid_lively(lively_dir, formulation, feature_map)
    save_hybrid(model, tmp_path / "ckpt", tokenizer=tok)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["hybrid"] == {"layers": HYBRID_LAYERS, "window": 4, "formulation": formulation,
                                "feature_map": feature_map, "backend": BACKEND}
    assert "auto_map" not in config  # nothing needs trust_remote_code
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "tokenizer.json").exists()
    loaded = load_hybrid(tmp_path / "ckpt")
    assert hybrid_config_of(loaded) == hybrid_config_of(model)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    enc = tok(["the quick brown fox jumps over the lazy dog"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**enc).logits, model(**enc).logits)
    # load_model dispatches on the "hybrid" block
    again, tok2 = load_model(tmp_path / "ckpt")
    assert isinstance(again.model.layers[0].self_attn, HybridLlamaAttention)
    assert tok2("x")["input_ids"] == tok("x")["input_ids"]


# ------------------------------------------------------------------- the hybrid_llama model type

SRC = Path(__file__).resolve().parents[1] / "src"


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that has this checkout's src/ on its path and imports nothing else."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def _legacy_format(ckpt: Path) -> None:
    """Rewrite a checkpoint's config.json as save_hybrid wrote it before the model type existed:
    model_type llama with a "hybrid" block and no architectures."""
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    config.pop("architectures")
    (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("formulation,feature_map", VARIANTS)
def test_auto_model_loads_the_hybrid(lively_dir, tmp_path, formulation, feature_map):
    """AutoModelForCausalLM on a saved hybrid gives the hybrid: every weight from the file, equal
    logits, the recurrent cache in generate, and generate equal to the pipeline loader's."""
    model, tok = hybrid_lively(lively_dir, formulation, feature_map)
    ckpt = save_hybrid(model, tmp_path / "ckpt", tokenizer=tok)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "hybrid_llama" and config["architectures"] == ["HybridLlamaForCausalLM"]
    assert isinstance(AutoConfig.from_pretrained(ckpt), HybridLlamaConfig)
    auto, info = AutoModelForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert type(auto) is HybridLlamaForCausalLM and not auto.training
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert hybrid_config_of(auto) == hybrid_config_of(model)
    assert set(auto.state_dict()) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(auto.state_dict()[name], value), name
    pipeline, _ = load_model(ckpt)  # the pipeline's loader: the same class, built the same way
    assert type(pipeline) is HybridLlamaForCausalLM
    enc = tok(["the quick brown fox jumps over the lazy dog, again and again"], return_tensors="pt")
    with torch.no_grad():
        reference = model(**enc).logits
        assert torch.equal(auto(**enc).logits, reference)
        assert torch.equal(pipeline(**enc).logits, reference)
    n = 24  # >> window 4: the state folds many times
    cached = auto.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                           return_dict_in_generate=True)
    assert [type(layer) is HybridCacheLayer for layer in cached.past_key_values.layers] == [True, False, True, False]
    assert torch.equal(cached.sequences, greedy(model, enc, n))
    assert torch.equal(cached.sequences, greedy(pipeline, enc, n))
    assert torch.equal(cached.sequences, greedy(auto, enc, n, use_cache=False))
    assert len(set(cached.sequences[0, -n:].tolist())) > 5


def test_auto_model_in_fresh_processes(lively_dir, tmp_path):
    """In a fresh process `import hybrid_llama` + AutoModelForCausalLM gives the pipeline loader's
    logits; without the import the same call fails with transformers' unknown-model-type error."""
    model, tok = hybrid_lively(lively_dir, "lolcats", "hedgehog")
    ckpt = save_hybrid(model, tmp_path / "ckpt", tokenizer=tok)
    ids = tok(["a fresh process loads the hybrid"], return_tensors="pt")["input_ids"]
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    load = (f"import torch\nfrom safetensors.torch import load_file, save_file\n"
            f"from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(ckpt)!r})\n"
            f"print(type(m).__name__)\n"
            f"with torch.no_grad(): logits = m(load_file({str(tmp_path / 'ids.safetensors')!r})['ids']).logits\n"
            f"save_file({{'logits': logits}}, {str(tmp_path / 'logits.safetensors')!r})\n")
    out = _python("import hybrid_llama\n" + load)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "HybridLlamaForCausalLM"
    pipeline, _ = load_model(ckpt)
    with torch.no_grad():
        assert torch.equal(load_file(str(tmp_path / "logits.safetensors"))["logits"], pipeline(ids).logits)

    (tmp_path / "logits.safetensors").unlink()
    # nothing in this process imports the package (transformers included): the model type is unknown
    out = _python("import sys\nimport transformers\nassert 'hybrid_llama' not in sys.modules\n" + load)
    assert out.returncode != 0 and not (tmp_path / "logits.safetensors").exists()
    assert "LlamaForCausalLM" not in out.stdout
    assert "hybrid_llama" in out.stderr and "does not recognize this architecture" in out.stderr, out.stderr[-2000:]


def test_auto_from_config_and_transformers_save_pretrained(tmp_path):
    """The model type is an ordinary transformers model: from_config converts the configured layers
    (initialized like the rest), and transformers' own save_pretrained round-trips through the Auto classes."""
    config = HybridLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=320,
                               hybrid={"layers": [1, 3], "window": 8, "formulation": "lolcats",
                                       "feature_map": "hedgehog"})
    model = AutoModelForCausalLM.from_config(config)
    assert type(model) is HybridLlamaForCausalLM
    assert [isinstance(block.self_attn, HybridLlamaAttention) for block in model.model.layers] == [False, True,
                                                                                                   False, True]
    q = model.model.layers[1].self_attn.q_proj.weight.detach()
    assert abs(float(q.std()) - config.initializer_range) < 0.005  # not nn.Linear's default init
    model.save_pretrained(tmp_path / "hf")
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.arange(40)[None]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model.eval()(ids).logits)
    with pytest.raises(ValueError, match="needs config.hybrid"):
        HybridLlamaForCausalLM(HybridLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, vocab_size=320))


def test_earlier_format_still_loads(lively_dir, tmp_path):
    """Checkpoints of the earlier format (model_type llama + "hybrid" block) load through
    load_hybrid / load_model as the same hybrid."""
    model, tok = hybrid_lively(lively_dir, "lolcats", "hedgehog")
    ckpt = save_hybrid(model, tmp_path / "ckpt", tokenizer=tok)
    _legacy_format(ckpt)
    old = load_hybrid(ckpt)
    again, _ = load_model(ckpt)
    assert type(old) is type(again) is HybridLlamaForCausalLM
    assert hybrid_config_of(old) == hybrid_config_of(model)
    enc = tok(["written before the model type existed"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(old(**enc).logits, model(**enc).logits)
        assert torch.equal(again(**enc).logits, model(**enc).logits)
    # saving it again writes the new format
    resaved = save_hybrid(old, tmp_path / "resaved")
    assert json.loads((resaved / "config.json").read_text())["model_type"] == "hybrid_llama"
    assert torch.equal(AutoModelForCausalLM.from_pretrained(resaved)(**enc).logits, model(**enc).logits)


def test_missing_hybrid_weights_fail_instead_of_initializing(lively_dir, tmp_path):
    model, tok = hybrid_lively(lively_dir, "lolcats", "hedgehog")
    ckpt = save_hybrid(model, tmp_path / "ckpt")
    state = load_file(str(ckpt / "model.safetensors"))
    del state["model.layers.2.self_attn.feature_map.k.weight"]
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing_keys.*model\.layers\.2\.self_attn\.feature_map\.k\.weight"):
        AutoModelForCausalLM.from_pretrained(ckpt)
    with pytest.raises(ValueError, match="missing_keys"):
        load_hybrid(ckpt)


def test_model_card_of_a_saved_hybrid(lively_dir, tmp_path):
    model, tok = hybrid_lively(lively_dir, "lolcats", "hedgehog")
    ckpt = save_hybrid(model, tmp_path / "ckpt", tokenizer=tok)
    card = (ckpt / "README.md").read_text()
    header = card.split("---\n")[1]
    assert "library_name: transformers" in header and "pipeline_tag: text-generation" in header
    assert "base_model:" not in header and "license:" not in header  # unknown here: left out
    assert "| hybrid layers | 0, 2 |" in card and "| softmax window | 4 tokens |" in card
    assert "`lolcats`" in card and "`hedgehog`" in card and "| sparse cache | none |" in card
    assert card.count("not measured") == 2  # training and results: no numbers without result files
    assert "import hybrid_llama" in card and "python -m hybrid_llama.lm_eval --model hf" in card
    written = save_hybrid(model, tmp_path / "custom", card="# mine\n")
    assert (written / "README.md").read_text() == "# mine\n"


def test_save_load_tied_embeddings(tmp_path):
    d = resolve_model({"kind": "random", "preset": "tiny", "seed": 2, "tie_word_embeddings": True}, tmp_path / "tied")
    model, tok = load_model(d)
    convert_to_hybrid(model, [3], window=2, backend=BACKEND)
    randomize_hybrid_params(model)
    save_hybrid(model, tmp_path / "ckpt")
    loaded = load_hybrid(tmp_path / "ckpt")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")  # lm_head is not in the file: no error
    assert auto.lm_head.weight.data_ptr() == auto.model.embed_tokens.weight.data_ptr()
    enc = tok(["tied weights stay tied"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(loaded(**enc).logits, model(**enc).logits)
        assert torch.equal(auto(**enc).logits, model(**enc).logits)


def test_load_hybrid_dtype_and_errors(lively_dir, tmp_path):
    model, tok = hybrid_lively(lively_dir)
    save_hybrid(model, tmp_path / "ckpt")
    half = load_hybrid(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert half.model.layers[0].self_attn.mixing.window_logit.dtype == torch.bfloat16
    plain, _ = load_model(lively_dir)
    with pytest.raises(ValueError, match="convert_to_hybrid"):
        save_hybrid(plain, tmp_path / "plain")
    with pytest.raises(ValueError, match="not a hybrid checkpoint"):
        load_hybrid(lively_dir)


def test_load_hybrid_layers(lively_dir, tmp_path):
    student, tok = hybrid_lively(lively_dir, "hybrid", "hedgehog")
    names = hybrid_parameter_names(student)
    params = dict(student.named_parameters())
    save_file({n: params[n].detach().contiguous() for n in names}, str(tmp_path / "layers.safetensors"))
    cfg = hybrid_config_of(student)

    base, _ = load_model(lively_dir)
    load_hybrid_layers(base, tmp_path / "layers.safetensors", cfg)
    enc = tok(["transfer then finetune"], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(base(**enc).logits, student(**enc).logits)

    # strict: a missing parameter, or keys of other layers, are errors
    partial = {n: params[n].detach().contiguous() for n in names if "mixing.window_logit" not in n}
    save_file(partial, str(tmp_path / "partial.safetensors"))
    fresh, _ = load_model(lively_dir)
    with pytest.raises(ValueError, match="missing keys"):
        load_hybrid_layers(fresh, tmp_path / "partial.safetensors", cfg)
    other = HybridConfig(layers=[1, 3], window=4, feature_map="hedgehog", backend=BACKEND)
    fresh, _ = load_model(lively_dir)
    with pytest.raises(ValueError, match="unexpected keys"):
        load_hybrid_layers(fresh, tmp_path / "layers.safetensors", other)


# ------------------------------------------------------------------------------ generation + cache


@pytest.mark.parametrize("formulation,feature_map", VARIANTS)
def test_generate_with_cache_equals_without(lively_dir, formulation, feature_map):
    model, tok = hybrid_lively(lively_dir, formulation, feature_map, window=4)
    enc = tok(["hybrid attention"], return_tensors="pt")
    # prompt 17 + 36 tokens >> window 4: the fold into S, z runs many times
    cached = assert_cached_generation_equals_uncached(model, enc, 36)
    layers = cached.past_key_values.layers
    assert [type(layer) is HybridCacheLayer for layer in layers] == [True, False, True, False]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])  # bool vs additive float masks
def test_batched_left_padded_generation_equals_single(lively_dir, attn_implementation):
    model, tok = hybrid_lively(lively_dir, window=4)
    model.set_attn_implementation(attn_implementation)
    prompts = ["hi", "a much longer prompt, with padding on the others", "seven words will do it, or so"]
    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert not batch["attention_mask"].all()
    n = 30
    together = greedy(model, batch, n)
    for i, prompt in enumerate(prompts):
        alone = greedy(model, tok([prompt], return_tensors="pt"), n)
        assert together[i, -n:].tolist() == alone[0, -n:].tolist(), prompt
    assert torch.equal(together, greedy(model, batch, n, use_cache=False))


def test_beam_search_and_sampling_with_cache(lively_dir):
    model, tok = hybrid_lively(lively_dir, window=4)
    enc = tok(["beams"], return_tensors="pt")
    beams = greedy(model, enc, 12, num_beams=3, use_cache=True)
    assert torch.equal(beams, greedy(model, enc, 12, num_beams=3, use_cache=False))
    torch.manual_seed(0)
    with torch.no_grad():
        s1 = model.generate(**enc, max_new_tokens=12, do_sample=True, num_return_sequences=2)
    torch.manual_seed(0)
    with torch.no_grad():
        s2 = model.generate(**enc, max_new_tokens=12, do_sample=True, num_return_sequences=2, use_cache=False)
    assert torch.equal(s1, s2)


def test_chunked_prefill_continues_from_state(lively_dir):
    """A forward with q_len > 1 on a non-empty state steps token by token: same logits as one pass."""
    from transformers import DynamicCache

    model, tok = hybrid_lively(lively_dir, window=4)
    ids = tok(["one forward or three, the logits agree"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
                 for a, b in ((0, 9), (9, 10), (10, ids.shape[1]))]
    assert cache.get_seq_length() == ids.shape[1]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("formulation,feature_map", VARIANTS)
def test_prompt_inside_window_defers_its_state(lively_dir, formulation, feature_map):
    """A first prompt no longer than the window keeps its keys/values until a decode step needs the state;
    decoding from there (across the window) gives the uncached logits, also after reordering the batch."""
    from transformers import DynamicCache

    model, tok = hybrid_lively(lively_dir, formulation, feature_map, window=8)
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    steps = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        first = model(ids, past_key_values=cache, use_cache=True).logits
        kv_heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
        for i in HYBRID_LAYERS:  # k and v of 2 rows x 5 tokens, fp32: no ring buffers or sums yet
            assert cache_nbytes_by_layer(cache)[i] == 2 * 2 * kv_heads * 5 * head_dim * 4
        cache.reorder_cache(torch.tensor([1, 0]))
        rows = [model(steps[[1, 0], t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(12)]
        full = model(torch.cat([ids, steps], 1)[[1, 0]], use_cache=False).logits
    assert torch.allclose(first, full[[1, 0], :5], atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.cat(rows, 1), full[:, 5:], atol=1e-4, rtol=1e-4)
    state = cache.layers[HYBRID_LAYERS[0]].state
    assert state.seen == 17 and cache.get_seq_length() == 17


def test_cache_memory_constant_for_hybrid_layers(lively_dir):
    model, tok = hybrid_lively(lively_dir, window=4)
    enc = tok(["memory"], return_tensors="pt")
    sizes = {}
    for n in (8, 40):
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 return_dict_in_generate=True)
        sizes[n] = cache_nbytes_by_layer(out.past_key_values)
        assert hybrid_cache_nbytes(out.past_key_values) == sum(sizes[n])
    for i in range(4):
        if i in HYBRID_LAYERS:
            # kept per KV head (GQA: 2, not the 4 query heads): ring buffers k, v [1, 2, w=4, 16] fp32
            # + valid [1, 4] + S [1, 2, 16, 16] + z [1, 2, 16]
            assert sizes[8][i] == sizes[40][i] == 2 * 2 * 4 * 16 * 4 + 4 + 2 * 16 * 16 * 4 + 2 * 16 * 4
        else:  # k and v of 2 KV heads per token, in a buffer with at most 16 spare tokens at this length
            used = {n: (enc["input_ids"].shape[1] + n - 1) * 2 * 2 * 16 * 4 for n in sizes}
            assert all(used[n] <= sizes[n][i] <= used[n] + 16 * 2 * 2 * 16 * 4 for n in sizes)


def test_training_mode_keeps_no_state(lively_dir):
    model, tok = hybrid_lively(lively_dir, window=4)
    enc = tok(["train"], return_tensors="pt")
    model.train()
    out = model(**enc, use_cache=True)
    assert out.past_key_values.layers[0].state is None
    with pytest.raises(RuntimeError, match="training mode"):
        model(torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True)


def test_truncated_artifacts_name_the_file_and_the_rule(tiny_model_dir, tmp_path):
    """A truncated hybrid-layers file, adapter or saved model gives one error naming the path and how
    to rebuild it; a whole file of another variant keeps its own, specific error."""
    from hybrid_llama.files import ArtifactError, load_safetensors, save_safetensors
    from hybrid_llama.models import hybrid_parameter_names, load_hybrid, load_hybrid_layers, save_hybrid

    model, tok = load_model(tiny_model_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 2], window=16)
    save_hybrid(model, tmp_path / "saved", tokenizer=tok)
    layers = tmp_path / "hybrid_layers.safetensors"
    state = model.state_dict()
    save_safetensors(layers, {k: state[k].contiguous() for k in hybrid_parameter_names(model)})
    whole = layers.read_bytes()
    layers.write_bytes(whole[: len(whole) // 2])
    fresh, _ = load_model(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ArtifactError, match=r"hybrid_layers\.safetensors: unreadable or truncated.*forcerun transfer"):
        load_hybrid_layers(fresh, layers, {"layers": [0, 2], "window": 16})
    with pytest.raises(ArtifactError, match="--forcerun lora"):
        load_safetensors(layers, rule="lora")
    saved = tmp_path / "saved" / "model.safetensors"
    full = saved.read_bytes()
    saved.write_bytes(full[: len(full) // 2])  # the header is whole, the data is not
    with pytest.raises(ArtifactError, match=r"model\.safetensors: unreadable or truncated"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    saved.write_bytes(full[:100])
    with pytest.raises(ArtifactError, match=r"model\.safetensors: unreadable or truncated.*save_hybrid"):
        load_hybrid(tmp_path / "saved")
    with pytest.raises(ArtifactError, match=r"model\.safetensors: unreadable or truncated"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    layers.write_bytes(whole)  # whole again, but loaded as other layers: the specific error stays
    other, _ = load_model(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="missing keys"):
        load_hybrid_layers(other, layers, {"layers": [1], "window": 16})
