"""Training rows cut from the books (transfer.corpus: books): which rows, their contents against the
books' own bytes, the split by book, and how the workflow wires them into transfer and distillation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file
from snakemake.utils import validate

from hybrid_llama.config import SCHEMA_PATH, ConfigError
from hybrid_llama.data import DataError, book_row_plan, load_packed, mix_rows, prepare_book_rows, read_manifest
from hybrid_llama.pipeline import Pipeline, shared_data_dir
from hybrid_llama.pipeline.long_context import trains_on_books
from hybrid_llama.pipeline.paths import corpus_parts
from hybrid_llama.train.settings import LoraSettings, TransferSettings
from hybrid_llama.weights import BYTE_OFFSET, byte_tokenizer

REPO = Path(__file__).resolve().parents[1]
BOOKS = shared_data_dir() / "gutenberg"
needs_books = pytest.mark.skipif(not BOOKS.is_dir(), reason=f"no books at {BOOKS}")


@pytest.mark.parametrize("slots, rows, want", [
    ([10, 10], 4, [[2, 7], [2, 7]]),  # equal books: equal shares, spread over each
    ([30, 10], 4, [[5, 15, 25], [5]]),  # shares follow the books' lengths
    ([5, 3], None, [[0, 1, 2, 3, 4], [0, 1, 2]]),  # None: every slot
    ([5, 3], 8, [[0, 1, 2, 3, 4], [0, 1, 2]]),
    ([1, 1, 1], 2, [[0], [0], []]),  # the remainder goes to the earlier book on a tie
])
def test_book_row_plan(slots, rows, want):
    assert book_row_plan(slots, rows) == want


def test_book_row_plan_rejects_more_rows_than_the_books_hold():
    with pytest.raises(ValueError, match="9 rows asked for, the books hold 8"):
        book_row_plan([5, 3], 9)


def _write_books(directory: Path, texts: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / f"{name}.txt").write_text(
            f"Header\n*** START OF THE PROJECT GUTENBERG EBOOK {name} ***\n{text}\n"
            f"*** END OF THE PROJECT GUTENBERG EBOOK {name} ***\nlicence\n")


def _rows_as_text(tokens) -> list[str]:
    return [bytes(int(t) - BYTE_OFFSET for t in row).decode("utf-8") for row in tokens]


def test_rows_are_spans_of_the_training_books_only(tmp_path):
    # each book's text is its own letter repeated with a running count, so a row names its book and place
    texts = {name: "".join(f"{name[-1]}{i:05d}" for i in range(n)) for name, n in
             (("pg1", 400), ("pg2", 200), ("pg3", 300))}
    _write_books(tmp_path / "books", texts)
    out = tmp_path / "rows.safetensors"
    manifest = prepare_book_rows({"dir": str(tmp_path / "books"), "heldout": ["pg3"]}, byte_tokenizer(), out,
                                 seq_len=60, num_tokens=600)
    rows = _rows_as_text(load_packed(out))
    assert len(rows) == 10 and all(len(r) == 60 for r in rows)
    assert read_manifest(out) == manifest and manifest["num_sequences"] == 10 and manifest["token_count"] == 600
    # 2400 and 1200 bytes: 40 and 20 slots, so 7 rows from pg1 and 3 from pg2 (largest remainder)
    assert [(b["name"], b["rows"]) for b in manifest["books"]] == [("pg1", 7), ("pg2", 3)]
    for row, where in zip(rows, manifest["rows"]):
        text = texts[where["book"]]
        assert row == text[where["offset"]:where["offset"] + 60]  # the book's own bytes, no EOS, no boilerplate
        assert "3" not in row[::6]  # never the held-out book
    # interleaved: the last rows (a stage's validation rows) come from both books
    assert {w["book"] for w in manifest["rows"][-2:]} == {"pg1", "pg2"}
    # spread over each book, start to end
    offsets = [w["offset"] for w in manifest["rows"] if w["book"] == "pg1"]
    assert offsets == sorted(offsets) and offsets[0] < 600 and offsets[-1] > 1800


def test_book_rows_take_every_row_or_refuse_too_many(tmp_path):
    _write_books(tmp_path / "books", {"pg1": "a" * 250, "pg2": "b" * 130, "pg9": "c" * 100})
    source = {"dir": str(tmp_path / "books"), "heldout": ["pg9"]}
    manifest = prepare_book_rows(source, byte_tokenizer(), tmp_path / "all.safetensors", seq_len=50, num_tokens=None)
    assert manifest["num_sequences"] == 5 + 2
    with pytest.raises(DataError, match="hold 7 rows of 50 tokens, fewer than the 8 asked for"):
        prepare_book_rows(source, byte_tokenizer(), tmp_path / "more.safetensors", seq_len=50, num_tokens=400)
    with pytest.raises(DataError, match="every book is held out"):
        prepare_book_rows({**source, "heldout": ["pg1", "pg2", "pg9"]}, byte_tokenizer(), tmp_path / "x.safetensors",
                          seq_len=50, num_tokens=100)


@needs_books
def test_mirror_book_rows_hold_no_heldout_text(tmp_path):
    heldout = ["pg174", "pg1342"]
    manifest = prepare_book_rows({"dir": str(BOOKS), "heldout": heldout}, byte_tokenizer(),
                                 tmp_path / "rows.safetensors", seq_len=2048, num_tokens=32 * 2048)
    assert manifest["num_sequences"] == 32
    assert {b["name"] for b in manifest["books"]} == {"pg11", "pg16", "pg98", "pg236", "pg2701", "pg5200"}
    assert {w["book"] for w in manifest["rows"]} <= {b["name"] for b in manifest["books"]}
    held = " ".join((BOOKS / f"{n}.txt").read_text(encoding="utf-8") for n in heldout)
    for row in _rows_as_text(load_packed(tmp_path / "rows.safetensors"))[:4]:
        assert row[100:400] not in held


# ----------------------------------------------------------------------------- a mixed corpus


def _packed(path: Path, first: int, rows: int, kind: str, seq_len: int = 3) -> Path:
    tokens = torch.arange(first, first + rows * seq_len, dtype=torch.int32).view(rows, seq_len)
    save_file({"tokens": tokens}, str(path))
    path.with_suffix(".json").write_text(json.dumps({"kind": kind}))
    return path


@pytest.mark.parametrize("rows, want", [
    ((2, 2), [(0, 0), (1, 0), (0, 1), (1, 1)]),  # equal parts alternate
    ((3, 1), [(0, 0), (0, 1), (1, 0), (0, 2)]),  # the smaller part's row sits in the middle, not at the end
    ((1, 3), [(1, 0), (0, 0), (1, 1), (1, 2)]),
])
def test_mix_rows_interleaves_the_parts_rows_unchanged(tmp_path, rows, want):
    parts = [_packed(tmp_path / "docs.safetensors", 0, rows[0], "transfer_corpus"),
             _packed(tmp_path / "books.safetensors", 1000, rows[1], "book_rows")]
    manifest = mix_rows(parts, tmp_path / "mixed.safetensors")
    mixed, sources = load_packed(tmp_path / "mixed.safetensors"), [load_packed(p) for p in parts]
    assert [tuple(r) for r in manifest["row_parts"]] == want
    for got, (k, i) in zip(mixed, want):
        assert torch.equal(got, sources[k][i])
    assert read_manifest(tmp_path / "mixed.safetensors") == manifest
    assert [(p["kind"], p["rows"]) for p in manifest["parts"]] == [("transfer_corpus", rows[0]), ("book_rows", rows[1])]
    assert manifest["num_sequences"] == sum(rows) and manifest["token_count"] == 3 * sum(rows)


def test_mix_rows_rejects_rows_of_different_lengths(tmp_path):
    parts = [_packed(tmp_path / "a.safetensors", 0, 2, "x"), _packed(tmp_path / "b.safetensors", 0, 2, "x", seq_len=4)]
    with pytest.raises(DataError, match=r"different lengths \[3, 4\]"):
        mix_rows(parts, tmp_path / "mixed.safetensors")


def test_corpus_parts_halve_the_tokens_of_a_mixed_corpus():
    assert corpus_parts("books", "64", "1000") == {"books": {"seq_len": "64", "num_tokens": "1000"}}
    assert corpus_parts("mixed", "64", "1001") == {"documents": {"seq_len": "64", "num_tokens": "500"},
                                                   "books": {"seq_len": "64", "num_tokens": "501"}}
    assert corpus_parts("mixed", "64", "all") == {"documents": {"seq_len": "64", "num_tokens": "all"},
                                                  "books": {"seq_len": "64", "num_tokens": "all"}}


# ----------------------------------------------------------------------------- the workflow


def _config(variant_transfer: dict, name: str = "config.yaml", variant_lora: dict | None = None) -> dict:
    cfg = yaml.safe_load((REPO / "config" / name).read_text())
    lolcats = next(v for v in cfg["variants"] if v["name"] == ("lolcats" if name == "config.yaml" else "lc16"))
    lolcats["transfer"].update(variant_transfer)
    lolcats["lora"].update(variant_lora or {})
    validate(cfg, str(SCHEMA_PATH))
    return cfg


@needs_books
def test_a_books_variant_trains_and_distills_on_the_book_rows():
    p = Pipeline(_config({"corpus": "books"}), REPO)
    p.check()
    rows = "resources/data/book_rows/smollm2/L2048_N65536.safetensors"
    assert p.training_rows("smollm2", "lolcats") == rows
    # its derived variants distill on the same rows; the others keep the packed documents
    assert p.lora_data("smollm2", "lolcats_sparse_distill") == rows == p.lora_data("smollm2", "lolcats")
    assert p.training_rows("smollm2", "seed") == "resources/data/transfer/smollm2/L256_N16384.safetensors"
    # what the transfer job gets trains as such (the corpus keys chose its input file)
    assert TransferSettings.from_dict(p.transfer_train("lolcats")).as_dict()["max_position"] == 8192
    # perplexity's held-out documents are checked against the document corpora only
    assert p.corpus_files("smollm2", name="transfer_manifest") == ["resources/data/transfer/smollm2/L256_N16384.json"]
    assert rows.replace(".safetensors", ".json") in p.report_inputs()["manifests"]
    assert sorted(Path(f).stem for f in p.training_book_files()) == ["pg11", "pg16", "pg236", "pg2701", "pg5200",
                                                                     "pg98"]


DOCUMENT_ROWS = "resources/data/transfer/smollm2/L2048_N65536"
BOOK_ROWS = "resources/data/book_rows/smollm2/L2048_N65536"


@needs_books
def test_a_variant_can_transfer_on_books_and_distill_on_documents():
    p = Pipeline(_config({"corpus": "books"}, variant_lora={"corpus": "documents"}), REPO)
    p.check()
    assert p.training_rows("smollm2", "lolcats") == BOOK_ROWS + ".safetensors"
    # the distillations (its own and the derived cache-active one, which inherits lora.corpus) read documents
    assert p.lora_data("smollm2", "lolcats") == p.lora_data("smollm2", "lolcats_sparse_distill") \
        == DOCUMENT_ROWS + ".safetensors"
    # so perplexity drops the documents distillation saw, and the report lists both corpora's manifests
    assert DOCUMENT_ROWS + ".json" in p.corpus_files("smollm2", name="transfer_manifest")
    assert {BOOK_ROWS + ".json", DOCUMENT_ROWS + ".json"} <= set(p.report_inputs()["manifests"])
    # the corpus chose the file; what the LoRA job gets has no such key and trains as such
    assert p.lora("lolcats")["corpus"] == "documents" and "corpus" not in p.lora_train("lolcats")
    assert LoraSettings.from_dict(p.lora_train("lolcats")).as_dict()["objective"] == "distill"


@needs_books
def test_a_variant_can_transfer_on_documents_and_distill_on_books():
    p = Pipeline(_config({}, variant_lora={"corpus": "books"}), REPO)
    p.check()
    assert p.training_rows("smollm2", "lolcats") == DOCUMENT_ROWS + ".safetensors"
    assert p.lora_data("smollm2", "lolcats") == BOOK_ROWS + ".safetensors"
    assert trains_on_books(p) == ["lolcats", "lolcats_sparse_distill"]
    assert BOOK_ROWS + ".json" in p.report_inputs()["manifests"]
    # the held-out check still covers the documents the transfer packed
    assert DOCUMENT_ROWS + ".json" in p.corpus_files("smollm2", name="transfer_manifest")


@needs_books
def test_a_mixed_variant_trains_on_half_documents_half_book_rows():
    p = Pipeline(_config({"corpus": "mixed"}), REPO)
    p.check()
    half = {"documents": "resources/data/transfer/smollm2/L2048_N32768",
            "books": "resources/data/book_rows/smollm2/L2048_N32768"}
    mixed = "resources/data/mixed_rows/smollm2/L2048_N65536.safetensors"
    assert p.training_rows("smollm2", "lolcats") == p.lora_data("smollm2", "lolcats_sparse_distill") == mixed
    assert p.mixed_inputs("smollm2", "2048", "65536") == {k: f + ".safetensors" for k, f in half.items()}
    # the documents half is a training corpus for the held-out check; both halves' manifests reach the report
    assert half["documents"] + ".json" in p.corpus_files("smollm2", name="transfer_manifest")
    assert {half["documents"] + ".json", half["books"] + ".json"} <= set(p.report_inputs()["manifests"])
    assert "lolcats" in trains_on_books(p)


@needs_books
def test_a_mixed_corpus_counts_the_rows_of_its_two_halves():
    with pytest.raises(ConfigError, match=r"make 0 \+ 1 rows of seq_len 2048 \(mixed\)") as err:
        Pipeline(_config({"corpus": "mixed", "num_tokens": 4095, "eval_sequences": 1, "batch_size": 1}), REPO).check()
    assert err.value.key == "variants[lolcats].transfer.num_tokens"


@needs_books
def test_a_lora_corpus_without_distillation_fails_naming_the_key():
    cfg = _config({}, variant_lora={"corpus": "books", "objective": "instruct"})
    with pytest.raises(ConfigError, match="objective 'instruct'") as err:
        Pipeline(cfg, REPO).check()
    assert err.value.key == "variants[lolcats].lora.corpus"


@needs_books
def test_the_default_variants_train_on_documents():
    p = Pipeline(_config({}), REPO)
    assert all(p.transfer(v)["corpus"] == "documents" for v in p.variants)
    assert p.training_rows("smollm2", "lolcats") == "resources/data/transfer/smollm2/L2048_N65536.safetensors"


@pytest.mark.parametrize("books, needle", [
    ({"heldout": ["pg11", "pg16", "pg98", "pg174", "pg236", "pg1342", "pg2701", "pg5200"]},
     "every book of data.books.names is held out"),
    ({"source": "local", "heldout": ["pg11", "pg16", "pg98", "pg174", "pg236", "pg1342", "pg2701", "pg5200"]},
     "is held out, and ['lolcats', 'lolcats_sparse_distill'] train on the others"),
])
@needs_books
def test_training_on_books_with_every_book_held_out_fails_naming_the_key(books, needle):
    cfg = _config({"corpus": "books"})
    cfg["data"]["books"].update(books)
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        Pipeline(cfg, REPO).check()
    assert err.value.key == "data.books.heldout"


def test_an_unknown_corpus_fails_validation():
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["variants"][1]["transfer"]["corpus"] = "wikipedia"
    with pytest.raises(Exception, match="wikipedia"):
        validate(json.loads(json.dumps(cfg)), str(SCHEMA_PATH))
