"""Attention transfer, LoRA finetuning, checkpoints and stages on the tiny random model (CPU, seconds)."""

from __future__ import annotations

import csv
import json
import re

import peft
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import hybrid_llama.models as hm
import hybrid_llama.train.finetune as ft
import hybrid_llama.train.transfer as tr
from hybrid_llama.data import load_instruct, load_packed, prepare_instruct_data, prepare_transfer_corpus
from hybrid_llama.models import load_model
from hybrid_llama.stages import load_stage
from hybrid_llama.train.errors import NoGradientError, NonFiniteError, StopTraining
from hybrid_llama.train.optim import lr_factor

HYBRID = {"layers": [1, 3], "window": 16}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def corpus(tiny_model_dir, shared_data_dir, tmp_path_factory):
    """Train and held-out packed rows from disjoint fineweb-edu documents."""
    path = shared_data_dir / "fineweb-edu" / "fineweb-edu-sample-10BT.150docs.text.jsonl"
    if not path.exists():
        pytest.skip(f"shared data missing: {path}")
    src = {"kind": "local", "path": str(path)}
    d = tmp_path_factory.mktemp("corpus")
    kw = dict(seq_len=64, heldout_fraction=0.2, seed=0)
    prepare_transfer_corpus(src, tiny_model_dir, d / "train.safetensors", split="train", num_tokens=64 * 48, **kw)
    prepare_transfer_corpus(src, tiny_model_dir, d / "heldout.safetensors", split="heldout", num_tokens=64 * 8, **kw)
    return d


@pytest.fixture(scope="module")
def instruct(tiny_model_dir, shared_data_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("instruct") / "dolly.safetensors"
    prepare_instruct_data({"kind": "local", "path": str(shared_data_dir / "dolly" / "databricks-dolly-15k.head.jsonl")},
                          tiny_model_dir, path, max_length=96, val_fraction=0.25, max_examples=40, seed=0)
    return path


# These tests hold training to exact fp32 recomputations, so they keep fp32 even on a CPU where
# `autocast: true` would train in bf16; test_cpu_bf16_* covers that path.
def _transfer_cfg(**kw):
    return {"progress": False, "autocast": False, "lr": 3e-4, "logits_lr": 0.3, "batch_size": 4, "epochs": 2,
            "eval_sequences": 0, "checkpoint_every": 0, **kw}


@pytest.fixture(scope="module")
def transferred(tiny_model_dir, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    seen = {}
    orig = tr.load_base

    def spy(*a, **k):  # keep a handle on the in-memory teacher to check it after training
        seen["teacher"] = orig(*a, **k)[0]
        return seen["teacher"], None

    tr.load_base = spy
    try:
        m = tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID,
                            _transfer_cfg(eval_path=str(corpus / "heldout.safetensors")), out)
    finally:
        tr.load_base = orig
    return out, m, seen["teacher"]


def test_transfer_lowers_heldout_mse(transferred):
    out, m, _ = transferred
    assert set(m["mse_before"]) == set(m["mse_after"]) == {"1", "3"}
    for layer in ("1", "3"):
        assert m["mse_after"][layer] < 0.8 * m["mse_before"][layer], m
    assert m["eval_sequences"] == 8 and m["train_sequences"] == 48
    rows = list(csv.DictReader(open(out / "loss.csv")))
    assert {r["layer"] for r in rows} == {"1", "3"} and len(rows) == 2 * m["steps"] == 2 * 24
    assert m["tokens_per_s"] > 0 and m["wall_time_s"] > 0


def test_transfer_mse_matches_independent_computation(tiny_model_dir, transferred, corpus):
    """Held-out MSE recomputed from the saved file with the full hybrid model and plain hooks."""
    out, m, _ = transferred
    from hybrid_llama.data import load_packed

    rows = load_packed(corpus / "heldout.safetensors")
    base, _ = load_model(tiny_model_dir, dtype=torch.float32)
    hyb, _ = load_model(tiny_model_dir, dtype=torch.float32)
    hm.load_hybrid_layers(hyb, out / "hybrid_layers.safetensors", hm.HybridConfig(**HYBRID))
    caught = {}

    def grab(name):
        def hook(mod, args, kwargs, output):
            caught[name] = (kwargs, output[0])
        return hook

    for i in HYBRID["layers"]:
        base.model.layers[i].self_attn.register_forward_hook(grab(i), with_kwargs=True)
    with torch.no_grad():
        base(input_ids=rows, use_cache=False)
        for i in HYBRID["layers"]:
            kwargs, target = caught[i]
            y = hyb.model.layers[i].self_attn(
                hidden_states=kwargs["hidden_states"], position_embeddings=kwargs["position_embeddings"],
                attention_mask=kwargs["attention_mask"])[0]
            assert F.mse_loss(y, target).item() == pytest.approx(m["mse_after"][str(i)], rel=1e-4)


def test_transfer_teacher_bit_identical_and_file_holds_hybrid_layers_only(tiny_model_dir, transferred):
    out, _, teacher = transferred
    fresh, _ = load_model(tiny_model_dir, dtype=torch.float32)
    ref = fresh.state_dict()
    got = teacher.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    saved = load_file(str(out / "hybrid_layers.safetensors"))
    hyb, _ = load_model(tiny_model_dir, dtype=torch.float32)
    hm.convert_to_hybrid(hyb, **HYBRID)
    assert set(saved) == set(hm.hybrid_parameter_names(hyb))
    # q/k/v/o trained (default trainable = logits + qkvo): they moved away from the teacher's.
    for i in HYBRID["layers"]:
        for p in PROJ:
            k = f"model.layers.{i}.self_attn.{p}.weight"
            assert not torch.equal(saved[k], ref[k]), k
        assert saved[f"model.layers.{i}.self_attn.mixing.window_logit"].abs().sum() > 0


def test_transfer_logits_only_keeps_qkvo(tiny_model_dir, corpus, tmp_path):
    m = tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID,
                        _transfer_cfg(trainable="logits", epochs=1, max_steps=3, eval_sequences=2), tmp_path)
    assert m["num_trainable_params"] == 2 * 2 * 4  # 2 layers x (window, linear) x 4 heads
    saved = load_file(str(tmp_path / "hybrid_layers.safetensors"))
    fresh, _ = load_model(tiny_model_dir, dtype=torch.float32)
    for i in HYBRID["layers"]:
        for p in PROJ:
            k = f"model.layers.{i}.self_attn.{p}.weight"
            assert torch.equal(saved[k], fresh.state_dict()[k])


