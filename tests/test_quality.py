"""Quality metrics: passkey prompts, held-out perplexity, paired significance, CSVs (the report's
summary and quality plots are tested in tests/test_report_render.py and tests/test_plots.py)."""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from hybrid_llama import data
from hybrid_llama.eval import quality as Q
from hybrid_llama.models import load_model
from hybrid_llama.pipeline import shared_data_dir
from hybrid_llama.weights import byte_tokenizer

SHARED = shared_data_dir()
FINEWEB = SHARED / "fineweb-edu" / "fineweb-edu-sample-10BT.150docs.text.jsonl"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def byte_tok():
    """The project's byte tokenizer: byte b -> id 3 + b, BOS added by default (like Llama tokenizers)."""
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok():
    """A small trained BPE (multi-character tokens, digits merged), no BOS: a different tokenizer shape."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = (
        list(Q.FILLER_SENTENCES) * 5 + [Q.PASSKEY_INTRO, Q.PASSKEY_QUESTION] + [f"key {i} 98{i}1" for i in range(100)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def tiny_llama(model_dir: Path, max_pos: int | None = None) -> LlamaForCausalLM:
    """The tiny_model_dir model, optionally with fewer positions (to test the length cap)."""
    model, _ = load_model(model_dir, dtype=torch.float32)
    if max_pos is not None:
        model.config.max_position_embeddings = max_pos
    return model.eval()


TEXTS = [f"Document {i}: " + " ".join(Q.FILLER_SENTENCES[i % 12 :] + Q.FILLER_SENTENCES[: i % 12]) for i in range(4)]


# ----------------------------------------------------------------------------- passkey prompts


@pytest.mark.parametrize("L", [256, 512, 1000, 2048])
def test_passkey_prompt_exact_length_and_depth_bytes(byte_tok, L):
    # one token per byte: character offsets in the text are token positions (+1 for BOS), so the
    # expected layout follows from the template strings alone
    key = "31337"
    before_fixed = 1 + len(Q.PASSKEY_INTRO)
    fixed = (
        before_fixed
        + len(" The pass key is")
        + len(" " + key)
        + len(f". Remember it. {key} is the pass key.")
        + len(Q.PASSKEY_QUESTION)
    )
    for i, depth in enumerate((0.0, 0.1, 0.33, 0.5, 0.9, 1.0)):
        ids, (s, e) = Q.make_passkey_prompt(byte_tok, context_len=L, depth=depth, key=key, seed=i)
        assert len(ids) == L and ids[0] == byte_tok.bos_token_id
        text = byte_tok.decode(ids, skip_special_tokens=True)
        statement = 1 + text.index(" The pass key is " + key)
        filler_before = statement - before_fixed
        assert abs(filler_before - depth * (L - fixed)) <= 1, (filler_before, depth, L - fixed)
        assert 1 + text.index(key) == s + 1  # span starts at the space before the digits
        assert byte_tok.decode(ids[s:e]) == " " + key
        assert text.count(key) == 2 and text.startswith(Q.PASSKEY_INTRO)
        assert text.endswith("What is the pass key? The pass key is")
    # at long lengths the fixed parts vanish: position / length is the depth within a few percent
    if L >= 2048:
        ids, (s, e) = Q.make_passkey_prompt(byte_tok, context_len=L, depth=0.5, key=key)
        assert abs(s / L - 0.5) < 0.03


@pytest.mark.parametrize("L", [128, 256, 777])
def test_passkey_prompt_exact_length_and_depth_bpe(bpe_tok, L):
    parts = Q.passkey_parts(bpe_tok, 54321)
    fixed = sum(len(p) for p in parts.values())
    for depth in (0.1, 0.5, 0.9):
        ids, (s, e) = Q.make_passkey_prompt(bpe_tok, context_len=L, depth=depth, key=54321, seed=3)
        assert len(ids) == L
        # the first prefix of the prompt that spells out the key ends exactly at the span's end
        first_full = next(i for i in range(1, L + 1) if "54321" in bpe_tok.decode(ids[:i]))
        assert first_full == e
        assert "5" not in bpe_tok.decode(ids[:s]) and bpe_tok.decode(ids[s:e]).strip() == "54321"
        filler_before = s - len(parts["head"]) - len(parts["pre"])
        assert abs(filler_before - depth * (L - fixed)) <= 1


@pytest.fixture(scope="module")
def real_tokenizer(request):
    """SmolLM2's tokenizer (the default run's), or the model dir in $HYBRID_LLAMA_TEST_TOKENIZER."""
    from transformers import AutoTokenizer

    path = os.environ.get("HYBRID_LLAMA_TEST_TOKENIZER") or request.getfixturevalue("smollm2_dir")
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize("L", [256, 1024, 2048])
def test_passkey_prompt_real_tokenizer(real_tokenizer, L):
    tok = real_tokenizer
    parts = Q.passkey_parts(tok, 24680)
    fixed = sum(len(p) for p in parts.values())
    for depth in (0.1, 0.5, 0.9):
        ids, (s, e) = Q.make_passkey_prompt(tok, context_len=L, depth=depth, key=24680, seed=5)
        assert len(ids) == L
        first_full = next(i for i in range(s, L + 1) if "24680" in tok.decode(ids[:i]))
        assert first_full == e and "24680" not in tok.decode(ids[:s])
        assert abs(s - len(parts["head"]) - len(parts["pre"]) - depth * (L - fixed)) <= 1
        assert abs(s / L - depth) <= fixed / L


def test_passkey_prompt_deterministic_and_seeded(byte_tok):
    a = Q.make_passkey_prompt(byte_tok, context_len=600, depth=0.5, key=12345, seed=0)
    assert a == Q.make_passkey_prompt(byte_tok, context_len=600, depth=0.5, key=12345, seed=0)
    b = Q.make_passkey_prompt(byte_tok, context_len=600, depth=0.5, key=12345, seed=1)
    assert a[1] == b[1] and a[0] != b[0]  # same layout, different filler order


def test_passkey_prompt_that_cannot_fit_raises(byte_tok):
    with pytest.raises(ValueError, match="cannot fit"):
        Q.make_passkey_prompt(byte_tok, context_len=128, depth=0.1, key=12345)
    with pytest.raises(ValueError):
        Q.make_passkey_prompt(byte_tok, context_len=600, depth=1.5, key=12345)


def test_key_found():
    assert Q.key_found(" 12345. Remember", "12345")
    assert not Q.key_found(" 123456", "12345")
    assert not Q.key_found(" 1234 5", "12345")
    assert Q.key_found("is 777 or 12345", "12345")


# ----------------------------------------------------------------------------- passkey accuracy


class OracleLlama(LlamaForCausalLM):
    """Answers by reading the key from the prompt (offset 0) or a wrong one (offset 1)."""

    offset = 0
    tokenizer = None
    calls: list = []

    def generate(self, input_ids, **kw):
        OracleLlama.calls.append(kw)
        rows = []
        for row in input_ids.tolist():
            key = int(re.search(r"The pass key is (\d+)", self.tokenizer.decode(row)).group(1)) + self.offset
            new = self.tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]
            new = (new + [self.tokenizer.eos_token_id] * kw["max_new_tokens"])[: kw["max_new_tokens"]]
            rows.append(row + new)
        return torch.tensor(rows)


@pytest.mark.parametrize("offset,expected", [(0, 1.0), (1, 0.0)])
def test_passkey_accuracy_scores_retrieval(byte_tok, tiny_model_dir, offset, expected):
    model = OracleLlama(tiny_llama(tiny_model_dir, max_pos=1024).config).eval()
    OracleLlama.offset, OracleLlama.tokenizer, OracleLlama.calls = offset, byte_tok, []
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        rows = Q.passkey_accuracy(
            model,
            byte_tok,
            context_lens=[256, 768, 4096],
            depths=(0.2, 0.8),
            trials=3,
            seed=0,
            stage="oracle",
            batch_size=2,
        )
    # 4096 exceeds max_position_embeddings: skipped
    assert [(r["context_len"], r["depth"]) for r in rows] == [(256, 0.2), (256, 0.8), (768, 0.2), (768, 0.8)]
    assert all(r["accuracy"] == expected and r["n"] == 3 and r["stage"] == "oracle" for r in rows)
    assert all(c["do_sample"] is False and c["use_cache"] is True for c in OracleLlama.calls)


def test_passkey_accuracy_runs_generate_on_tiny_model(tiny_model):
    model, byte_tok = tiny_model
    rows = Q.passkey_accuracy(model, byte_tok, context_lens=[256], depths=(0.5,), trials=2, seed=1, stage="base")
    assert len(rows) == 1 and rows[0]["n"] == 2 and 0.0 <= rows[0]["accuracy"] <= 1.0


# ----------------------------------------------------------------------------- perplexity


def test_window_ends_share_targets_and_never_overlap():
    ends = Q.window_ends(5000, 1024, 64, 7)
    assert len(ends) == 7 and ends[0] == 1024 and ends[-1] <= 5000
    assert all(b - a >= 64 for a, b in zip(ends, ends[1:]))
    wins = Q.perplexity_windows(5000, [64, 256, 1024, 8192], tail=64, max_windows=7, max_len=2048)
    assert sorted(wins) == [64, 256, 1024]
    for L, spans in wins.items():
        assert [e for _, e in spans] == ends and all(e - s == L for s, e in spans)


def test_perplexity_matches_direct_computation(byte_tok, tiny_model_dir):
    model = tiny_llama(tiny_model_dir, max_pos=512)
    tail = 8
    rows = Q.perplexity_vs_context(
        model, byte_tok, TEXTS, context_lens=[8, 16, 128, 1024], tail=tail, stage="base", max_windows=1
    )
    assert [r["context_len"] for r in rows] == [8, 16, 128]  # 1024 > max positions
    # independent: one window ending at the longest length, full logits, cross-entropy of the last tokens
    stream = [i for t in TEXTS for i in [3 + b for b in t.encode("utf-8")] + [byte_tok.eos_token_id]]
    for r in rows:
        L = r["context_len"]
        window = torch.tensor(stream[128 - L : 128]).unsqueeze(0)
        t = min(tail, L - 1)
        with torch.no_grad():
            logits = model(window).logits[0]
        direct = F.cross_entropy(logits[-t - 1 : -1], window[0, -t:]).item()
        assert r["nll"] == pytest.approx(direct, abs=1e-5)
        assert r["ppl"] == pytest.approx(math.exp(direct), rel=1e-5) and r["n_tokens"] == t
    # batching and the window cap: several windows, batch sizes agree
    many = Q.perplexity_vs_context(
        model, byte_tok, TEXTS, context_lens=[16, 128], tail=tail, stage="base", max_windows=5, batch_size=1
    )
    batched = Q.perplexity_vs_context(
        model, byte_tok, TEXTS, context_lens=[16, 128], tail=tail, stage="base", max_windows=5, batch_size=3
    )
    assert [r["n_tokens"] for r in many] == [5 * tail] * 2
    for a, b in zip(many, batched):
        assert a["nll"] == pytest.approx(b["nll"], abs=1e-5)


def test_hybrid_equals_base_within_window_and_runs_passkey(byte_tok, tiny_model_dir):
    """Within the softmax window the hybrid layer has no linear part, so NLL equals the base model's."""
    from hybrid_llama.models import convert_to_hybrid

    base = tiny_llama(tiny_model_dir)
    hybrid = convert_to_hybrid(tiny_llama(tiny_model_dir), layers=[0, 1, 3], window=16)
    kw = dict(context_lens=[16, 128], tail=8, max_windows=2)
    rb = Q.perplexity_vs_context(base, byte_tok, TEXTS, stage="base", **kw)
    rh = Q.perplexity_vs_context(hybrid, byte_tok, TEXTS, stage="transfer", **kw)
    assert rh[0]["nll"] == pytest.approx(rb[0]["nll"], abs=1e-4)
    assert abs(rh[1]["nll"] - rb[1]["nll"]) > 1e-4  # beyond the window the linear part takes over
    rows = Q.passkey_accuracy(hybrid, byte_tok, context_lens=[256], depths=(0.5,), trials=2, stage="transfer")
    assert rows[0]["n"] == 2


