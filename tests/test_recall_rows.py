"""Recall rows (lora.recall_rows): their contents against the books and the facts they state, the
weighted distillation loss against the KL written out, and how the workflow wires them in."""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
from pathlib import Path

import pytest
import torch
import yaml
from snakemake.utils import validate
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_llama.config import SCHEMA_PATH, ConfigError
from hybrid_llama.data import read_manifest
from hybrid_llama.eval import niah, passkey
from hybrid_llama.names import RECALL_KEYS, RecallShape
from hybrid_llama.pipeline import Pipeline
from hybrid_llama.pipeline.long_context import trains_on_books
from hybrid_llama.recall_rows import (
    ATTRIBUTES,
    NAMES,
    WORD_ATTRIBUTES,
    WORDS,
    answer_positions,
    fact_text,
    load_recall_rows,
    prepare_recall_rows,
    question_text,
    recall_row,
)
from hybrid_llama.train.settings import LoraSettings
from hybrid_llama.weights import BYTE_OFFSET, byte_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _text(ids) -> str:
    return bytes(int(t) - BYTE_OFFSET for t in ids).decode("utf-8")


def _book(n: int) -> str:
    return " ".join(f"Sentence {i} of the book goes here." for i in range(n))


def test_a_recall_row_states_each_fact_in_the_book_and_asks_for_it_at_the_end():
    tok = byte_tokenizer()
    book = tok(_book(400), add_special_tokens=False)["input_ids"]
    ids, answer, facts = recall_row(tok, book, 1024, 3, random.Random(5))
    assert len(ids) == len(answer) == 1024 and len(facts) == 3
    text = _text(ids)
    body = text[: text.index("\n Question")]
    body_end = min(f["answer_at"] for f in facts)
    for f in facts:
        stated = fact_text(f["name"], f["attribute"], f["value"])
        assert _text(ids[f["fact_at"]: f["fact_at"] + len(stated)]) == stated  # byte tokens: one per character
        assert f["fact_at"] < len(body) < body_end and body.count(stated) == 1
        # the value follows its own question, and its tokens are the ones flagged
        asked = question_text(f["name"], f["attribute"])
        assert _text(ids[f["answer_at"] - len(asked): f["answer_at"]]) == asked
        span = range(f["answer_at"], f["answer_at"] + len(f["value"]) + 1)
        assert _text(ids[span.start: span.stop]) == " " + f["value"] and all(answer[t] for t in span)
    assert sum(answer) == sum(len(f["value"]) + 1 for f in facts)
    # without the facts, the body is one run of the book; the facts sit at sentence starts
    for f in facts:
        body = body.replace(fact_text(f["name"], f["attribute"], f["value"]), "")
        assert text[f["fact_at"] - 1] == "."
    assert body in _text(book)


def test_a_row_that_asks_in_its_middle_asks_each_block_for_the_facts_set_since_the_block_before():
    tok = byte_tokenizer()
    book = tok(_book(600), add_special_tokens=False)["input_ids"]
    for seed in range(6):
        ids, answer, facts = recall_row(tok, book, 2048, 6, random.Random(seed), asks=3)
        assert len(ids) == len(answer) == 2048
        text = _text(ids)
        end = text.index("\n Question", max(f["fact_at"] for f in facts))  # the end's block follows every fact
        # the middle blocks, read off the text: where each starts and ends, and whom it asks about
        blocks = [(m.start(), m.end()) for m in re.finditer(r"\n( Question: [^?]*\? Answer: [^.]*\.)+\n", text[:end])]
        assert 1 <= len(blocks) <= 2
        previous = 0
        for a, b in blocks:
            asked = {f["name"] for f in facts if a <= f.get("mid_answer_at", -1) < b}
            stated = {f["name"] for f in facts if previous <= f["fact_at"] < a}
            assert asked == stated and asked  # each block asks for exactly the facts set since the last one
            previous = b
        for f in facts:
            asked = question_text(f["name"], f["attribute"])
            for at in (f["answer_at"], f.get("mid_answer_at")):
                if at is not None:  # the value follows its question, after the fact
                    assert _text(ids[at - len(asked): at + len(f["value"]) + 1]) == asked + " " + f["value"]
                    assert f["fact_at"] < at and all(answer[at: at + len(f["value"]) + 1])
            assert f["answer_at"] > end
        mid = [f for f in facts if "mid_answer_at" in f]
        assert sum(answer) == sum(len(f["value"]) + 1 for f in facts + mid)
        # without the facts and the middle blocks, the body is one run of the book
        body = text[:end]
        for a, b in reversed(blocks):
            body = body[:a] + body[b:]
        for f in facts:
            body = body.replace(fact_text(f["name"], f["attribute"], f["value"]), "")
        assert body in _text(book)
    with pytest.raises(ValueError, match="asks at least once"):
        recall_row(tok, book, 2048, 6, random.Random(0), asks=0)