def _read(path):
    return path.read_text()


def test_transfer_kill_and_resume_equals_uninterrupted(tiny_model_dir, corpus, tmp_path):
    cfg = _transfer_cfg(epochs=1, max_steps=7, checkpoint_every=2, eval_sequences=2)
    a, b = tmp_path / "a", tmp_path / "b"
    tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, cfg, a)

    def kill(step, logs):
        if step == 5:
            raise StopTraining

    with pytest.raises(StopTraining):
        tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, cfg, b, callback=kill)
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    steps_run = []
    mb = tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, cfg, b,
                         callback=lambda s, _: steps_run.append(s))
    assert mb["resumed_from_step"] == 4 and steps_run == [5, 6, 7]
    ta, tb = load_file(str(a / "hybrid_layers.safetensors")), load_file(str(b / "hybrid_layers.safetensors"))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert _read(a / "loss.csv") == _read(b / "loss.csv")  # no step logged twice
    ma = json.loads(_read(a / "metrics.json"))
    assert ma["mse_after"] == mb["mse_after"]


def test_transfer_teacher_cache_matches_fresh_teacher_forwards(tiny_model_dir, corpus, tmp_path):
    """Epochs after the first read the teacher's tensors from the cache: the trained layers are the ones
    a teacher forward per batch gives (batches mix rows differently each epoch), with a third of the
    forwards; a limit below the rows' size turns the cache off."""
    cfg = _transfer_cfg(epochs=3, eval_path=str(corpus / "heldout.safetensors"))
    runs = {}
    for name, gib in [("fresh", 0), ("cached", 8), ("too_small", 1e-6)]:
        m = tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID,
                            {**cfg, "teacher_cache_gib": gib}, tmp_path / name)
        runs[name] = (m, load_file(str(tmp_path / name / "hybrid_layers.safetensors")))
    n_micro = 48 // 4
    assert runs["fresh"][0]["teacher_forwards"] == runs["too_small"][0]["teacher_forwards"] == 3 * n_micro
    assert runs["cached"][0]["teacher_forwards"] == n_micro
    fresh, cached = runs["fresh"][1], runs["cached"][1]
    for k in fresh:
        assert torch.equal(cached[k], fresh[k]), k
    assert runs["cached"][0]["mse_after"] == pytest.approx(runs["fresh"][0]["mse_after"], rel=1e-4)


@pytest.mark.parametrize(
    "poison,pattern",
    [  # NaN weights or logits make the layer's loss NaN; a NaN gradient alone is caught after backward
        ("o_proj.weight", r"non-finite loss at step 1 in layer 3"),
        ("mixing.linear_logit", r"non-finite loss at step 1 in layer 3"),
        ("grad:mixing.linear_logit", r"non-finite gradient at step 1 in model\.layers\.3\.self_attn\."),
    ],
)
def test_transfer_nan_names_step_and_layer(tiny_model_dir, corpus, tmp_path, monkeypatch, poison, pattern):
    orig = hm.make_hybrid_attention

    def poisoned(attn, cfg):
        new = orig(attn, cfg)
        if attn.layer_idx == 3:
            if poison.startswith("grad:"):  # finite forward, NaN gradient
                new.get_parameter(poison[5:]).register_hook(lambda grad: grad * float("nan"))
            else:
                with torch.no_grad():
                    new.get_parameter(poison).fill_(float("nan"))
        return new

    monkeypatch.setattr(hm, "make_hybrid_attention", poisoned)
    with pytest.raises(NonFiniteError, match=pattern):
        tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, _transfer_cfg(eval_sequences=2), tmp_path)