# ----------------------------------------------------------------------------- held-out slice


def _ngram_hashes(tokens: np.ndarray, n: int) -> set[bytes]:
    b = np.ascontiguousarray(tokens.astype(np.int32))
    return {hashlib.blake2b(b[i : i + n].tobytes(), digest_size=8).digest() for i in range(len(b) - n + 1)}


@pytest.mark.skipif(not FINEWEB.exists(), reason="shared fineweb-edu sample not present")
@pytest.mark.parametrize("packing", ["train_split", "all_with_budget"])
def test_heldout_windows_never_contain_training_tokens(byte_tok, tmp_path, packing):
    source = {"kind": "local", "path": str(FINEWEB), "text_column": "text"}
    packed = tmp_path / "transfer.safetensors"
    if packing == "train_split":
        manifest = data.prepare_transfer_corpus(
            source, byte_tok, packed, seq_len=1024, num_tokens=None, split="train", heldout_fraction=0.2, seed=0
        )
    else:  # no hash split: only documents past the token budget are held out
        manifest = data.prepare_transfer_corpus(source, byte_tok, packed, seq_len=1024, num_tokens=300_000)
    held = Q.heldout_texts(source, exclude_manifest=packed)
    assert len(held) >= 10
    # 1) document level: no held-out sha256 is among the packed documents' hashes
    held_hashes = {hashlib.sha256(t.encode("utf-8")).hexdigest() for t in held}
    assert not held_hashes & set(manifest["doc_hashes"])
    # 2) token level: no 96-token run of any perplexity window occurs in the packed training tokens
    train_grams = _ngram_hashes(data.load_packed(packed).flatten().numpy(), 96)
    stream = np.array(Q.token_stream(byte_tok, held))
    wins = Q.perplexity_windows(len(stream), [2**k for k in range(6, 12)], tail=64, max_windows=32)
    longest = max(wins)
    assert len(wins[longest]) == 32
    for s, e in wins[longest]:  # shorter lengths use sub-windows of these
        assert not _ngram_hashes(stream[s:e], 96) & train_grams
    # the check has teeth: a packed document's own tokens are found
    trained = next(t for t in data.iter_documents(source) if data.doc_hash(t[0]) in set(manifest["doc_hashes"]))[0]
    assert _ngram_hashes(np.array(byte_tok(trained, add_special_tokens=False)["input_ids"][:500]), 96) & train_grams
    # deterministic and capped
    assert Q.heldout_texts(source, exclude_manifest=packed, n_docs=3) == held[:3]


