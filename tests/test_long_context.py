"""Long-context evaluation: the books corpus and its split, NLL windows inside one book scoring the same
targets at every length, the multi-key needle test's prompts and scoring, which slots run the long
lengths, and the throughput's long lengths."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from snakemake.utils import validate

from hybrid_llama import books as B
from hybrid_llama.config import SCHEMA_PATH, ConfigError
from hybrid_llama.eval import niah as N
from hybrid_llama.eval import perplexity as PPL
from hybrid_llama.eval import tables as T
from hybrid_llama.eval.heldout import token_stream_spans
from hybrid_llama.pipeline import Pipeline, shared_data_dir
from hybrid_llama.weights import byte_tokenizer

REPO = Path(__file__).resolve().parents[1]
BOOKS = shared_data_dir() / "gutenberg"
needs_books = pytest.mark.skipif(not BOOKS.is_dir(), reason=f"no books at {BOOKS}")


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


def config(name: str) -> dict:
    cfg = yaml.safe_load((REPO / "config" / name).read_text())
    validate(cfg, str(SCHEMA_PATH))
    return cfg


# ----------------------------------------------------------------------------- books


def test_gutenberg_boilerplate_is_cut():
    book = ("The Project Gutenberg eBook of Tiny Tale\r\n\r\nRelease date: 1 May 1900\r\n"
            "*** START OF THE PROJECT GUTENBERG EBOOK TINY TALE ***\r\n\r\n"
            "Chapter 1\r\nOnce there was a fox.\r\n\r\n"
            "*** END OF THE PROJECT GUTENBERG EBOOK TINY TALE ***\r\nSection 1. General Terms of Use\r\n")
    assert B.strip_gutenberg(book) == "Chapter 1\nOnce there was a fox."
    old = ("Title: X\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\nText.\n"
           "End of Project Gutenberg's X, by Y\nlicence")
    assert B.strip_gutenberg(old) == "Text."
    assert B.strip_gutenberg("\n\nJust a text, no markers.\n") == "Just a text, no markers."


def test_split_is_by_book_and_stable():
    names = ["pg5", "pg1", "pg3", "pg2"]
    split = B.split_books(names, ["pg3", "pg1"])
    assert split == {"heldout": ["pg1", "pg3"], "train": ["pg2", "pg5"]}
    assert B.split_books(list(reversed(names)), ["pg1", "pg3"]) == split  # order never matters
    with pytest.raises(ValueError, match="pg9"):
        B.split_books(names, ["pg9"])
    with pytest.raises(ValueError, match="no held-out book"):
        B.split_books(names, [])


@needs_books
@pytest.mark.parametrize("name", ["config.yaml", "paper.yaml", "test.yaml"])
def test_shipped_configs_hold_out_whole_books(name):
    heldout = config(name)["data"]["books"]["heldout"]
    split = B.split_books(B.book_names(BOOKS), heldout)
    assert set(split["heldout"]) == set(heldout) and not set(split["heldout"]) & set(split["train"])
    assert sorted(split["heldout"] + split["train"]) == B.book_names(BOOKS)
    held, train = B.heldout_books(BOOKS, heldout), B.training_books(BOOKS, heldout)
    # no paragraph of a held-out book appears in a training book: the split is by book, not position
    paragraphs = {p for text in held for p in text.split("\n\n") if len(p) > 200}
    assert paragraphs and not any(p in text for text in train for p in paragraphs)
    assert all("PROJECT GUTENBERG" not in text.upper()[:2000] for text in held)


# ----------------------------------------------------------------------------- NLL windows


def test_book_windows_stay_in_one_book_and_score_the_same_targets(byte_tok):
    texts = ["a" * 300, "b" * 1000, "c" * 90, "d" * 700]  # the third is shorter than the longest window
    ids, spans = token_stream_spans(byte_tok, texts)
    assert [b - a for a, b in spans] == [300, 1000, 90, 700] and ids[spans[1][0]] == ids[spans[1][0] + 5]
    windows = PPL.perplexity_windows(len(ids), [16, 64, 256], tail=32, max_windows=6, documents=spans)
    ends = [e for _, e in windows[256]]
    assert len(ends) == 6
    for L, spans_L in windows.items():
        assert [e for _, e in spans_L] == ends  # the same targets at every length
        for a, e in spans_L:
            assert e - a == L and any(s <= a and e <= t for s, t in spans)  # inside one document
    tails = {L: [tuple(ids[e - 8 : e]) for _, e in spans_L] for L, spans_L in windows.items()}
    assert tails[16] == tails[64] == tails[256]
    # without documents, the windows may cross a document's end (the fineweb curve's behaviour)
    flat = PPL.perplexity_windows(len(ids), [256], tail=32, max_windows=None)[256]
    assert any(not any(s <= a and e <= t for s, t in spans) for a, e in flat)
    # lengths above the longest document are dropped
    assert max(PPL.perplexity_windows(len(ids), [64, 2048], tail=32, max_windows=2, documents=spans)) == 64


def test_book_nll_is_scored_inside_each_book(tiny_model_dir, byte_tok):
    from hybrid_llama.models import load_model

    model, _ = load_model(tiny_model_dir, dtype=torch.float32)
    texts = ["The fox ran. " * 40, "A cat sat. " * 60]
    rows = PPL.perplexity_vs_context(model, byte_tok, texts, context_lens=[16, 128], tail=8, max_windows=3,
                                     stage="base", within_documents=True)
    assert [r["context_len"] for r in rows] == [16, 128] and all(len(r["window_nlls"]) == 3 for r in rows)
    # an independent reference: the same windows cut by hand from each book's own tokens
    ids, spans = token_stream_spans(byte_tok, texts)
    for r in rows:
        L = r["context_len"]
        for (a, e), nll in zip(PPL.perplexity_windows(len(ids), [16, 128], tail=8, max_windows=3, documents=spans)[L],
                               r["window_nlls"]):
            window = torch.tensor([ids[a:e]])
            logp = torch.log_softmax(model(window).logits[0, -9:-1].double(), -1)
            ref = -logp.gather(-1, window[0, -8:, None]).mean().item()
            assert nll == pytest.approx(ref, abs=1e-5)


# ----------------------------------------------------------------------------- multi-key needles


def _count(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    return sum(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


@pytest.mark.parametrize("haystack", ["filler", "book"])
def test_niah_prompt_holds_every_needle_once(byte_tok, haystack):
    book = byte_tok("It was a dark and stormy night; the rain fell in torrents. " * 80,
                    add_special_tokens=False)["input_ids"]
    trials = N.niah_trials(byte_tok, context_len=900, trials=4, n_keys=5, haystack=haystack, book_ids=book)
    assert [t["depth"] for t in trials] == pytest.approx([0.125, 0.375, 0.625, 0.875])
    for t in trials:
        assert len(t["prompt"]) == 900
        assert len({k for k, _ in t["needles"]}) == 5 and len({v for _, v in t["needles"]}) == 5
        for key, value in t["needles"]:
            piece = byte_tok(N.needle_text(key, value), add_special_tokens=False)["input_ids"]
            assert _count(t["prompt"], piece) == 1, (key, value)
        question = byte_tok(N.question_text(t["key"]), add_special_tokens=False)["input_ids"]
        assert t["prompt"][-len(question):] == question
        text = byte_tok.decode(t["prompt"], skip_special_tokens=True)
        assert text.count("special magic number for") == 5 + 2  # five needles, the question names it twice
        # each distance runs from that needle's end to the end of the prompt; needle_distance is the queried one's
        for (key, value), distance in zip(t["needles"], t["distances"], strict=True):
            piece = byte_tok(N.needle_text(key, value), add_special_tokens=False)["input_ids"]
            end = next(i + len(piece) for i in range(900) if t["prompt"][i : i + len(piece)] == piece)
            assert distance == 900 - end, key
        assert t["needle_distance"] == t["distances"][t["query"]]
    assert len({tuple(t["prompt"]) for t in trials}) == 4  # each trial its own keys and haystack
    if haystack == "book":
        text = byte_tok.decode(trials[0]["prompt"], skip_special_tokens=True)
        assert "stormy night" in text
        # each needle starts a sentence of its own (snapped to the next sentence start of the haystack)
        assert len(re.findall(r"\. The special magic number for \w+ is \d+\.", text)) == 5
    with pytest.raises(ValueError, match="cannot fit"):
        N.niah_trials(byte_tok, context_len=150, trials=1, n_keys=5, haystack=haystack, book_ids=book)


def test_niah_scores_only_the_queried_value():
    trial = {"needles": [("apple", "1234567"), ("tiger", "7654321")], "key": "apple", "value": "1234567"}
    assert N.score_answer(" 1234567.", trial) == (True, "apple")
    assert N.score_answer(" 7654321.", trial) == (False, "tiger")  # another needle's value scores 0
    assert N.score_answer(" 12345678", trial) == (False, "")  # a longer number is not the value
    assert N.score_answer(" I do not know.", trial) == (False, "")


class _Answering(torch.nn.Module):
    """A stand-in model whose greedy answer is the value of the needle ``pick`` chooses."""

    def __init__(self, tokenizer, pick):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"max_position_embeddings": 4096})()
        self.tokenizer, self.pick, self.prompts, self.prompt_ids = tokenizer, pick, [], []

    def generate(self, input_ids, max_new_tokens, **_):
        prompt = self.tokenizer.decode(input_ids[0].tolist(), skip_special_tokens=True)
        self.prompts.append(prompt)
        self.prompt_ids.append(input_ids[0].tolist())
        key = re.findall(r"What is the special magic number for (\w+)\?", prompt)[0]
        pairs = dict(re.findall(r"The special magic number for (\w+) is (\d+)\.", prompt))
        answer = self.tokenizer(" " + pairs[self.pick(key, pairs)] + ".", add_special_tokens=False)["input_ids"]
        return torch.cat([input_ids, torch.tensor([answer[:max_new_tokens]])], dim=1)


def test_niah_accuracy_counts_right_and_wrong_answers(byte_tok):
    right = N.niah_accuracy(_Answering(byte_tok, lambda key, pairs: key), byte_tok, context_lens=[400, 600],
                            trials=3, n_keys=3, stage="s")
    assert [(r["context_len"], r["trial"]) for r in right] == [(L, i) for L in (400, 600) for i in range(3)]
    assert all(r["accuracy"] == 1.0 and r["answered_key"] == r["key"] for r in right)
    assert all(r["answered_distance"] == r["needle_distance"] for r in right)
    # wrong: the needle nearest the question other than the one asked
    model = _Answering(byte_tok, lambda key, pairs: [k for k in pairs if k != key][-1])
    wrong = N.niah_accuracy(model, byte_tok, context_lens=[400], trials=3, n_keys=3, stage="s")
    assert all(r["accuracy"] == 0.0 and r["answered_key"] not in ("", r["key"]) for r in wrong)
    for r, ids, prompt in zip(wrong, model.prompt_ids, model.prompts, strict=True):
        # the answered needle's distance, found in the prompt the model was given
        value = dict(re.findall(r"The special magic number for (\w+) is (\d+)\.", prompt))[r["answered_key"]]
        piece = byte_tok(N.needle_text(r["answered_key"], value), add_special_tokens=False)["input_ids"]
        end = next(i + len(piece) for i in range(len(ids)) if ids[i : i + len(piece)] == piece)
        assert r["answered_distance"] == len(ids) - end
    summary = T.niah_summary(right + wrong, 400)
    assert (summary["found"], summary["trials"]) == (3, 6)
    nearer = sum(r["answered_distance"] < r["needle_distance"] for r in wrong)
    assert T.niah_misses(right + wrong, 400) == {"misses": 3, "other_needle": 3, "nearer": nearer}
    assert T.niah_misses(right, 400) is None  # nothing missed
    with pytest.raises(ValueError, match="book_texts"):
        N.niah_accuracy(_Answering(byte_tok, lambda k, p: k), byte_tok, context_lens=[400], haystacks=["book"],
                        stage="s")


def test_niah_prompt_at_the_models_positions_leaves_room_for_the_answer(byte_tok):
    model = _Answering(byte_tok, lambda key, pairs: key)
    with pytest.warns(UserWarning, match="skipping context 8192"):
        rows = N.niah_accuracy(model, byte_tok, context_lens=[4096, 8192], trials=1, n_keys=2, stage="s")
    # 4096 (the model's positions) is kept, its prompt shortened by the answer; 8192 is skipped
    assert [r["context_len"] for r in rows] == [4096]
    n_prompt = len(byte_tok(model.prompts[0], add_special_tokens=True)["input_ids"])
    answer = len(byte_tok(" 1234567.", add_special_tokens=False)["input_ids"]) + 3
    assert n_prompt == 4096 - answer


def test_niah_csv_round_trip(tmp_path):
    row = {"stage": "base", "haystack": "book", "context_len": 4096, "trial": 0, "n_keys": 4, "depth": 0.125,
           "key": "apple", "value": "1234567", "needle_distance": 3000, "answer": "1234567.",
           "answered_key": "apple", "answered_distance": 3000, "accuracy": 1.0, "n": 1}
    rows = [row, {**row, "trial": 1, "answer": "7654321.", "answered_key": "tiger", "answered_distance": 900,
                  "accuracy": 0.0},
            {**row, "trial": 2, "answer": "I do not", "answered_key": "", "answered_distance": None, "accuracy": 0.0}]
    path = T.QUALITY_WRITERS["niah"](rows, tmp_path / "niah.csv")
    assert T.QUALITY_READERS["niah"](path) == rows
    assert T.niah_summary(rows, 4096, haystack="filler") is None
    assert T.niah_summary(rows, 4096, haystack="book", beyond=128)["found"] == 1
    assert T.niah_misses(rows, 4096, haystack="book") == {"misses": 2, "other_needle": 1, "nearer": 1}
    # a file written before answered_distance was recorded: the misses are not told apart
    old = [{k: v for k, v in r.items() if k != "answered_distance"} for r in rows]
    assert T.niah_misses(old, 4096) is None


# ----------------------------------------------------------------------------- which slots run long lengths


def _pipeline(cfg: dict) -> Pipeline:
    validate(cfg, str(SCHEMA_PATH))
    return Pipeline(cfg, REPO)


def test_long_lengths_run_only_for_the_listed_slots():
    p = _pipeline(config("config.yaml"))
    rec = p.recommended()
    assert rec == "lolcats_retrieval"
    assert p.quality_settings("passkey", rec)["context_lens"] == [1024, 2048, 4096, 8192]
    assert p.quality_settings("passkey", "lolcats")["context_lens"] == []  # config/paper.yaml runs it
    assert p.quality_settings("books", "base")["context_lens"][-1] == 8192
    assert p.quality_settings("books", "seed")["context_lens"][-1] == 2048
    # the needle test runs at 4096 only: the recommended variant's table, base's trials beside it
    assert p.stage_quality_files("smollm2", "seed", "cpu", "niah") == []
    assert p.stage_quality_files("smollm2", rec, "cpu", "niah") == [
        "results/smollm2/base/quality/cpu/base/niah.csv", f"results/smollm2/{rec}/quality/cpu/transfer_lora/niah.csv"]
    books = p.stage_quality_files("smollm2", rec, "cpu", "books")
    assert books[0].endswith("/base/quality/cpu/base/books.csv") and len(books) == 2  # base, the variant
    inputs = p.report_inputs()["quality"]
    assert f"results/smollm2/{rec}/quality/cpu/niah.csv" in inputs
    assert "results/smollm2/seed/quality/cpu/niah.csv" not in inputs
    # the default's throughput times the recommended variant at 8192, its longest length
    assert max(p.config["throughput"]["seq_lens"]) == 8192 == max(p.quality_settings("books", rec)["context_lens"])


def test_passkey_runs_for_base_and_the_listed_variants_only():
    p = _pipeline(config("config.yaml"))
    rec = p.recommended()
    assert p.config["quality"]["passkey"]["variants"] == ["recommended"]
    tables = p.report_inputs()["quality"]
    files = p.stage_quality_files("smollm2", rec, "cpu", "passkey")
    assert files == ["results/smollm2/base/quality/cpu/base/passkey.csv",
                     f"results/smollm2/{rec}/quality/cpu/transfer_lora/passkey.csv"]
    assert f"results/smollm2/{rec}/quality/cpu/passkey.csv" in tables
    for variant in ("seed", "window_only", "lolcats"):  # no job, no table, and their exports do not wait for one
        assert p.stage_quality_files("smollm2", variant, "cpu", "passkey") == []
        assert p.quality_settings("passkey", variant)["context_lens"] == []
        assert f"results/smollm2/{variant}/quality/cpu/passkey.csv" not in tables
        assert f"results/smollm2/{variant}/quality/cpu/perplexity.csv" in tables
    assert p.export_inputs("smollm2", "seed")["results"] == ["results/smollm2/seed/quality/cpu/perplexity.csv"]
    assert p.quality_settings("passkey", "base")["context_lens"] == [1024, 2048]
    # null: every variant, as before the key
    cfg = json.loads(json.dumps(config("config.yaml")))
    cfg["quality"]["passkey"]["variants"] = None
    p = _pipeline(cfg)
    assert all(p.stage_quality_files("smollm2", v, "cpu", "passkey") for v in ("seed", "window_only", "lolcats", rec))
    # a job's params do not carry the list: adding a variant to it reruns no job that ran before
    assert p.quality_settings("passkey", rec) == _pipeline(config("config.yaml")).quality_settings("passkey", rec)
    assert "variants" not in p.quality_settings("passkey", "base")
    assert len(p.export_inputs("smollm2", "seed")["results"]) == 2


def test_default_runs_no_mmlu_job_of_its_own():
    p = _pipeline(config("config.yaml"))
    assert p.mmlu_files("smollm2") == [] and p.report_inputs()["mmlu"] == []
    assert not [f for f in p.report_inputs()["plots"] if "mmlu" in f]
    assert "mmlu" in p.config["zeroshot"]["tasks"]  # the suite's 5-shot MMLU stays
    paper = _pipeline(config("paper.yaml"))
    assert paper.mmlu_files("llama32_1b") and [f for f in paper.report_inputs()["plots"] if "mmlu" in f]


def test_paper_config_runs_every_length_for_every_slot():
    p = _pipeline(config("paper.yaml"))
    assert p.quality_settings("niah", "seed")["context_lens"][-1] == 32768
    assert p.quality_settings("passkey", "base")["context_lens"][-1] == 32768


@pytest.mark.parametrize(
    "mutate, key, needle",
    [
        (lambda c: c.update(recommended="nope"), "recommended", "not a variant"),
        (lambda c: c["quality"]["long_context"]["slots"].update(niah=["nope"]), "quality.long_context.slots.niah",
         "name no result slot"),
        (lambda c: c["throughput"]["long"].update(variants=["nope"]), "throughput.long.variants", "name no variant"),
        (lambda c: c["quality"]["passkey"].update(variants=["recommended", "nope"]), "quality.passkey.variants",
         "['nope'] name no variant"),
        (lambda c: c["data"]["books"].update(heldout=["pg0"]), "data.books.heldout", "no such book"),
        (lambda c: c["data"]["books"].update(local="no_such_dir"), "data.books.local", "not a directory"),
        # the Hub's books: names must be pg<ebook number> (whatever the source), and with the Hub possible
        # ('hf', or 'auto') the held-out books must be among them
        (lambda c: c["data"]["books"]["names"].append("moby_dick"), "data.books.names[8]",
         "'moby_dick' is not a Project Gutenberg book name"),
        (lambda c: c["data"]["books"].update(source="hf", heldout=["pg84"]), "data.books.heldout",
         "['pg84'] are not among the books taken from the Hub"),
        (lambda c: c["data"]["books"].update(source="auto", names=["pg11", "pg16"]), "data.books.heldout",
         "['pg5200'] are not among the books taken from the Hub"),
    ],
)
@needs_books
def test_long_context_config_errors_name_the_key(mutate, key, needle):
    cfg = json.loads(json.dumps(config("test.yaml")))
    mutate(cfg)
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        _pipeline(cfg).check()
    assert err.value.key == key


# ----------------------------------------------------------------------------- throughput to the longest length


def test_throughput_reaches_the_longest_length_for_base_and_the_listed_variant(tiny_model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybrid_llama.eval.throughput import measure_throughput

    cfg = LlamaConfig.from_pretrained(tiny_model_dir)
    variants = {name: (LlamaForCausalLM(cfg).eval(), None, "x") for name in ("base", "rec/hybrid", "other/hybrid")}
    df = measure_throughput(variants, seq_lens=[2, 4, 16, 32], decode_tokens=2, repeats=3, warmup=1,
                            prefill_min_s=0, long_from=16, long_repeats=2, long_variants={"rec/hybrid"})
    ok = df[df["status"] == "ok"]
    for name in ("base", "rec/hybrid"):
        assert sorted(set(ok[ok["variant"] == name]["seq_len"])) == [2, 4, 16, 32]
    other = df[df["variant"] == "other/hybrid"]
    assert set(other[other["status"] == "ok"]["seq_len"]) == {2, 4}
    assert set(other[other["status"] == "skipped"]["seq_len"]) == {16, 32}
    assert (ok[ok["seq_len"] >= 16]["repeats"] == 2).all() and (ok[ok["seq_len"] < 16]["repeats"] == 3).all()
    long = ok[(ok["variant"] == "rec/hybrid") & (ok["seq_len"] == 32)]
    assert long["speedup"].notna().all() and (long["speedup_min"] <= long["speedup_max"]).all()


def test_short_only_book_slots_score_the_long_slots_targets(byte_tok, tiny_model):
    """A slot that runs the short lengths only (every variant but the recommended one) places its
    windows where the longest configured length does, so its NLL pairs with base's window by window."""
    texts = ["a" * 300, "b" * 1000, "c" * 90, "d" * 700]
    ids, spans = token_stream_spans(byte_tok, texts)
    long_run = PPL.perplexity_windows(len(ids), [16, 64, 512], tail=32, max_windows=3, documents=spans)
    short = PPL.perplexity_windows(len(ids), [16, 64], tail=32, max_windows=3, documents=spans, anchor_len=512)
    unanchored = PPL.perplexity_windows(len(ids), [16, 64], tail=32, max_windows=3, documents=spans)
    assert short == {L: long_run[L] for L in (16, 64)}
    assert unanchored[64] != long_run[64]  # what the report paired before: other targets
    # capped like any length: an anchor beyond the longest document places windows as that length would
    assert PPL.perplexity_windows(len(ids), [64], tail=32, max_windows=3, documents=spans,
                                  anchor_len=10**6)[64] == PPL.perplexity_windows(
        len(ids), [64], tail=32, max_windows=3, documents=spans, anchor_len=1000)[64]
    model, _ = tiny_model
    rows = PPL.perplexity_vs_context(model, byte_tok, texts, context_lens=[16, 64], tail=8, max_windows=3,
                                     stage="base", within_documents=True, anchor_len=512)
    full = PPL.perplexity_vs_context(model, byte_tok, texts, context_lens=[16, 64, 512], tail=8, max_windows=3,
                                     stage="base", within_documents=True)
    assert [r["window_nlls"] for r in rows] == [r["window_nlls"] for r in full[:2]]


def test_every_book_slot_gets_the_longest_length_as_anchor():
    p = _pipeline(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    rec = p.config["recommended"]
    anchors = {p.quality_settings("books", v)["anchor_len"] for v in ("base", "lolcats", rec)}
    assert anchors == {max(p.config["quality"]["long_context"]["books"]["context_lens"])}
    assert max(p.quality_settings("books", "lolcats")["context_lens"]) < anchors.pop()