def test_transfer_that_nothing_reaches_names_the_cause(corpus, tiny_model_dir, tmp_path):
    """Rows no longer than the window give the feature maps and the mixing factors no gradient; the
    loop says so at the first step instead of failing inside autograd."""
    hybrid = {"layers": [1], "window": 64, "formulation": "lolcats", "feature_map": "hedgehog"}  # rows of 64
    with pytest.raises(NoGradientError, match=r"transfer loss at step 1 does not depend on any trained parameter"):
        tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", hybrid,
                        _transfer_cfg(eval_sequences=2, trainable="logits+feature_map"), tmp_path)


def test_lr_schedule_shape():
    loop = tr.TransferSettings.from_dict({"warmup_ratio": 0.1, "min_lr_ratio": 0.1}).loop
    f = [lr_factor(s, 100, loop.schedule, loop.warmup_ratio, loop.min_lr_ratio) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1) and all(x >= y for x, y in zip(f[9:], f[10:]))


def test_settings_are_the_schema_sections_typed_and_give_back_the_dict_they_were_built_from():
    from hybrid_llama.config import schema_defaults
    from hybrid_llama.train.settings import CORPUS_KEYS, RUN_DEFAULTS, LoraSettings, TransferSettings

    given = {"lr": 0.5, "batch_size": 3, "eval_path": "held.safetensors", "progress": False}
    s = TransferSettings.from_dict(given)
    assert (s.optimizer.lr, s.loop.batch_size, s.eval_path, s.loop.progress) == (0.5, 3, "held.safetensors", False)
    expect = {k: v for k, v in schema_defaults("transfer").items() if k not in CORPUS_KEYS}
    expect = {**expect, **RUN_DEFAULTS, "eval_path": None, **given}
    assert s.as_dict() == expect and list(s.as_dict()) == list(tr.TRANSFER_DEFAULTS)
    lora = LoraSettings.from_dict({"r": 4, "layers": [2]})
    assert (lora.adapter.r, lora.adapter.layers, lora.objective) == (4, [2], "instruct")
    assert lora.as_dict() == {**ft.FINETUNE_DEFAULTS, "r": 4, "layers": [2]}
    with pytest.raises(ValueError, match=r"transfer train config: unknown keys \['seq_len'\]"):
        TransferSettings.from_dict({"seq_len": 64})


def test_training_code_does_not_import_the_pipeline_module():
    from pathlib import Path

    import hybrid_llama.train as train

    for path in Path(train.__file__).parent.glob("*.py"):
        assert "hybrid_llama.pipeline" not in path.read_text(), path


# ----------------------------------------------------------------------------------------- LoRA


def _lora_cfg(**kw):
    return {"progress": False, "autocast": False, "lr": 1e-3, "batch_size": 8, "epochs": 2, "checkpoint_every": 0, **kw}


@pytest.fixture(scope="module")
def finetuned(tiny_model_dir, transferred, instruct, tmp_path_factory):
    tdir = transferred[0]
    out = tmp_path_factory.mktemp("lora")
    seen = {}
    orig = peft.get_peft_model

    def spy(*a, **k):
        seen["model"] = orig(*a, **k)
        return seen["model"]

    peft.get_peft_model = spy
    try:
        m = ft.run_finetune(tiny_model_dir, instruct, _lora_cfg(), out, hybrid=HYBRID,
                            hybrid_layers=tdir / "hybrid_layers.safetensors")
    finally:
        peft.get_peft_model = orig
    return out, m, seen["model"], tdir / "hybrid_layers.safetensors"


def _strip(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".original_module", "")


def test_lora_touches_only_hybrid_qkvo_and_logits(tiny_model_dir, finetuned):
    out, m, trained, hl = finetuned
    fresh, _ = load_stage(tiny_model_dir, "transfer", hybrid=HYBRID, hybrid_layers=hl)
    ref = dict(fresh.named_parameters())
    pattern = re.compile(
        r"base_model\.model\.model\.layers\.([13])\.self_attn\."
        r"((q|k|v|o)_proj\.lora_[AB]\.default\.weight|mixing\.modules_to_save\.default\.(window|linear)_logit)$")
    trainable = [n for n, p in trained.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * (4 * 2 + 2)
    for n, p in trained.named_parameters():
        if p.requires_grad:
            assert pattern.match(n), n
        else:  # every frozen parameter, including the pre-LoRA copy of the logits, is bit-identical
            assert torch.equal(p, ref[_strip(n)]), n
    # The merged model differs from the transfer model exactly at hybrid q/k/v/o and the logits.
    merged, _ = load_stage(tiny_model_dir, "transfer_lora", hybrid=HYBRID, hybrid_layers=hl, adapter=out)
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, ref[n])}
    expect = {f"model.layers.{i}.self_attn.{p}.weight" for i in (1, 3) for p in PROJ}
    expect |= {f"model.layers.{i}.self_attn.mixing.{k}_logit" for i in (1, 3) for k in ("window", "linear")}
    assert changed == expect
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == sorted(f"model.layers.{i}.self_attn.{p}" for i in (1, 3) for p in PROJ)


