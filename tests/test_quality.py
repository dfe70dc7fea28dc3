"""Quality metrics: passkey prompts, held-out perplexity, paired significance, CSVs (the report's
summary and quality plots are tested in tests/test_report_render.py and tests/test_plots.py)."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from hybrid_llama import data
from hybrid_llama.eval import heldout as HO
from hybrid_llama.eval import passkey as PK
from hybrid_llama.eval import perplexity as PPL
from hybrid_llama.eval import tables as T
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
        list(PK.FILLER_SENTENCES) * 5
        + [PK.PASSKEY_INTRO, PK.PASSKEY_QUESTION]
        + [f"key {i} 98{i}1" for i in range(100)]
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


TEXTS = [f"Document {i}: " + " ".join(PK.FILLER_SENTENCES[i % 12 :] + PK.FILLER_SENTENCES[: i % 12]) for i in range(4)]


# ----------------------------------------------------------------------------- passkey prompts


@pytest.mark.parametrize("L", [256, 512, 1000, 2048])
def test_passkey_prompt_exact_length_and_depth_bytes(byte_tok, L):
    # one token per byte: character offsets in the text are token positions (+1 for BOS), so the
    # expected layout follows from the template strings alone
    key = "31337"
    before_fixed = 1 + len(PK.PASSKEY_INTRO)
    fixed = (
        before_fixed
        + len(" The pass key is")
        + len(" " + key)
        + len(f". Remember it. {key} is the pass key.")
        + len(PK.PASSKEY_QUESTION)
    )
    for i, depth in enumerate((0.0, 0.1, 0.33, 0.5, 0.9, 1.0)):
        ids, (s, e) = PK.make_passkey_prompt(byte_tok, context_len=L, depth=depth, key=key, seed=i)
        assert len(ids) == L and ids[0] == byte_tok.bos_token_id
        text = byte_tok.decode(ids, skip_special_tokens=True)
        statement = 1 + text.index(" The pass key is " + key)
        filler_before = statement - before_fixed
        assert abs(filler_before - depth * (L - fixed)) <= 1, (filler_before, depth, L - fixed)
        assert 1 + text.index(key) == s + 1  # span starts at the space before the digits
        assert byte_tok.decode(ids[s:e]) == " " + key
        assert text.count(key) == 2 and text.startswith(PK.PASSKEY_INTRO)
        assert text.endswith("What is the pass key? The pass key is")
    # at long lengths the fixed parts vanish: position / length is the depth within a few percent
    if L >= 2048:
        ids, (s, e) = PK.make_passkey_prompt(byte_tok, context_len=L, depth=0.5, key=key)
        assert abs(s / L - 0.5) < 0.03


@pytest.mark.parametrize("L", [128, 256, 777])
def test_passkey_prompt_exact_length_and_depth_bpe(bpe_tok, L):
    parts = PK.passkey_parts(bpe_tok, 54321)
    fixed = sum(len(p) for p in parts.values())
    for depth in (0.1, 0.5, 0.9):
        ids, (s, e) = PK.make_passkey_prompt(bpe_tok, context_len=L, depth=depth, key=54321, seed=3)
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
    parts = PK.passkey_parts(tok, 24680)
    fixed = sum(len(p) for p in parts.values())
    for depth in (0.1, 0.5, 0.9):
        ids, (s, e) = PK.make_passkey_prompt(tok, context_len=L, depth=depth, key=24680, seed=5)
        assert len(ids) == L
        first_full = next(i for i in range(s, L + 1) if "24680" in tok.decode(ids[:i]))
        assert first_full == e and "24680" not in tok.decode(ids[:s])
        assert abs(s - len(parts["head"]) - len(parts["pre"]) - depth * (L - fixed)) <= 1
        assert abs(s / L - depth) <= fixed / L


def test_passkey_prompt_deterministic_and_seeded(byte_tok):
    a = PK.make_passkey_prompt(byte_tok, context_len=600, depth=0.5, key=12345, seed=0)
    assert a == PK.make_passkey_prompt(byte_tok, context_len=600, depth=0.5, key=12345, seed=0)
    b = PK.make_passkey_prompt(byte_tok, context_len=600, depth=0.5, key=12345, seed=1)
    assert a[1] == b[1] and a[0] != b[0]  # same layout, different filler order


def test_passkey_prompt_that_cannot_fit_raises(byte_tok):
    with pytest.raises(ValueError, match="cannot fit"):
        PK.make_passkey_prompt(byte_tok, context_len=128, depth=0.1, key=12345)
    with pytest.raises(ValueError):
        PK.make_passkey_prompt(byte_tok, context_len=600, depth=1.5, key=12345)


def test_key_found():
    assert PK.key_found(" 12345. Remember", "12345")
    assert not PK.key_found(" 123456", "12345")
    assert not PK.key_found(" 1234 5", "12345")
    assert PK.key_found("is 777 or 12345", "12345")


# ----------------------------------------------------------------------------- passkey accuracy


def _greedy_starts_with(model, prompt: list[int], answer: list[int]) -> bool:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(answer),
                             min_new_tokens=len(answer), do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist() == answer


@pytest.mark.parametrize("hybrid", [None, "sparse"])
def test_teacher_forced_hit_equals_greedy_generation(lively_dir, hybrid):
    """The cheap score must read what exact greedy generation (with the cache) does: checked on
    passkey trials (misses, for a random model) and on the same prompts with the model's own greedy
    continuation as the answer (hits by construction), and with one perturbed token (misses)."""
    from hybrid_llama.models import convert_to_hybrid

    model, tok = load_model(lively_dir, dtype=torch.float32)
    if hybrid:
        convert_to_hybrid(model, [0, 2], window=16, formulation="lolcats", feature_map="hedgehog", sparse_cache=8,
                          sinks=2)
    model.eval()
    trials = PK.needle_trials(tok, context_len=240, trials=4, seed=3)
    cases = []
    for t in trials:
        with torch.no_grad():
            own = model.generate(input_ids=torch.tensor([t["prompt"]]), max_new_tokens=4, do_sample=False,
                                 pad_token_id=0)[0, len(t["prompt"]):].tolist()
        cases += [t, {**t, "answer": own}, {**t, "answer": own[:-1] + [(own[-1] + 1) % 300]}]
    outcomes = []
    for c in cases:
        hit, _ = PK.teacher_forced_hit(model, c)
        assert hit == _greedy_starts_with(model, c["prompt"], c["answer"])
        outcomes.append(hit)
    assert any(outcomes) and not all(outcomes)


def test_passkey_rows_per_trial(tiny_model_dir, byte_tok):
    model = tiny_llama(tiny_model_dir, max_pos=1024)
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        rows = PK.passkey_accuracy(model, byte_tok, context_lens=[256, 768, 4096], trials=3, seed=0, stage="s",
                                   generate_trials=2)
    tf = [r for r in rows if r["method"] == "teacher_forced"]
    gen = [r for r in rows if r["method"] == "generate"]
    assert [(r["context_len"], r["trial"]) for r in tf] == [(L, i) for L in (256, 768) for i in range(3)]
    assert [(r["context_len"], r["trial"]) for r in gen] == [(256, 0), (256, 1)]  # the shortest length only
    assert sorted({r["depth"] for r in tf}) == pytest.approx([1 / 6, 1 / 2, 5 / 6], abs=1e-5)  # spread evenly
    assert len({r["key"] for r in tf}) == len(tf)
    for r in tf:  # the distance runs from the needle's end to the question's start
        t = PK.needle_trials(byte_tok, context_len=r["context_len"], trials=3, seed=0)[r["trial"]]
        question = len(byte_tok(PK.PASSKEY_QUESTION, add_special_tokens=False)["input_ids"])
        assert r["needle_distance"] == r["context_len"] - question - (t["needle"][-1] + 1)
        assert r["accuracy"] in (0.0, 1.0) and r["n"] == 1 and r["needle_in_cache"] == ""


def test_wilson_interval_and_beyond_window_summary():
    lo, hi = T.wilson_interval(8, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)  # the textbook 95 % Wilson interval
    assert T.wilson_interval(0, 12)[0] == 0.0 and round(T.wilson_interval(0, 12)[1], 4) == 0.2425
    assert T.wilson_interval(12, 12)[1] == pytest.approx(1.0)
    rows = [{"context_len": 1024, "needle_distance": d, "accuracy": a, "n": 1, "method": m}
            for d, a, m in ((50, 1.0, "teacher_forced"), (300, 0.0, "teacher_forced"), (900, 1.0, "teacher_forced"),
                            (900, 0.0, "generate"))]
    allp = T.passkey_summary(rows, 1024)
    far = T.passkey_summary(rows, 1024, beyond=T.BEYOND_WINDOW)
    assert (allp["found"], allp["trials"], far["found"], far["trials"]) == (2, 3, 1, 2)
    assert T.passkey_summary(rows, 1024, method="generate")["accuracy"] == 0.0
    assert T.passkey_summary(rows, 2048) is None


def test_needle_in_cache_reads_the_reference_simulation():
    """The share of needle positions in a layer's cache equals what the literal eviction simulation
    (ops.sparse_reference) holds after the same tokens."""
    from types import SimpleNamespace

    from hybrid_llama.layers import HybridCacheLayer
    from hybrid_llama.ops import SparseCacheConfig, hybrid_attention
    from hybrid_llama.ops.sparse.reference import hybrid_attention_sparse_reference

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 90, 8, generator=g) for h in (4, 2, 2))
    wl, ll = torch.randn(4, generator=g), torch.randn(4, generator=g)
    _, state = hybrid_attention(q, k, v, wl, ll, window=8, formulation="lolcats", sparse=SparseCacheConfig(6, 1),
                                output_final_state=True)
    _, _, history = hybrid_attention_sparse_reference(q, k, v, wl, ll, window=8, cache=SparseCacheConfig(6, 1))
    layer = HybridCacheLayer()
    layer.set_state(state, 90)
    cache = SimpleNamespace(layers=[layer, object()])
    for needle in ([10, 11, 12], list(range(20, 40)), [85]):
        want = sum(len(set(needle) & set(history[0][h][-1])) for h in range(2)) / (2 * len(needle))
        assert PK.needle_in_cache(cache, needle) == [pytest.approx(want)]
    assert any(PK.needle_in_cache(cache, n)[0] > 0 for n in ([p] for p in range(9, 80)))


# ----------------------------------------------------------------------------- perplexity


def test_window_ends_share_targets_and_never_overlap():
    ends = PPL.window_ends(5000, 1024, 64, 7)
    assert len(ends) == 7 and ends[0] == 1024 and ends[-1] <= 5000
    assert all(b - a >= 64 for a, b in zip(ends, ends[1:]))
    wins = PPL.perplexity_windows(5000, [64, 256, 1024, 8192], tail=64, max_windows=7, max_len=2048)
    assert sorted(wins) == [64, 256, 1024]
    for L, spans in wins.items():
        assert [e for _, e in spans] == ends and all(e - s == L for s, e in spans)


def test_perplexity_matches_direct_computation(byte_tok, tiny_model_dir):
    model = tiny_llama(tiny_model_dir, max_pos=512)
    tail = 8
    rows = PPL.perplexity_vs_context(
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
    many = PPL.perplexity_vs_context(
        model, byte_tok, TEXTS, context_lens=[16, 128], tail=tail, stage="base", max_windows=5, batch_size=1
    )
    batched = PPL.perplexity_vs_context(
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
    rb = PPL.perplexity_vs_context(base, byte_tok, TEXTS, stage="base", **kw)
    rh = PPL.perplexity_vs_context(hybrid, byte_tok, TEXTS, stage="transfer", **kw)
    assert rh[0]["nll"] == pytest.approx(rb[0]["nll"], abs=1e-4)
    assert abs(rh[1]["nll"] - rb[1]["nll"]) > 1e-4  # beyond the window the linear part takes over
    rows = PK.passkey_accuracy(hybrid, byte_tok, context_lens=[256], depths=(0.5,), trials=2, stage="transfer")
    assert [(r["trial"], r["depth"], r["n"]) for r in rows] == [(0, 0.5, 1), (1, 0.5, 1)]


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
    held = HO.heldout_texts(source, exclude_manifest=packed)
    assert len(held) >= 10
    # 1) document level: no held-out sha256 is among the packed documents' hashes
    held_hashes = {hashlib.sha256(t.encode("utf-8")).hexdigest() for t in held}
    assert not held_hashes & set(manifest["doc_hashes"])
    # 2) token level: no 96-token run of any perplexity window occurs in the packed training tokens
    train_grams = _ngram_hashes(data.load_packed(packed).flatten().numpy(), 96)
    stream = np.array(HO.token_stream(byte_tok, held))
    wins = PPL.perplexity_windows(len(stream), [2**k for k in range(6, 12)], tail=64, max_windows=32)
    longest = max(wins)
    assert len(wins[longest]) == 32
    for s, e in wins[longest]:  # shorter lengths use sub-windows of these
        assert not _ngram_hashes(stream[s:e], 96) & train_grams
    # the check has teeth: a packed document's own tokens are found
    trained = next(t for t in data.iter_documents(source) if data.doc_hash(t[0]) in set(manifest["doc_hashes"]))[0]
    assert _ngram_hashes(np.array(byte_tok(trained, add_special_tokens=False)["input_ids"][:500]), 96) & train_grams
    # deterministic and capped
    assert HO.heldout_texts(source, exclude_manifest=packed, n_docs=3) == held[:3]


# ----------------------------------------------------------------------------- significance


def _result(correct: list[bool], fmt: str = "mc", subject: str = "anatomy") -> dict:
    qs = [{"subject": subject, "doc_id": i, "gold": "A", "pred": "A" if c else "B"} for i, c in enumerate(correct)]
    return {"fmt": fmt, "shots": 0, "questions": qs}


def test_paired_difference_significance_rule():
    n = 100
    # b right on the first 40, a on the first 60: a is better on 20 questions, never worse
    sig = T.paired_difference(_result([i < 60 for i in range(n)]), _result([i < 40 for i in range(n)]))
    assert sig["n"] == n and sig["diff"] == pytest.approx(0.2)
    assert sig["stderr_paired"] == pytest.approx(math.sqrt((20 - n * 0.04) / (n - 1)) / 10)
    assert sig["stderr_a"] == pytest.approx(math.sqrt(0.6 * 0.4 * n / (n - 1)) / 10)
    assert sig["significant"] is True and sig["n_discordant"] == 20
    # 3 questions only a gets, 1 only b gets: diff 0.02, paired se 0.02 -> not significant
    a = [i < 50 or i in (90, 91, 92) for i in range(n)]
    b = [i < 50 or i == 93 for i in range(n)]
    ns = T.paired_difference(_result(a), _result(b))
    assert ns["diff"] == pytest.approx(0.02) and ns["stderr_paired"] == pytest.approx(0.02)
    assert ns["significant"] is False
    # pairing matters: 52% vs 45% with b's right answers a subset of a's is significant paired,
    # though the unpaired combined stderr would call it noise
    p = T.paired_difference(_result([i < 52 for i in range(n)]), _result([i < 45 for i in range(n)]))
    assert p["significant"] is True and abs(p["diff"]) < 2 * p["stderr_unpaired"]


def test_paired_difference_matches_questions_by_subject_and_doc_id():
    a = _result([True, False, True])
    a["questions"] += _result([True], subject="law")["questions"]
    b = _result([False, False, True, True], subject="anatomy")  # doc 3 exists only in b
    b["questions"] = list(reversed(b["questions"]))  # order must not matter
    r = T.paired_difference(a, b)
    assert r["n"] == 3 and r["acc_a"] == pytest.approx(2 / 3) and r["acc_b"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="fmt"):
        T.paired_difference(_result([True, False], fmt="cloze"), _result([True, False]))


def test_paired_difference_acc_norm():
    a = _result([True, True, False], fmt="cloze")
    for q, norm in zip(a["questions"], ["B", "A", "A"]):
        q["pred_norm"] = norm
    r = T.paired_difference(a, a, metric="acc_norm")
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


def test_csv_roundtrip(tmp_path):
    rows = _ppl_rows(2.9)
    p = T.write_perplexity_csv([dict(r, extra=1) for r in rows], tmp_path / "q" / "perplexity.csv")
    assert p.read_text().splitlines()[0] == "stage,context_len,nll,ppl,n_tokens,window_nlls"
    assert T.read_perplexity_csv(p) == rows
    trials = [{"stage": "s", "context_len": 1024, "trial": i, "depth": 0.25, "key": "12345", "needle_distance": 300,
               "method": "teacher_forced", "accuracy": float(i % 2), "n": 1, "needle_in_cache": 0.5 if i else None,
               "needle_in_cache_layers": "0.500 0.500" if i else ""} for i in range(2)]
    k = T.write_passkey_csv(trials, tmp_path / "passkey.csv")
    assert k.read_text().splitlines()[0] == ",".join(T.PASSKEY_COLUMNS)
    assert T.read_passkey_csv(k) == trials


def test_paired_nll_difference_by_hand():
    rows = [
        {"stage": "base", "context_len": 512, "nll": 2.0, "window_nlls": [1.0, 2.0, 3.0]},
        {"stage": "hyb", "context_len": 512, "nll": 2.5, "window_nlls": [1.2, 2.6, 3.7]},
    ]
    d = T.paired_nll_difference(rows, "hyb", "base", 512)
    # differences 0.2, 0.6, 0.7: mean 0.5, sample sd sqrt(0.07), stderr sqrt(0.07 / 3)
    assert d["diff"] == pytest.approx(0.5) and d["n_windows"] == 3
    assert d["stderr"] == pytest.approx(math.sqrt(0.07 / 3))
    assert T.paired_nll_difference(rows, "hyb", "base", 64) is None


def test_perplexity_window_nlls_average_to_the_nll(tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    texts = ["The quick brown fox jumps over the lazy dog. " * 40]
    rows = PPL.perplexity_vs_context(model, tok, texts, context_lens=[32, 64], tail=8, max_windows=4, stage="base")
    for r in rows:
        assert len(r["window_nlls"]) == 4
        assert sum(r["window_nlls"]) / 4 == pytest.approx(r["nll"], abs=1e-9)


def test_component_shares_with_and_without_the_sparse_cache(lively_dir, byte_tok):
    """Three parts for a sparse-cache layer (summing to 1, the cache's share > 0 beyond the first
    block); for a plain layer the window share is the two-part diagnostic's, and the cache's is 0."""
    from hybrid_llama.eval.components import window_shares
    from hybrid_llama.models import convert_to_hybrid
    from hybrid_llama.ops.hybrid.reference import window_share

    plain, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(plain, [0], window=8, formulation="lolcats", feature_map="hedgehog")
    sparse, _ = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(sparse, [0], window=8, formulation="lolcats", feature_map="hedgehog", sparse_cache=4, sinks=1)
    kw = dict(context_lens=[64], tail=8, max_windows=1)
    (p,) = window_shares(plain, tok, TEXTS, stage="transfer", **kw)
    (s,) = window_shares(sparse, tok, TEXTS, stage="transfer", **kw)
    assert p["cache_share"] == 0.0 and p["window_share"] + p["linear_share"] == pytest.approx(1.0)
    assert s["cache_share"] > 0 and s["window_share"] + s["cache_share"] + s["linear_share"] == pytest.approx(1.0)
    # the plain layer's window share is ops.reference.window_share on the layer's own q, k
    stream = torch.tensor(HO.token_stream(tok, TEXTS)[:64])[None]
    layer = plain.model.layers[0].self_attn
    with torch.no_grad():
        hidden = plain.model.embed_tokens(stream)
        pos = plain.model.rotary_emb(hidden, torch.arange(64)[None])
        q, k, _ = layer.project(plain.model.layers[0].input_layernorm(hidden), pos)
        want = window_share(q, k, layer.mixing.window_logit, layer.mixing.linear_logit, window=8,
                            formulation="lolcats", feature_map=layer.op_feature_map(),
                            query_positions=torch.arange(56, 64))
    assert p["window_share"] == pytest.approx(float(want.mean()), rel=1e-5)