# ----------------------------------------------------------------------------- significance


def _result(correct: list[bool], fmt: str = "mc", subject: str = "anatomy") -> dict:
    qs = [{"subject": subject, "doc_id": i, "gold": "A", "pred": "A" if c else "B"} for i, c in enumerate(correct)]
    return {"fmt": fmt, "shots": 0, "questions": qs}


def test_paired_difference_significance_rule():
    n = 100
    # b right on the first 40, a on the first 60: a is better on 20 questions, never worse
    sig = Q.paired_difference(_result([i < 60 for i in range(n)]), _result([i < 40 for i in range(n)]))
    assert sig["n"] == n and sig["diff"] == pytest.approx(0.2)
    assert sig["stderr_paired"] == pytest.approx(math.sqrt((20 - n * 0.04) / (n - 1)) / 10)
    assert sig["stderr_a"] == pytest.approx(math.sqrt(0.6 * 0.4 * n / (n - 1)) / 10)
    assert sig["significant"] is True and sig["n_discordant"] == 20
    # 3 questions only a gets, 1 only b gets: diff 0.02, paired se 0.02 -> not significant
    a = [i < 50 or i in (90, 91, 92) for i in range(n)]
    b = [i < 50 or i == 93 for i in range(n)]
    ns = Q.paired_difference(_result(a), _result(b))
    assert ns["diff"] == pytest.approx(0.02) and ns["stderr_paired"] == pytest.approx(0.02)
    assert ns["significant"] is False
    # pairing matters: 52% vs 45% with b's right answers a subset of a's is significant paired,
    # though the unpaired combined stderr would call it noise
    p = Q.paired_difference(_result([i < 52 for i in range(n)]), _result([i < 45 for i in range(n)]))
    assert p["significant"] is True and abs(p["diff"]) < 2 * p["stderr_unpaired"]