def test_lora_adapter_round_trips(tiny_model_dir, finetuned, instruct):
    out, m, trained, hl = finetuned
    base, _ = load_stage(tiny_model_dir, "transfer", hybrid=HYBRID, hybrid_layers=hl)
    reloaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
    trained.eval()
    batch = load_instruct(instruct, "val")
    with torch.no_grad():
        a = trained(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(a, b)
    merged, _ = load_stage(tiny_model_dir, "transfer_lora", hybrid=HYBRID, hybrid_layers=hl, adapter=out)
    with torch.no_grad():
        c = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


def test_lora_val_loss_before_is_token_mean_and_drops(tiny_model_dir, finetuned, instruct):
    out, m, _, hl = finetuned
    base, _ = load_stage(tiny_model_dir, "transfer", hybrid=HYBRID, hybrid_layers=hl)
    val = load_instruct(instruct, "val")
    with torch.no_grad():  # one batch with every val row: HF's loss is then the token-weighted mean
        ref = base(input_ids=val["input_ids"], attention_mask=val["attention_mask"], labels=val["labels"]).loss
    assert m["val_loss_before"] == pytest.approx(float(ref), rel=1e-5)
    assert len(m["val_loss_per_epoch"]) == 2 and m["val_loss_after"] < m["val_loss_before"]
    rows = list(csv.DictReader(open(out / "loss.csv")))
    val_rows = [(int(r["step"]), float(r["loss"])) for r in rows if r["split"] == "val"]
    assert [s for s, _ in val_rows] == [0, m["steps"] // 2, m["steps"]]
    assert sum(r["split"] == "train" for r in rows) == m["steps"]


def test_lora_kill_and_resume_equals_uninterrupted(tiny_model_dir, instruct, tmp_path):
    cfg = _lora_cfg(checkpoint_every=2, batch_size=4, dropout=0.1)  # dropout: the RNG state must resume too
    a, b = tmp_path / "a", tmp_path / "b"
    ma = ft.run_finetune(tiny_model_dir, instruct, cfg, a, hybrid=HYBRID)

    def kill(step, logs):
        if step == ma["steps"] // 2 + 1:
            raise StopTraining

    with pytest.raises(StopTraining):
        ft.run_finetune(tiny_model_dir, instruct, cfg, b, hybrid=HYBRID, callback=kill)
    mb = ft.run_finetune(tiny_model_dir, instruct, cfg, b, hybrid=HYBRID)
    assert 0 < mb["resumed_from_step"] < ma["steps"]
    ta, tb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert _read(a / "loss.csv") == _read(b / "loss.csv")
    assert ma["val_loss_per_epoch"] == mb["val_loss_per_epoch"]


def test_lora_nan_names_step_and_layer(tiny_model_dir, instruct, tmp_path, monkeypatch):
    orig = ft.load_base

    def poisoned(*a, **k):
        model, tok = orig(*a, **k)
        with torch.no_grad():
            model.model.layers[2].mlp.down_proj.weight.fill_(float("inf"))
        return model, tok

    monkeypatch.setattr(ft, "load_base", poisoned)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 1 in layer 2"):
        ft.run_finetune(tiny_model_dir, instruct, _lora_cfg(), tmp_path, hybrid=HYBRID)


def test_base_lora_control_and_stages(tiny_model_dir, instruct, tmp_path):
    m = ft.run_finetune(tiny_model_dir, instruct, _lora_cfg(epochs=1, max_steps=2), tmp_path)
    assert m["modules_to_save"] == [] and len(m["target_modules"]) == 4 * 4  # all layers, no logits
    merged, tok = load_stage(tiny_model_dir, "base_lora", adapter=tmp_path)
    kept, _ = load_stage(tiny_model_dir, "base_lora", adapter=tmp_path, merge=False)
    assert isinstance(kept, peft.PeftModel) and not isinstance(merged, peft.PeftModel)
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, kept(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs hybrid"):
        load_stage(tiny_model_dir, "transfer")
    with pytest.raises(ValueError, match="unknown keys"):
        ft.run_finetune(tiny_model_dir, instruct, {"rank": 4}, tmp_path)


def test_transfer_hedgehog_trains_feature_map_and_round_trips(tiny_model_dir, corpus, tmp_path):
    hyb = {**HYBRID, "feature_map": "hedgehog"}
    m = tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", hyb,
                        _transfer_cfg(epochs=1, max_steps=3, eval_sequences=2, trainable="logits+feature_map+qkvo"),
                        tmp_path)
    assert m["trainable"] == ["feature_map", "k_proj", "mixing", "o_proj", "q_proj", "v_proj"]
    saved = load_file(str(tmp_path / "hybrid_layers.safetensors"))
    assert not torch.equal(saved["model.layers.1.self_attn.feature_map.q.weight"],
                           torch.eye(16).expand(4, 16, 16))  # identity at init, trained since
    model, _ = load_stage(tiny_model_dir, "transfer", hybrid=hyb, hybrid_layers=tmp_path / "hybrid_layers.safetensors")
    got = dict(model.named_parameters())
    for k, v in saved.items():
        assert torch.equal(got[k], v), k


def test_grad_accumulation_matches_big_batch(tiny_model_dir, corpus, tmp_path):
    # Rows of step k are the same either way; the mean of two half-batch MSEs is the full-batch MSE.
    cfg = _transfer_cfg(epochs=1, max_steps=4, eval_sequences=2)
    tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, {**cfg, "batch_size": 4}, tmp_path / "a")
    tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, {**cfg, "batch_size": 2, "grad_accum": 2},
                    tmp_path / "b")
    ta = load_file(str(tmp_path / "a" / "hybrid_layers.safetensors"))
    tb = load_file(str(tmp_path / "b" / "hybrid_layers.safetensors"))
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], atol=1e-5, rtol=1e-4)
    la = list(csv.DictReader(open(tmp_path / "a" / "loss.csv")))
    lb = list(csv.DictReader(open(tmp_path / "b" / "loss.csv")))
    assert [float(r["mse"]) for r in la] == pytest.approx([float(r["mse"]) for r in lb], rel=1e-4)


