"""The default run's recipe on CUDA against the same on the CPU: the converted model's logits, its
cached generation and both training stages, with the decaying state, Hedgehog maps, the sparse cache
and exact heads. Skipped without CUDA; ``benchmarks/gpu_session.sh`` runs them on a lent GPU.

``HYBRID_LLAMA_GPU_TEST_DEVICE=cpu`` runs the file on the CPU (the tests lose their ``gpu`` mark), a
dry run of its logic where there is no GPU; its comparisons then hold trivially."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_models import assert_cached_generation_equals_uncached, randomize_hybrid_params
from test_train import _lora_cfg, _transfer_cfg, corpus  # noqa: F401  (corpus: the module's fixture)

import hybrid_llama.ops.dispatch as dispatch
import hybrid_llama.train.finetune as ft
import hybrid_llama.train.transfer as tr
from hybrid_llama.models import convert_to_hybrid, load_model

DEVICE = os.environ.get("HYBRID_LLAMA_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

# The recommended variant's hybrid settings at the tiny model's scale (config/config.yaml's
# lolcats_retrieval): lolcats formulation, Hedgehog maps, gamma 0.9995, a sparse cache with sinks,
# one exact KV head in each hybrid layer.
LAYERS = [0, 2]
RECIPE = dict(window=4, formulation="lolcats", feature_map="hedgehog", decay=0.9995, sparse_cache=4, sinks=2,
              softmax_heads=[[0, 1], [2, 0]])


def recommended(model_dir, **overrides):
    model, tok = load_model(model_dir, dtype=torch.float32)
    convert_to_hybrid(model, LAYERS, **{**RECIPE, **overrides})
    randomize_hybrid_params(model)
    return model.eval(), tok


@pytest.fixture
def triton_calls(monkeypatch):
    """The triton entry points the dispatcher handed out."""
    taken = []

    def spy(module, attr):
        fn, why = load(module, attr)
        if fn is not None:
            taken.append(attr)
        return fn, why

    load = dispatch._load_triton
    monkeypatch.setattr(dispatch, "_load_triton", spy)
    return taken


# With the sparse cache the prompt takes the batched sparse op on the triton eviction plan on CUDA;
# without it, the triton prefill kernels.
@pytest.mark.parametrize("sparse", [4, 0])
def test_logits_and_generation_match_the_cpu(lively_dir, sparse, triton_calls):
    model, tok = recommended(lively_dir, sparse_cache=sparse, sinks=2 if sparse else 0)
    ids = torch.randint(3, 250, (2, 300), generator=torch.Generator().manual_seed(0))
    on_device = copy.deepcopy(model).to(DEVICE)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = on_device(ids.to(DEVICE), use_cache=False).logits.cpu()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    if DEVICE == "cuda":
        assert ("plan_evictions_triton" in triton_calls) is bool(sparse)
        assert ("hybrid_attention_triton" in triton_calls) is (not sparse)
    enc = tok(["the recipe on the device generates as on the cpu"], return_tensors="pt")
    cached = assert_cached_generation_equals_uncached(on_device, {k: v.to(DEVICE) for k, v in enc.items()}, 30)
    cpu = assert_cached_generation_equals_uncached(model, enc, 30)
    assert torch.equal(cached.sequences.cpu(), cpu.sequences)


def _bf16_drift(model, ids) -> float:
    """Relative error of the model's bf16 logits against its fp32 logits."""
    with torch.no_grad():
        fp32 = model(ids, use_cache=False).logits.float()
        bf16 = copy.deepcopy(model).to(torch.bfloat16)(ids, use_cache=False).logits.float()
    assert torch.isfinite(bf16).all()
    return float((bf16 - fp32).norm() / fp32.norm())


# bf16 against fp32, measured by base's own bf16 error on the same tokens (about 0.11 on the CPU).
# The sparse cache picks its keys by a score that bf16 reorders, so its bound is looser (0.23 on the CPU).
@pytest.mark.parametrize("sparse,bound", [(0, 1.5), (4, 3.0)])
def test_bf16_error_is_base_models_order(lively_dir, sparse, bound):
    ids = torch.randint(3, 250, (1, 1000), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    base, _ = load_model(lively_dir, dtype=torch.float32)
    hybrid, _ = recommended(lively_dir, sparse_cache=sparse, sinks=2 if sparse else 0)
    base_err = _bf16_drift(base.eval().to(DEVICE), ids)
    err = _bf16_drift(hybrid.to(DEVICE), ids)
    assert err <= bound * base_err, f"bf16 error {err:.3f} against base's {base_err:.3f}"


def test_both_stages_train_on_the_device_as_on_the_cpu(lively_dir, corpus, tmp_path):  # noqa: F811
    """Transfer (teacher states saved) then cache-active distillation, fp32 on both devices, the same
    losses; and under the device's bf16 autocast, where the stages run by default, losses close to
    fp32's and training that still helps."""
    hybrid = {"layers": [1, 3], **RECIPE, "softmax_heads": [[1, 0]], "sparse_cache": 3, "sinks": 1}
    runs = []
    for i, (device, amp) in enumerate((("cpu", False), (DEVICE, False), (DEVICE, True))):
        out = tmp_path / f"{i}-{device}-{amp}"
        mt = tr.run_transfer(lively_dir, corpus / "train.safetensors", hybrid,
                             _transfer_cfg(trainable="logits+feature_map", lr=1e-2, epochs=1, eval_sequences=2,
                                           teacher_states=True, autocast=amp, device=device), out / "t")
        m = ft.run_finetune(lively_dir, corpus / "train.safetensors",
                            _lora_cfg(objective="distill", batch_size=4, epochs=2, eval_sequences=4, dropout=0.0,
                                      autocast=amp, device=device),
                            out / "d", hybrid=hybrid, hybrid_layers=out / "t" / "hybrid_layers.safetensors",
                            teacher_states=out / "t" / "teacher_states.safetensors")
        assert (out / "d" / "adapter_model.safetensors").exists()
        runs.append((mt, m))
    (mt_cpu, m_cpu), (mt_dev, m_dev), (mt_amp, m_amp) = runs
    assert mt_dev["mse_after_mean"] == pytest.approx(mt_cpu["mse_after_mean"], rel=1e-3)
    assert m_dev["val_loss_after"] == pytest.approx(m_cpu["val_loss_after"], rel=1e-3)
    assert mt_amp["mse_after_mean"] < mt_amp["mse_before_mean"]
    assert m_amp["val_loss_after"] < m_amp["val_loss_before"]
    assert mt_amp["mse_after_mean"] == pytest.approx(mt_cpu["mse_after_mean"], rel=0.1)
    assert m_amp["val_loss_after"] == pytest.approx(m_cpu["val_loss_after"], rel=0.1)