def test_paired_difference_matches_questions_by_subject_and_doc_id():
    a = _result([True, False, True])
    a["questions"] += _result([True], subject="law")["questions"]
    b = _result([False, False, True, True], subject="anatomy")  # doc 3 exists only in b
    b["questions"] = list(reversed(b["questions"]))  # order must not matter
    r = Q.paired_difference(a, b)
    assert r["n"] == 3 and r["acc_a"] == pytest.approx(2 / 3) and r["acc_b"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="fmt"):
        Q.paired_difference(_result([True, False], fmt="cloze"), _result([True, False]))


def test_paired_difference_acc_norm():
    a = _result([True, True, False], fmt="cloze")
    for q, norm in zip(a["questions"], ["B", "A", "A"]):
        q["pred_norm"] = norm
    r = Q.paired_difference(a, a, metric="acc_norm")
    assert r["acc_a"] == pytest.approx(2 / 3) and r["diff"] == 0 and r["significant"] is False


# ----------------------------------------------------------------------------- CSV


def _ppl_rows(transfer_long: float) -> list[dict]:
    base = {64: 3.0, 256: 2.8, 1024: 2.6}
    transfer = {64: 3.05, 256: 2.95, 1024: transfer_long}
    return [
        {
            "stage": s,
            "context_len": L,
            "nll": v,
            "ppl": math.exp(v),
            "n_tokens": 640,
            "window_nlls": [v - 0.25, v + 0.25],
        }
        for s, d in (("base", base), ("transfer", transfer))
        for L, v in d.items()
    ]