def test_resume_refuses_checkpoint_of_another_run_length(tiny_model_dir, corpus, tmp_path):
    cfg = _transfer_cfg(epochs=1, max_steps=2, checkpoint_every=1, eval_sequences=2)
    tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, cfg, tmp_path)
    with pytest.raises(ValueError, match="checkpoint of a run with 2 steps, this run has 3"):
        tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, {**cfg, "max_steps": 3}, tmp_path)


# ---------------------------------------------------------------------------- LoRA, distill objective

HEDGEHOG = {"layers": [1, 3], "window": 4, "formulation": "lolcats", "feature_map": "hedgehog"}


@pytest.fixture(scope="module")
def lively_dir(tmp_path_factory):
    """Tiny random Llama with a large init: its attention is far from uniform, so replacing it costs
    a KL worth training away (the default init's near-uniform attention costs ~1e-6)."""
    from hybrid_llama.weights import resolve_model

    return resolve_model({"kind": "random", "preset": "tiny", "seed": 1, "initializer_range": 0.2},
                         tmp_path_factory.mktemp("models") / "lively")


@pytest.fixture(scope="module")
def distilled(lively_dir, corpus, tmp_path_factory):
    """A Hedgehog variant transferred, then LoRA-distilled from the base model on the same rows."""
    tdir = tmp_path_factory.mktemp("hh_transfer")
    tr.run_transfer(lively_dir, corpus / "train.safetensors", HEDGEHOG,
                    _transfer_cfg(trainable="logits+feature_map", lr=1e-2, epochs=1, eval_sequences=2), tdir)
    out = tmp_path_factory.mktemp("distill")
    m = ft.run_finetune(lively_dir, corpus / "train.safetensors",
                        _lora_cfg(objective="distill", batch_size=4, epochs=3, eval_sequences=4, dropout=0.0),
                        out, hybrid=HEDGEHOG, hybrid_layers=tdir / "hybrid_layers.safetensors")
    return out, m, tdir / "hybrid_layers.safetensors"


def _kl_per_token(student, teacher, rows) -> float:
    """Mean over every position of KL(teacher || student), written out from the definition."""
    with torch.no_grad():
        p = torch.softmax(teacher(input_ids=rows).logits.double(), -1)
        q = torch.softmax(student(input_ids=rows).logits.double(), -1)
    return float((p * (p.log() - q.log())).sum(-1).mean())