def test_rows_that_ask_once_are_the_rows_made_before_recall_asks_existed():
    """The hash of this row from 5553aa0, before the key: a file of rows asked once keeps its
    contents, so the stages trained on it stay valid."""
    tok = byte_tokenizer()
    ids, answer, facts = recall_row(tok, tok(_book(400), add_special_tokens=False)["input_ids"], 1024, 3,
                                    random.Random(5))
    assert hashlib.sha256(repr((ids, answer, facts)).encode()).hexdigest() == (
        "45109f1b6935db18a9b423112217e88931ed3a2db9b040aaa5d4e711da457435")
    for name, shape in (("8", RecallShape(8)), ("8Q2", RecallShape(8, 2)), ("12S", RecallShape(12, 1, True)),
                        ("8Q3S", RecallShape(8, 3, True)), ("8Q2SW", RecallShape(8, 2, True, "words")),
                        ("4W", RecallShape(4, subjects="words"))):
        assert shape.name == name and RecallShape.parse(name) == shape
    assert RecallShape.of({"recall_facts": 8}) == RecallShape(8, 1, False)  # the later keys at their defaults
    for bad in ("8Q", "8WS"):
        with pytest.raises(ValueError, match="not a recall-rows shape"):
            RecallShape.parse(bad)


def test_facts_of_one_attribute_differ_by_their_names_only():
    tok = byte_tokenizer()
    book = tok(_book(600), add_special_tokens=False)["input_ids"]
    shared = set()
    for seed in range(4):
        ids, answer, facts = recall_row(tok, book, 2048, 8, random.Random(seed), same_attribute=True)
        assert len({f["attribute"] for f in facts}) == 1 and len({f["name"] for f in facts}) == 8
        shared |= {f["attribute"] for f in facts}
        text = _text(ids)
        body = text[: text.index("\n Question")]
        for f in facts:  # each fact stated once, asked for by its name, answered with its own value
            assert body.count(fact_text(f["name"], f["attribute"], f["value"])) == 1
            asked = question_text(f["name"], f["attribute"])
            assert _text(ids[f["answer_at"] - len(asked): f["answer_at"] + len(f["value"]) + 1]) == (
                asked + " " + f["value"])
    assert len(shared) > 1  # the attribute is drawn per row
    # drawn on its own, each fact's attribute (8 attributes, 8 facts: some repeat, most differ)
    _, _, facts = recall_row(tok, book, 2048, 8, random.Random(0))
    assert len({f["attribute"] for f in facts}) > 1


def test_facts_about_things_differ_by_one_common_word_and_are_drawn_as_facts_about_people():
    tok = byte_tokenizer()
    book = tok(_book(600), add_special_tokens=False)["input_ids"]
    for seed in range(3):
        ids, _, facts = recall_row(tok, book, 2048, 8, random.Random(seed), asks=2, same_attribute=True,
                                   subjects="words")
        text = _text(ids)
        assert {f["name"] for f in facts} <= set(WORDS) and len({f["name"] for f in facts}) == 8
        assert len({f["attribute"] for f in facts}) == 1 and facts[0]["attribute"] in WORD_ATTRIBUTES
        for f in facts:  # "The cedar box's serial number is 40713.", asked for by the word alone
            stated = f" The {f['name']} box's {f['attribute']} is {f['value']}."
            asked = f" Question: what is the {f['name']} box's {f['attribute']}? Answer: The {f['name']} box's "
            assert text.index(stated) == f["fact_at"] and text[: text.index(asked)].count(stated) == 1
            for at in (f["answer_at"], f.get("mid_answer_at", f["answer_at"])):
                assert text[:at].endswith(asked + f["attribute"] + " is") and text[at:].startswith(" " + f["value"])
        # the same draws as a row about people: values, depths and the order asked stay, the wording changes
        people_ids, _, people = recall_row(tok, book, 2048, 8, random.Random(seed), asks=2, same_attribute=True)
        assert [f["value"] for f in people] == [f["value"] for f in facts]
        assert [f["name"] for f in people] != [f["name"] for f in facts] and people_ids != ids
    with pytest.raises(ValueError, match="subjects='places'"):
        recall_row(tok, book, 2048, 8, random.Random(0), subjects="places")