def _passkey_rows(transfer_acc: float) -> list[dict]:
    return [
        {
            "stage": s,
            "context_len": L,
            "depth": d,
            "accuracy": a if L < 1024 else (1.0 if s == "base" else transfer_acc),
            "n": 20,
        }
        for s, a in (("base", 1.0), ("transfer", 0.9))
        for L in (256, 1024)
        for d in (0.1, 0.5, 0.9)
    ]


def test_csv_roundtrip(tmp_path):
    rows = _ppl_rows(2.9)
    p = Q.write_perplexity_csv([dict(r, extra=1) for r in rows], tmp_path / "q" / "perplexity.csv")
    assert p.read_text().splitlines()[0] == "stage,context_len,nll,ppl,n_tokens,window_nlls"
    assert Q.read_perplexity_csv(p) == rows
    k = Q.write_passkey_csv(_passkey_rows(0.1), tmp_path / "passkey.csv")
    assert k.read_text().splitlines()[0] == "stage,context_len,depth,accuracy,n"
    assert Q.read_passkey_csv(k) == _passkey_rows(0.1)


def test_paired_nll_difference_by_hand():
    rows = [
        {"stage": "base", "context_len": 512, "nll": 2.0, "window_nlls": [1.0, 2.0, 3.0]},
        {"stage": "hyb", "context_len": 512, "nll": 2.5, "window_nlls": [1.2, 2.6, 3.7]},
    ]
    d = Q.paired_nll_difference(rows, "hyb", "base", 512)
    # differences 0.2, 0.6, 0.7: mean 0.5, sample sd sqrt(0.07), stderr sqrt(0.07 / 3)
    assert d["diff"] == pytest.approx(0.5) and d["n_windows"] == 3
    assert d["stderr"] == pytest.approx(math.sqrt(0.07 / 3))
    assert Q.paired_nll_difference(rows, "hyb", "base", 64) is None


def test_perplexity_window_nlls_average_to_the_nll(tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    texts = ["The quick brown fox jumps over the lazy dog. " * 40]
    rows = Q.perplexity_vs_context(model, tok, texts, context_lens=[32, 64], tail=8, max_windows=4, stage="base")
    for r in rows:
        assert len(r["window_nlls"]) == 4
        assert sum(r["window_nlls"]) / 4 == pytest.approx(r["nll"], abs=1e-9)