def test_lora_distill_matches_the_base_model_better(lively_dir, corpus, distilled):
    out, m, hl = distilled
    assert m["objective"] == "distill" and m["val_metric"] == "kl" and m["num_val"] == 4
    assert m["val_loss_after"] < m["val_loss_before"]
    # the reported validation KL is the KL of the saved adapter, recomputed independently
    teacher, _ = load_stage(lively_dir, "base")
    before, _ = load_stage(lively_dir, "transfer", hybrid=HEDGEHOG, hybrid_layers=hl)
    after, _ = load_stage(lively_dir, "transfer_lora", hybrid=HEDGEHOG, hybrid_layers=hl, adapter=out)
    val_rows = load_packed(corpus / "train.safetensors")[-4:]
    assert _kl_per_token(before, teacher, val_rows) == pytest.approx(m["val_loss_before"], rel=1e-3)
    assert _kl_per_token(after, teacher, val_rows) == pytest.approx(m["val_loss_after"], rel=1e-3)


def test_lora_trains_feature_maps_and_mixing_through_modules_to_save(lively_dir, distilled):
    out, m, hl = distilled
    assert m["modules_to_save"] == [f"model.layers.{i}.self_attn.{part}" for i in (1, 3)
                                    for part in ("mixing", "feature_map")]
    before, _ = load_stage(lively_dir, "transfer", hybrid=HEDGEHOG, hybrid_layers=hl)
    after, _ = load_stage(lively_dir, "transfer_lora", hybrid=HEDGEHOG, hybrid_layers=hl, adapter=out)
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    for i in (1, 3):
        for name in ("feature_map.q.weight", "feature_map.k.weight", "mixing.window_logit"):
            key = f"model.layers.{i}.self_attn.{name}"
            assert not torch.equal(a[key], b[key]), key
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.up_proj.weight", "lm_head.weight"):
        assert torch.equal(a[key], b[key]), key  # LoRA only on the hybrid layers' q/k/v/o


def test_lora_distill_needs_a_hybrid_model(tiny_model_dir, corpus, tmp_path):
    with pytest.raises(ValueError, match="distill"):
        ft.run_finetune(tiny_model_dir, corpus / "train.safetensors", _lora_cfg(objective="distill"), tmp_path)


def test_converted_stage_is_the_untrained_conversion(tiny_model_dir):
    model, _ = load_stage(tiny_model_dir, "converted", hybrid=HEDGEHOG)
    ref, _ = load_model(tiny_model_dir, dtype=torch.float32)
    hm.convert_to_hybrid(ref, **HEDGEHOG)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)
    with pytest.raises(ValueError, match="converted"):
        load_stage(tiny_model_dir, "converted", hybrid=HEDGEHOG, hybrid_layers="x.safetensors")


def test_optimizer_groups_give_logits_and_feature_maps_their_own_lr():
    import dataclasses

    from hybrid_llama.train.optim import make_optimizer

    p = {n: torch.nn.Parameter(torch.zeros(2)) for n in ("a.q_proj.lora_A", "a.mixing.window_logit",
                                                         "a.feature_map.q.weight", "a.feature_map.k.bias")}
    opt = tr.TransferSettings.from_dict({"lr": 1e-3, "logits_lr": 0.05, "feature_map_lr": 0.01}).optimizer
    groups = make_optimizer(list(p.items()), opt).param_groups
    assert [(g["lr"], len(g["params"])) for g in groups] == [(1e-3, 1), (0.05, 1), (0.01, 2)]
    opt = dataclasses.replace(opt, logits_lr=None, feature_map_lr=None)
    assert [g["lr"] for g in make_optimizer(list(p.items()), opt).param_groups] == [1e-3] * 3