def test_recall_rows_use_none_of_the_evaluations_wording():
    for kind, key in (("names", "Mara"), ("words", "cedar")):
        words = " ".join([fact_text(key, "locker number", "1", kind), question_text(key, "locker number", kind)])
        for phrase in ("pass key", "magic number", passkey.PASSKEY_QUESTION.strip().lower()):
            assert phrase not in words.lower()
    assert not {w.lower() for w in NAMES + ATTRIBUTES + WORDS + WORD_ATTRIBUTES} & set(niah.KEY_WORDS)


def test_answer_positions_are_the_positions_that_predict_an_answer_token():
    answers = torch.tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.bool)
    assert answer_positions(answers).tolist() == [[False, True, True, False, True, False]]


def _write_books(directory: Path, names: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        text = " ".join(f"{name} line {i}." for i in range(600))
        (directory / f"{name}.txt").write_text(f"*** START OF THE PROJECT GUTENBERG EBOOK X ***\n{text}\n"
                                               "*** END OF THE PROJECT GUTENBERG EBOOK X ***\n")


def test_prepare_recall_rows_reads_the_training_books_only(tmp_path):
    _write_books(tmp_path / "books", ["pg1", "pg2", "pg3"])
    source = {"dir": str(tmp_path / "books"), "heldout": ["pg3"]}
    out = tmp_path / "recall.safetensors"
    manifest = prepare_recall_rows(source, byte_tokenizer(), out, seq_len=512, rows=5, facts=2, seed=3)
    tokens, answers = load_recall_rows(out)
    assert tokens.shape == answers.shape == (5, 512)
    assert manifest == read_manifest(out) and manifest["answer_tokens"] == int(answers.sum())
    assert [r["book"] for r in manifest["rows"]] == ["pg1", "pg2", "pg1", "pg2", "pg1"]
    for row, record in zip(tokens, manifest["rows"]):
        text = _text(row)
        assert record["book"] + " line" in text and "pg3" not in text
        assert all(f["value"] in text for f in record["facts"])
    again = prepare_recall_rows(source, byte_tokenizer(), tmp_path / "again.safetensors", seq_len=512, rows=5,
                                facts=2, seed=3)
    assert again["rows"] == manifest["rows"] and torch.equal(load_recall_rows(tmp_path / "again.safetensors")[0],
                                                              tokens)
    with pytest.raises(ValueError, match="facts and their questions take"):
        prepare_recall_rows(source, byte_tokenizer(), tmp_path / "short.safetensors", seq_len=128, rows=1, facts=3)


# ----------------------------------------------------------------------- the weighted distillation


@pytest.fixture(scope="module")
def recall_file(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("recall")
    _write_books(d / "books", ["pg1", "pg2"])
    out = d / "recall.safetensors"
    prepare_recall_rows({"dir": str(d / "books"), "heldout": ["pg2"]}, tiny_model_dir, out, seq_len=256, rows=3,
                        facts=1)
    return out


def _corpus(tmp_path: Path, model_dir: Path, rows: int) -> Path:
    from hybrid_llama.data import prepare_transfer_corpus

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join('{"text": "%s"}\n' % (f"text number {i} " * 30) for i in range(12)))
    prepare_transfer_corpus({"kind": "local", "path": str(docs)}, model_dir, tmp_path / "corpus.safetensors",
                            seq_len=64, num_tokens=64 * rows)
    return tmp_path / "corpus.safetensors"


def _teacher_and_student(model_dir, layer: int, seed: int):
    """The tiny base model twice: the teacher, and a student whose decoder layer ``layer`` is perturbed."""
    from hybrid_llama.stages import load_base

    teacher, _ = load_base(model_dir, dtype=torch.float32)
    student, _ = load_base(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a student that differs from its teacher
        for p in student.model.layers[layer].parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return teacher, student


def test_the_distillation_weighs_answer_positions_as_the_kl_written_out(tiny_model_dir, recall_file, tmp_path):
    from hybrid_llama.train.lora_objectives import DistillObjective

    corpus = _corpus(tmp_path, tiny_model_dir, rows=6)
    teacher, student = _teacher_and_student(tiny_model_dir, layer=0, seed=0)
    obj = DistillObjective(student, corpus, teacher, eval_sequences=2, teacher_states=None, batch_size=1,
                           device=torch.device("cpu"), amp=False, recall_rows=recall_file, answer_weight=7.0)
    n = len(obj.rows["train"])
    assert obj.split_rows("train") == n + 3 and obj.split_rows("val") == 2
    tokens, answers = load_recall_rows(recall_file)
    with torch.no_grad():
        p = torch.softmax(teacher(input_ids=tokens[1:2]).logits.double(), -1)[0]
        q = torch.softmax(student(input_ids=tokens[1:2]).logits.double(), -1)[0]
        per_position = (p * (p.log() - q.log())).sum(-1)
        w = torch.where(answers[1, 1:], 7.0, 1.0).double()
        w = torch.cat([w, torch.ones(1, dtype=torch.float64)])  # the last position predicts no answer
        total, count = obj.loss_sum(obj.batch("train", [n + 1]))
    assert count == pytest.approx(float(w.sum())) and count > 256
    assert float(total) > 1 and float(total) == pytest.approx(float((w * per_position).sum()), rel=1e-4)
    # a corpus row keeps the plain KL sum over its positions
    total, count = obj.loss_sum(obj.batch("train", [0]))
    assert count == 64 and "weights" not in obj.batch("train", [0])


def test_answer_target_token_trains_answer_positions_toward_their_own_token(tiny_model_dir, recall_file, tmp_path):
    from hybrid_llama.train.lora_objectives import DistillObjective

    corpus = _corpus(tmp_path, tiny_model_dir, rows=6)
    teacher, student = _teacher_and_student(tiny_model_dir, layer=0, seed=1)
    obj = DistillObjective(student, corpus, teacher, eval_sequences=2, teacher_states=None, batch_size=1,
                           device=torch.device("cpu"), amp=False, recall_rows=recall_file, answer_weight=3.0,
                           answer_target="token")
    n = len(obj.rows["train"])
    tokens, answers = load_recall_rows(recall_file)
    row = tokens[2:3]
    with torch.no_grad():
        p = torch.softmax(teacher(input_ids=row).logits.double(), -1)[0]
        logq = torch.log_softmax(student(input_ids=row).logits.double(), -1)[0]
        kl = (p * (p.log() - logq)).sum(-1)
        nll = -logq[:-1].gather(-1, row[0, 1:, None]).squeeze(-1)  # position t predicts token t + 1
        predicts = torch.cat([answers[2, 1:], torch.zeros(1, dtype=torch.bool)])
        assert int(predicts.sum()) > 0
        expected = torch.where(predicts, torch.cat([nll, nll.new_zeros(1)]), kl)
        w = torch.where(predicts, 3.0, 1.0).double()
        total, count = obj.loss_sum(obj.batch("train", [n + 2]))
    assert count == pytest.approx(float(w.sum()))
    assert float(total) == pytest.approx(float((w * expected).sum()), rel=1e-4)
    # the answer's own token differs from the teacher's distribution: the two targets give other losses
    teacher_obj = DistillObjective(student, corpus, teacher, eval_sequences=2, teacher_states=None, batch_size=1,
                                   device=torch.device("cpu"), amp=False, recall_rows=recall_file, answer_weight=3.0)
    with torch.no_grad():
        assert float(teacher_obj.loss_sum(teacher_obj.batch("train", [n + 2]))[0]) != pytest.approx(float(total))
        # corpus rows are untouched
        assert "hard" not in obj.batch("train", [0])
    with pytest.raises(ValueError, match="answer_target"):
        DistillObjective(student, corpus, teacher, eval_sequences=2, teacher_states=None, batch_size=1,
                         device=torch.device("cpu"), amp=False, recall_rows=recall_file, answer_target="gold")


def test_distillation_with_recall_rows_trains_them_with_the_teacher_run_for_them(
        tiny_model_dir, recall_file, tmp_path):
    import hybrid_llama.train.finetune as ft
    import hybrid_llama.train.transfer as tr

    corpus = _corpus(tmp_path, tiny_model_dir, rows=8)
    hybrid = {"layers": [1, 3], "window": 4, "formulation": "lolcats", "feature_map": "hedgehog"}
    tr.run_transfer(tiny_model_dir, corpus, hybrid, {"progress": False, "autocast": False, "trainable":
                    "logits+feature_map", "epochs": 1, "batch_size": 2, "eval_sequences": 2, "teacher_states": True,
                    "checkpoint_every": 0}, tmp_path / "t")
    cfg = {"progress": False, "autocast": False, "objective": "distill", "batch_size": 1, "epochs": 1,
           "eval_sequences": 2, "checkpoint_every": 0, "recall_rows": 3, "recall_facts": 1, "answer_weight": 4.0}
    m = ft.run_finetune(tiny_model_dir, corpus, cfg, tmp_path / "lora", hybrid=hybrid,
                        hybrid_layers=tmp_path / "t" / "hybrid_layers.safetensors", recall_rows=recall_file,
                        teacher_states=tmp_path / "t" / "teacher_states.safetensors")
    assert m["num_train"] == 6 + 3 and m["num_recall_rows"] == 3 and m["steps"] == 9
    # the saved states serve the corpus rows; the recall rows run the teacher, and the validation rows
    # (2, one a batch) once for both validations
    assert m["teacher_forwards"] == 3 + 2
    assert m["lora"]["answer_weight"] == 4.0
    for bad, match in (({**cfg, "recall_rows": 2}, "holds 3 rows of 1 facts"),
                       ({**cfg, "recall_seq_len": 512}, "and 512 tokens"),
                       ({**cfg, "recall_asks": 2}, r"shape 1\) .*shape 1Q2\)"),
                       ({**cfg, "recall_same_attribute": True}, r"shape 1\) .*shape 1S\)"),
                       ({**cfg, "recall_subjects": "words"}, r"shape 1\) .*shape 1W\)"),
                       ({**cfg, "recall_rows": 0}, "lora.recall_rows is 0")):
        with pytest.raises(ValueError, match=match):
            ft.run_finetune(tiny_model_dir, corpus, bad, tmp_path / "x", hybrid=hybrid, recall_rows=recall_file)
    with pytest.raises(ValueError, match="give the recall-rows file"):
        ft.run_finetune(tiny_model_dir, corpus, cfg, tmp_path / "x", hybrid=hybrid)


# ----------------------------------------------------------------------------------- the workflow


def _config(lora: dict, base_lora: dict | None = None) -> dict:
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    next(v for v in cfg["variants"] if v["name"] == "lolcats")["lora"].update(lora)
    if base_lora is not None:  # the default runs no base_lora stage: run it, so its section is checked
        cfg["base_lora"] = {**cfg.get("base_lora", {}), **base_lora}
        cfg["stages"] = [*cfg["stages"], "base_lora"]
    validate(cfg, str(SCHEMA_PATH))
    return cfg


RECALL = "resources/data/recall_rows/smollm2/L{}_R{}_F{}"


def test_the_default_cache_active_distillation_trains_recall_rows_and_the_recommended_variant_keeps_them():
    p = Pipeline(_config({}), REPO)
    p.check()
    rows = RECALL.format(8192, 4, "8Q2S")  # 8 facts on one attribute, asked in the middle and at the end
    assert p.lora_inputs("smollm2", "lolcats_sparse_distill")["recall"] == rows + ".safetensors"
    settings = LoraSettings.from_dict(p.lora_train("lolcats_sparse_distill"))
    assert settings.recall_asks == 2 and settings.recall_same_attribute
    assert p.lora_owner("lolcats_retrieval") == "lolcats_sparse_distill"  # its adapter, trained with them
    assert LoraSettings.from_dict(p.lora_train("lolcats_sparse_distill")).as_dict()["answer_weight"] == 20
    assert [f for f in p.report_inputs()["manifests"] if "recall_rows" in f] == [rows + ".json"]
    assert "lolcats_sparse_distill" in trains_on_books(p)
    # the stages without recall rows are run without the keys: their params, and so their jobs, stay
    for v in ("seed", "lolcats", "base_lora"):
        assert not set(RECALL_KEYS) & set(p.lora_train(v))
        assert v == "base_lora" or "recall" not in p.lora_inputs("smollm2", v)


def test_a_variant_with_recall_rows_hands_them_to_the_variants_derived_from_it():
    p = Pipeline(_config({"recall_rows": 8, "recall_facts": 6, "recall_seq_len": 4096, "answer_weight": 2}), REPO)
    p.check()
    assert p.lora_inputs("smollm2", "lolcats")["recall"] == RECALL.format(4096, 8, 6) + ".safetensors"
    assert p.lora_data("smollm2", "lolcats") == "resources/data/transfer/smollm2/L2048_N65536.safetensors"
    # a derived variant inherits lolcats' lora, its own keys over it
    assert p.lora_train("lolcats_sparse_distill")["answer_weight"] == 20
    assert LoraSettings.from_dict(p.lora_train("lolcats")).as_dict()["answer_weight"] == 2
    assert {RECALL.format(4096, 8, 6) + ".json", RECALL.format(8192, 4, "8Q2S") + ".json"} <= set(
        p.report_inputs()["manifests"])
    assert "recall" not in p.lora_inputs("smollm2", "seed")


def test_rows_asked_in_one_place_or_several_train_on_files_of_their_own():
    p = Pipeline(_config({"recall_rows": 4, "recall_facts": 8, "recall_asks": 3, "recall_seq_len": 8192,
                          "batch_size": 1}), REPO)
    p.check()
    assert p.lora_inputs("smollm2", "lolcats")["recall"] == RECALL.format(8192, 4, "8Q3") + ".safetensors"
    assert LoraSettings.from_dict(p.lora_train("lolcats")).recall_asks == 3
    # derived from lolcats, lolcats_sparse_distill keeps its own recall_asks
    assert p.lora_inputs("smollm2", "lolcats_sparse_distill")["recall"] == RECALL.format(8192, 4, "8Q2S") + (
        ".safetensors")
    # rows asked at their end only, of their own attributes, keep the file name, and the stage's
    # params, of before both keys
    cfg = _config({})
    lora = next(v for v in cfg["variants"] if v["name"] == "lolcats_sparse_distill")["lora"]
    lora["recall_asks"] = 1
    del lora["recall_same_attribute"]
    once = Pipeline(cfg, REPO)
    once.check()
    assert once.lora_inputs("smollm2", "lolcats_sparse_distill")["recall"] == RECALL.format(8192, 4, 8) + (
        ".safetensors")
    assert not {"recall_asks", "recall_same_attribute"} & set(once.lora_train("lolcats_sparse_distill"))
    assert LoraSettings.from_dict(once.lora_train("lolcats_sparse_distill")).recall_asks == 1


def test_one_attribute_a_row_is_a_file_of_its_own():
    same = Pipeline(_config({}), REPO)  # the default: one attribute a row
    cfg = _config({})
    next(v for v in cfg["variants"] if v["name"] == "lolcats_sparse_distill")["lora"]["recall_same_attribute"] = False
    own = Pipeline(cfg, REPO)
    own.check()
    assert same.lora_inputs("smollm2", "lolcats_sparse_distill")["recall"] == RECALL.format(8192, 4, "8Q2S") + (
        ".safetensors")
    assert own.lora_inputs("smollm2", "lolcats_sparse_distill")["recall"] == RECALL.format(8192, 4, "8Q2") + (
        ".safetensors")
    assert LoraSettings.from_dict(same.lora_train("lolcats_sparse_distill")).recall_same_attribute
    # at its default (False) the key stays out of the params: the rows and the stage of before it keep theirs
    assert "recall_same_attribute" not in own.lora_train("lolcats_sparse_distill")
    assert not LoraSettings.from_dict(own.lora_train("lolcats_sparse_distill")).recall_same_attribute


def test_facts_about_things_are_a_file_of_their_own():
    cfg = _config({})
    next(v for v in cfg["variants"] if v["name"] == "lolcats_sparse_distill")["lora"]["recall_subjects"] = "words"
    words = Pipeline(cfg, REPO)
    words.check()
    assert words.lora_inputs("smollm2", "lolcats_sparse_distill")["recall"] == RECALL.format(8192, 4, "8Q2SW") + (
        ".safetensors")
    assert LoraSettings.from_dict(words.lora_train("lolcats_sparse_distill")).recall_subjects == "words"
    # at its default ("names") the key stays out of the params, so the default's rows and stages keep theirs
    assert "recall_subjects" not in Pipeline(_config({}), REPO).lora_train("lolcats_sparse_distill")
    cfg["variants"][-1].setdefault("lora", {})["recall_subjects"] = "places"
    with pytest.raises(Exception, match="places"):
        validate(cfg, str(SCHEMA_PATH))


def test_recall_asks_writes_its_questions_into_the_file_and_its_manifest(tmp_path):
    _write_books(tmp_path / "books", ["pg1", "pg2"])
    source = {"dir": str(tmp_path / "books"), "heldout": ["pg2"]}
    once = prepare_recall_rows(source, byte_tokenizer(), tmp_path / "a.safetensors", seq_len=1024, rows=3, facts=4)
    twice = prepare_recall_rows(source, byte_tokenizer(), tmp_path / "b.safetensors", seq_len=1024, rows=3, facts=4,
                                asks=2)
    assert (once["asks_per_row"], twice["asks_per_row"]) == (1, 2) and not once["same_attribute"]
    assert once["subjects"] == "names"
    mid = sum("mid_answer_at" in f for r in twice["rows"] for f in r["facts"])
    assert mid > 0 and not any("mid_answer_at" in f for r in once["rows"] for f in r["facts"])
    assert twice["answer_tokens"] == int(load_recall_rows(tmp_path / "b.safetensors")[1].sum()) > once["answer_tokens"]


@pytest.mark.parametrize("lora, base_lora, key, match", [
    ({"recall_rows": 4, "objective": "instruct"}, None, "variants[lolcats].lora.recall_rows", "objective 'instruct'"),
    ({"recall_rows": 4, "recall_seq_len": 4096, "batch_size": 2}, None, "variants[lolcats].lora.recall_seq_len",
     "set lora.batch_size 1"),
    ({}, {"recall_rows": 4}, "base_lora.recall_rows", "instruction data"),
    ({"recall_rows": 4, "recall_seq_len": 16384, "batch_size": 1}, None, "variants[lolcats].lora.recall_seq_len",
     r"longer than model 'smollm2' has positions \(8192\)"),
])
def test_recall_rows_where_they_cannot_train_fail_naming_the_key(lora, base_lora, key, match):
    with pytest.raises(ConfigError, match=match) as err:
        Pipeline(_config(lora, base_lora), REPO).check()
    assert err.value.key == key


class _AtenCalls(TorchDispatchMode):
    """The names of the aten ops run inside the block."""

    def __enter__(self):
        self.names: list[str] = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("answer_target", ["teacher", "token"])
def test_the_kl_in_chunks_gives_the_loss_and_gradients_of_the_kl_in_one_piece(tiny_model_dir, recall_file, tmp_path,
                                                                              monkeypatch, answer_target):
    """Long rows are scored a chunk of positions at a time (recomputed in the backward); the loss and
    every gradient equal the one-piece computation, weighted or not, with the answers' targets either way."""
    import hybrid_llama.train.lora_objectives as lo

    corpus = _corpus(tmp_path, tiny_model_dir, rows=6)
    teacher, student = _teacher_and_student(tiny_model_dir, layer=1, seed=1)
    obj = lo.DistillObjective(student, corpus, teacher, eval_sequences=2, teacher_states=None, batch_size=1,
                              device=torch.device("cpu"), amp=False, recall_rows=recall_file, answer_weight=5.0,
                              answer_target=answer_target)
    n = len(obj.rows["train"])

    def loss_and_grads(rows):
        student.zero_grad()
        total, count = obj.loss_sum(obj.batch("train", rows))
        (total / count).backward()
        return float(total.detach()), {k: p.grad.clone() for k, p in student.named_parameters() if p.grad is not None}

    for rows in ([0], [n + 2]):  # a corpus row of 64 tokens, a recall row of 256
        monkeypatch.setattr(lo, "KL_CHUNK", 4096)
        whole, whole_grads = loss_and_grads(rows)
        monkeypatch.setattr(lo, "KL_CHUNK", 48)  # chunks that end in the middle of an answer, and a short last one
        chunked, grads = loss_and_grads(rows)
        assert chunked == pytest.approx(whole, rel=1e-5) and whole > 0.1
        assert grads.keys() == whole_grads.keys() and len(grads) > 10
        for k in grads:
            torch.testing.assert_close(grads[k], whole_grads[k], rtol=1e-4, atol=1e-7, msg=k)


def test_a_long_row_recomputes_its_layers_and_trains_the_same(tiny_model_dir, recall_file, tmp_path, monkeypatch):
    """Rows longer than a KL chunk run their decoder layers under activation checkpointing (switched
    off again after the forward); the loss and the LoRA gradients are those without it."""
    import hybrid_llama.train.lora_objectives as lo
    from hybrid_llama.stages import as_hybrid_config, load_base
    from hybrid_llama.train.finetune import _lora_model
    from hybrid_llama.train.settings import LoraSettings

    hybrid = {"layers": [1, 3], "window": 4, "formulation": "lolcats", "feature_map": "hedgehog"}

    adapter = LoraSettings.from_dict({"objective": "distill", "dropout": 0.0}).adapter  # no random masks
    student, _, _ = _lora_model(tiny_model_dir, adapter, as_hybrid_config(hybrid), None, None, torch.device("cpu"))
    teacher, _ = load_base(tiny_model_dir, dtype=torch.float32)
    obj = lo.DistillObjective(student, _corpus(tmp_path, tiny_model_dir, rows=6), teacher, eval_sequences=2,
                              teacher_states=None, batch_size=1, device=torch.device("cpu"), amp=False,
                              recall_rows=recall_file, answer_weight=5.0)
    batch = obj.batch("train", [len(obj.rows["train"])])  # a recall row of 256 tokens
    seen = []
    causal_lm = lo._causal_lm(student)
    layer = causal_lm.model.layers[0]
    layer.register_forward_hook(lambda m, a, o: seen.append(bool(getattr(m, "gradient_checkpointing", False))))

    def loss_and_grads(backward_calls=None):
        student.zero_grad()
        total, count = obj.loss_sum(batch)
        with backward_calls or contextlib.nullcontext():
            (total / count).backward()
        return float(total.detach()), {k: p.grad.clone() for k, p in student.named_parameters() if p.grad is not None}

    whole, whole_grads = loss_and_grads()
    monkeypatch.setattr(lo, "KL_CHUNK", 64)
    recomputed = _AtenCalls()
    long, grads = loss_and_grads(recomputed)
    assert seen[0] is False and True in seen[1:]  # checkpointed only as a long row (forward and recompute)
    # The recompute reuses the softmax layers' attention outputs instead of running the kernel again.
    assert any("scaled_dot_product" in n and "backward" in n for n in recomputed.names)
    assert not [n for n in recomputed.names if "scaled_dot_product" in n and "backward" not in n]
    assert not layer.gradient_checkpointing  # and switched off after it
    assert long == pytest.approx(whole, rel=1e-5) and any("lora_" in k for k in grads)
    for k in grads:
        torch.testing.assert_close(grads[k], whole_grads[k], rtol=1e-4, atol=1e-7, msg=k)