@pytest.mark.parametrize("rslora", [False, True])
def test_direct_lora_merge_matches_peft_merge(tiny_model_dir, tmp_path, rslora):
    """``merge_lora_adapter`` (what evaluation uses, without importing peft) gives the weights of
    peft's own ``merge_and_unload``, LoRA factors and modules_to_save (feature maps, logits) alike."""
    from hybrid_llama.stages import merge_lora_adapter

    def converted():
        model, _ = load_model(tiny_model_dir, dtype=torch.float32)
        hm.convert_to_hybrid(model, **HEDGEHOG)
        return model

    targets = [f"model.layers.{i}.self_attn.{p}" for i in (1, 3) for p in PROJ]
    saved = [f"model.layers.{i}.self_attn.{part}" for i in (1, 3) for part in ("mixing", "feature_map")]
    cfg = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, modules_to_save=saved, use_rslora=rslora)
    wrapped = peft.get_peft_model(converted(), cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero: randomize every trainable tensor so the merge shows
        for p in wrapped.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    wrapped.save_pretrained(tmp_path)

    ours = dict(merge_lora_adapter(converted(), tmp_path).named_parameters())
    ref = dict(peft.PeftModel.from_pretrained(converted(), str(tmp_path)).merge_and_unload().named_parameters())
    untouched = dict(converted().named_parameters())
    assert ours.keys() == ref.keys()
    changed = {k for k in ours if not torch.equal(ours[k], untouched[k])}
    assert changed == {f"{t}.weight" for t in targets} | {k for k in ours if ".mixing." in k or ".feature_map." in k}
    for k in ours:  # same arithmetic as peft's merge, so bit-identical
        assert torch.equal(ours[k], ref[k]), k

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        merge_lora_adapter(converted(), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="matches no parameter"):
        merge_lora_adapter(load_model(tiny_model_dir, dtype=torch.float32)[0], tmp_path)  # no hybrid layers


def _teacher_final_states(model_dir, rows) -> torch.Tensor:
    """The base model's final (normed) hidden states, one row at a time, independent of transfer."""
    teacher, _ = load_model(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.cat([teacher.eval().model(input_ids=r[None]).last_hidden_state for r in rows])


def test_transfer_saves_the_teachers_final_states_of_every_training_row(tiny_model_dir, corpus, tmp_path):
    """With teacher_states, transfer saves each training row's final hidden states: the ones the
    teacher computes, also for rows a killed run saw before resuming and rows max_steps never reached.
    Without it, the file exists with no rows."""
    from hybrid_llama.train.teacher_states import TeacherStates

    cfg = _transfer_cfg(epochs=2, max_steps=15, checkpoint_every=2, eval_sequences=2, teacher_states=True)
    rows = load_packed(corpus / "train.safetensors")[:-2]

    def kill(step, logs):
        if step == 5:
            raise StopTraining

    with pytest.raises(StopTraining):
        tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, cfg, tmp_path / "on", callback=kill)
    m = tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, cfg, tmp_path / "on")
    assert m["resumed_from_step"] == 4
    saved = TeacherStates(tmp_path / "on" / "teacher_states.safetensors")
    assert torch.equal(saved.input_ids, rows) and saved.teacher == {"dtype": "torch.float32", "autocast": False}
    torch.testing.assert_close(saved.hidden, _teacher_final_states(tiny_model_dir, rows), atol=1e-5, rtol=1e-5)
    shuffled = rows[[5, 0, 17]]
    got, why = saved.for_rows(shuffled, dtype="torch.float32", autocast=False)
    assert why == "" and torch.equal(got, saved.hidden[[5, 0, 17]])
    assert saved.for_rows(shuffled, dtype="torch.bfloat16", autocast=False)[0] is None
    assert "lacks 1 of the 1 rows" in saved.for_rows(shuffled[:1] + 1, dtype="torch.float32", autocast=False)[1]

    tr.run_transfer(tiny_model_dir, corpus / "train.safetensors", HYBRID, {**cfg, "teacher_states": False},
                    tmp_path / "off")
    off = TeacherStates(tmp_path / "off" / "teacher_states.safetensors")
    assert len(off) == 0 and "no rows" in off.for_rows(rows, dtype="torch.float32", autocast=False)[1]


def test_distill_with_transfer_teacher_states_trains_the_same_adapter(lively_dir, corpus, tmp_path):
    """Distilling from the transfer's saved teacher states gives the adapter that a teacher forward
    per step gives, with the teacher run only for validation."""
    tdir = tmp_path / "transfer"
    tr.run_transfer(lively_dir, corpus / "train.safetensors", HEDGEHOG,
                    _transfer_cfg(trainable="logits+feature_map", lr=1e-2, epochs=1, eval_sequences=2,
                                  teacher_states=True), tdir)
    cfg = _lora_cfg(objective="distill", batch_size=4, epochs=1, eval_sequences=4, dropout=0.0)
    kw = dict(hybrid=HEDGEHOG, hybrid_layers=tdir / "hybrid_layers.safetensors")
    fresh = ft.run_finetune(lively_dir, corpus / "train.safetensors", cfg, tmp_path / "fresh", **kw)
    handed = ft.run_finetune(lively_dir, corpus / "train.safetensors", cfg, tmp_path / "handed",
                             teacher_states=tdir / "teacher_states.safetensors", **kw)
    # 44 training rows; the validations before and after the epoch share one teacher forward (1 batch)
    steps, val_forwards = 44 // 4, 1
    assert fresh["teacher_forwards"] == steps + val_forwards and handed["teacher_forwards"] == val_forwards
    assert handed["val_loss_after"] == pytest.approx(fresh["val_loss_after"], rel=1e-4)
    a, b = load_file(str(tmp_path / "fresh" / "adapter_model.safetensors")), load_file(
        str(tmp_path / "handed" / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4, msg=k)


# ---------------------------------------------------------------- bf16 autocast on CPU

@pytest.mark.parametrize("flags,native", [
    ("fpu sse avx2 avx512f avx512bw avx512_bf16 avx512vl", True),  # AMD Zen 4, Intel Cooper Lake
    ("fpu avx2 avx512f amx_bf16 amx_tile", True),  # Intel Sapphire Rapids
    ("fpu sse avx2 avx512f avx512bw avx512vl", False),  # AVX-512 without bf16: oneDNN only emulates it
    ("fp asimd", False),
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, flags, native):
    from hybrid_llama.train.compute import cpu_has_native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert cpu_has_native_bf16(str(info)) is native
    assert cpu_has_native_bf16(str(tmp_path / "absent")) is False


@pytest.mark.parametrize("native", [True, False])
def test_cpu_autocast_follows_native_bf16(monkeypatch, native):
    """`autocast: true` computes in bf16 on a CPU with native bf16 products, in fp32 on any other;
    `false` never does."""
    import hybrid_llama.train.compute as compute

    monkeypatch.setattr(compute, "cpu_has_native_bf16", lambda: native)
    cpu, x = torch.device("cpu"), torch.randn(4, 8)
    with compute.autocast(cpu, True):
        assert (torch.nn.functional.linear(x, x).dtype == torch.bfloat16) is native
    with compute.autocast(cpu, False):
        assert torch.nn.functional.linear(x, x).dtype == torch.float32
    assert compute.autocast_active(cpu, True) is native and compute.autocast_active(cpu, False) is False


@pytest.mark.parametrize("native", [True, False])
def test_eval_dtype_bf16_if_native_follows_the_device(monkeypatch, tiny_model_dir, native):
    """Evaluations with dtype 'bfloat16_if_native' load the stage in bf16 on a CPU with native bf16
    products and on CUDA, in fp32 on any other CPU."""
    import hybrid_llama.runtime as runtime
    from hybrid_llama.stages import load_stage

    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    assert runtime.resolve_dtype("bfloat16_if_native", "cpu") is want
    assert runtime.resolve_dtype("bfloat16_if_native", torch.device("cpu")) is want
    assert runtime.resolve_dtype("bfloat16_if_native", "cuda:0") is torch.bfloat16
    assert runtime.resolve_dtype("float32", "cuda") is torch.float32
    model, _ = load_stage(tiny_model_dir, "base", device="cpu", dtype="bfloat16_if_native")
    assert next(model.parameters()).dtype is want
    assert next(runtime.for_eval(model.float(), "cpu", "bfloat16_if_native").parameters()).dtype is want


def test_cpu_bf16_sparse_cache_transfer_and_distill(monkeypatch, lively_dir, corpus, tmp_path):
    """The cache-active recipe under CPU bf16 autocast, against the same run in fp32: transfer saves
    teacher states marked autocast, distillation reads them (the teacher runs for validation only),
    the reported validation KL is the saved adapter's, recomputed under the same autocast, and both
    stages land where fp32 lands, to bf16's precision."""
    import hybrid_llama.train.compute as compute
    from hybrid_llama.train.teacher_states import TeacherStates

    monkeypatch.setattr(compute, "cpu_has_native_bf16", lambda: True)
    hybrid = {**HEDGEHOG, "sparse_cache": 3, "sinks": 1}
    val_rows = load_packed(corpus / "train.safetensors")[-4:]
    teacher, _ = load_stage(lively_dir, "base")
    runs = {}
    for amp in (True, False):
        out = tmp_path / str(amp)
        mt = tr.run_transfer(lively_dir, corpus / "train.safetensors", hybrid,
                             _transfer_cfg(trainable="logits+feature_map", lr=1e-2, epochs=1, eval_sequences=2,
                                           teacher_states=True, autocast=amp), out / "t")
        states = out / "t" / "teacher_states.safetensors"
        assert TeacherStates(states).teacher == {"dtype": "torch.float32", "autocast": amp}
        m = ft.run_finetune(lively_dir, corpus / "train.safetensors",
                            _lora_cfg(objective="distill", batch_size=4, epochs=2, eval_sequences=4, dropout=0.0,
                                      autocast=amp),
                            out / "d", hybrid=hybrid, hybrid_layers=out / "t" / "hybrid_layers.safetensors",
                            teacher_states=states)
        # the validations before training and after each of the 2 epochs share one teacher forward
        assert m["teacher_forwards"] == 1
        assert mt["autocast_bf16"] is amp and m["autocast_bf16"] is amp
        after, _ = load_stage(lively_dir, "transfer_lora", hybrid=hybrid,
                              hybrid_layers=out / "t" / "hybrid_layers.safetensors", adapter=out / "d")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            assert _kl_per_token(after, teacher, val_rows) == pytest.approx(m["val_loss_after"], rel=1e-3)
        runs[amp] = mt, m
    (mt16, m16), (mt32, m32) = runs[True], runs[False]
    assert mt16["mse_after_mean"] < mt16["mse_before_mean"]
    assert mt16["mse_after_mean"] == pytest.approx(mt32["mse_after_mean"], rel=0.05)
    assert m16["val_loss_after"] == pytest.approx(m32["val_loss_after"], rel=0.05)
    assert m16["val_loss_after"] != m32["val_loss_after"]  # bf16 did run
