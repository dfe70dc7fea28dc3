"""hybrid_llama.data on the real files in ../shared/data, with the tiny model's byte tokenizer."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest
import torch

from hybrid_llama.data import (
    DataError,
    doc_hash,
    load_instruct,
    load_packed,
    prepare_instruct_data,
    prepare_transfer_corpus,
    read_manifest,
    split_documents,
    split_of,
)


@pytest.fixture(scope="module")
def files(shared_data_dir):
    d = shared_data_dir
    f = {
        "edu_jsonl": d / "fineweb-edu" / "fineweb-edu-sample-10BT.150docs.text.jsonl",
        "edu_csv": d / "fineweb-edu" / "training_data.csv",
        "legal": d / "fineweb-legal-sample",
        "dolly": d / "dolly" / "databricks-dolly-15k.head.jsonl",
    }
    if not all(p.exists() for p in f.values()):
        pytest.skip(f"shared data not found under {d}")
    return f


def _edu_texts(files) -> list[str]:
    return [json.loads(line)["text"] for line in files["edu_jsonl"].read_text().splitlines()]


def _expected_stream(tok, texts) -> list[int]:
    out: list[int] = []
    for t in texts:
        out += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def test_pack_jsonl_matches_independent_packing(files, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    L, budget = 128, 20_000
    out = tmp_path / "edu.safetensors"
    m = prepare_transfer_corpus({"kind": "local", "path": str(files["edu_jsonl"])}, tok, out,
                                seq_len=L, num_tokens=budget)
    rows = load_packed(out)
    n = budget // L
    assert rows.shape == (n, L) and rows.dtype == torch.int64
    stream = _expected_stream(tok, _edu_texts(files))
    assert rows.flatten().tolist() == stream[: n * L]
    # Manifest: counts, hashes of the input file and of the documents actually consumed.
    assert read_manifest(out) == m
    assert (m["seq_len"], m["num_sequences"], m["token_count"], m["seed"]) == (L, n, n * L, 0)
    assert m["files"] == [{"path": str(files["edu_jsonl"]),
                           "sha256": hashlib.sha256(files["edu_jsonl"].read_bytes()).hexdigest()}]
    used = m["num_documents"]
    assert len(_expected_stream(tok, _edu_texts(files)[: used - 1])) < n * L <= len(
        _expected_stream(tok, _edu_texts(files)[:used]))
    assert m["doc_hashes"] == [hashlib.sha256(t.encode()).hexdigest() for t in _edu_texts(files)[:used]]
    assert m["tokenizer"] and m["eos_token_id"] == tok.eos_token_id


def test_csv_reader_gives_same_tokens_as_jsonl(files, tiny_tokenizer, tmp_path):
    # The jsonl is the CSV's text column re-serialized: both readers must produce identical rows.
    a = prepare_transfer_corpus({"kind": "local", "path": str(files["edu_jsonl"])}, tiny_tokenizer,
                                tmp_path / "a.safetensors", seq_len=256, num_tokens=None)
    b = prepare_transfer_corpus({"kind": "local", "path": str(files["edu_csv"]), "text_column": "text"},
                                tiny_tokenizer, tmp_path / "b.safetensors", seq_len=256, num_tokens=None)
    assert a["num_documents"] == b["num_documents"] == 150
    assert a["inputs_sha256"] == b["inputs_sha256"]
    assert torch.equal(load_packed(tmp_path / "a.safetensors"), load_packed(tmp_path / "b.safetensors"))


def test_parquet_dir_uses_everything_with_null_budget(files, tiny_tokenizer, tmp_path):
    parts = sorted(files["legal"].glob("*.parquet"))[:2]
    texts = [t for p in parts for t in pd.read_parquet(p)["text"]]
    L = 1024
    src = {"kind": "local", "path": str(files["legal"] / "batch_00000[12].parquet")}  # a glob
    m = prepare_transfer_corpus(src, tiny_tokenizer, tmp_path / "legal.safetensors", seq_len=L, num_tokens=None)
    total = len(_expected_stream(tiny_tokenizer, texts))
    assert m["num_documents"] == len(texts) == 200
    assert m["num_sequences"] == total // L
    assert [f["path"] for f in m["files"]] == [str(p) for p in parts]


def test_heldout_split_is_disjoint_and_deterministic(files, tiny_tokenizer, tmp_path):
    texts = _edu_texts(files)
    src = {"kind": "local", "path": str(files["edu_jsonl"])}
    kw = dict(seq_len=64, num_tokens=None, heldout_fraction=0.2, seed=3)
    tr = prepare_transfer_corpus(src, tiny_tokenizer, tmp_path / "tr.safetensors", split="train", **kw)
    ho = prepare_transfer_corpus(src, tiny_tokenizer, tmp_path / "ho.safetensors", split="heldout", **kw)
    assert not set(tr["doc_hashes"]) & set(ho["doc_hashes"])
    assert set(tr["doc_hashes"]) | set(ho["doc_hashes"]) == {doc_hash(t) for t in texts}
    assert 10 <= len(ho["doc_hashes"]) <= 50  # 20% of 150, loosely
    # Anyone can recompute membership from the text alone.
    assert {doc_hash(t) for t in texts if split_of(t, heldout_fraction=0.2, seed=3) == "heldout"} == set(
        ho["doc_hashes"])
    tr_texts, ho_texts = split_documents(texts, heldout_fraction=0.2, seed=3)
    assert [doc_hash(t) for t in tr_texts] == tr["doc_hashes"] and [doc_hash(t) for t in ho_texts] == ho["doc_hashes"]
    other = {doc_hash(t) for t in texts if split_of(t, heldout_fraction=0.2, seed=4) == "heldout"}
    assert other != set(ho["doc_hashes"])


def test_too_few_tokens_names_the_source(files, tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"fineweb-edu-sample-10BT\.150docs\.text\.jsonl.*fewer than"):
        prepare_transfer_corpus({"kind": "local", "path": str(files["edu_jsonl"])}, tiny_tokenizer,
                                tmp_path / "x.safetensors", seq_len=1024, num_tokens=10_000_000)


@pytest.mark.parametrize(
    "name,content,pattern",
    [
        ("missing.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"missing\.jsonl: line 2: missing column 'text'"),
        ("empty.jsonl", "", r"empty\.jsonl: empty file"),
        ("blank.jsonl", "\n\n", r"blank\.jsonl: empty file"),
        ("broken.jsonl", '{"text": "a"}\n{"text": \n', r"broken\.jsonl: line 2: invalid JSON"),
        ("notext.jsonl", '{"text": "a"}\n{"text": 5}\n', r"notext\.jsonl: line 2: column 'text' is int"),
        ("missing.csv", "body,x\nhello,1\n", r"missing\.csv: row 1 \(line 2\): missing column 'text'"),
        ("header.csv", "text\n", r"header\.csv: empty file"),
        ("data.txt", "hello", r"data\.txt: unsupported file type"),
    ],
)
def test_bad_local_files(tmp_path, tiny_tokenizer, name, content, pattern):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(DataError, match=pattern):
        prepare_transfer_corpus({"kind": "local", "path": str(p)}, tiny_tokenizer, tmp_path / "o.safetensors",
                                seq_len=4, num_tokens=None)


def test_bad_parquet_row_and_missing_path(tmp_path, tiny_tokenizer):
    p = tmp_path / "t.parquet"
    pd.DataFrame({"text": ["fine", None]}).to_parquet(p)
    with pytest.raises(DataError, match=r"t\.parquet: row 2: column 'text' is NoneType"):
        prepare_transfer_corpus({"kind": "local", "path": str(p)}, tiny_tokenizer, tmp_path / "o.safetensors",
                                seq_len=2, num_tokens=None)
    with pytest.raises(DataError, match=r"nowhere/\*\.jsonl: no such file"):
        prepare_transfer_corpus({"kind": "local", "path": str(tmp_path / "nowhere/*.jsonl")}, tiny_tokenizer,
                                tmp_path / "o.safetensors")


# ------------------------------------------------------------------------------- instruction data


def _dolly(files) -> list[dict]:
    return [json.loads(line) for line in files["dolly"].read_text().splitlines()]


def _expected_examples(tok, rows, max_length):
    """Independent formatting: whole chat via the template; the prompt is the generation-prompt prefix."""
    out = {}
    for r in rows:
        user = r["instruction"] + (f"\n\n{r['context']}" if r["context"].strip() else "")
        msgs = [{"role": "user", "content": user}]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": r["response"]}], tokenize=False)
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        ids = tok(full, add_special_tokens=False)["input_ids"]
        if n_prompt < max_length:
            out[tuple(ids[:max_length])] = n_prompt
    return out


def test_dolly_chat_masking_counts_and_split(files, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    assert tok.chat_template  # the byte tokenizer has one: the chat path is the one exercised
    out = tmp_path / "dolly.safetensors"
    m = prepare_instruct_data({"kind": "local", "path": str(files["dolly"])}, tok, out,
                              max_length=512, val_fraction=0.1, seed=0)
    rows = _dolly(files)
    expected = _expected_examples(tok, rows, 512)
    assert m["template"] == "chat" and m["num_rows"] == 208
    assert m["num_train"] + m["num_val"] + m["num_dropped"] == 208
    assert m["num_train"] + m["num_val"] == len(expected)
    assert m["num_val"] == round(0.1 * len(expected))
    assert m["files"][0]["sha256"] == "2c925ce63bf3517aa4460a2e6d5d117ccc320013ed1cd9295a4cd42f8230ef06"
    seen = set()
    label_tokens = 0
    for split in ("train", "val"):
        d = load_instruct(out, split)
        for ids, labels, att in zip(d["input_ids"], d["labels"], d["attention_mask"]):
            n = int(att.sum())
            assert att[:n].all() and not att[n:].any()  # right padding
            real = tuple(ids[:n].tolist())
            assert real in expected, "example differs from the independent formatting"
            n_prompt = expected[real]
            assert (labels[:n_prompt] == -100).all()  # prompt masked
            assert torch.equal(labels[n_prompt:n], ids[n_prompt:n])  # response kept
            assert (labels[n:] == -100).all()  # padding masked
            label_tokens += n - n_prompt
            seen.add(real)
    assert len(seen) == len(expected)  # train and val are disjoint and cover everything
    assert label_tokens == m["train_label_tokens"] + m["val_label_tokens"]


def test_dolly_split_is_seeded(files, tiny_tokenizer, tmp_path):
    src = {"kind": "local", "path": str(files["dolly"])}
    kw = dict(max_length=256, val_fraction=0.1, max_examples=60)
    vals = []
    for i, seed in enumerate((0, 0, 1)):
        prepare_instruct_data(src, tiny_tokenizer, tmp_path / f"{i}.safetensors", seed=seed, **kw)
        vals.append(load_instruct(tmp_path / f"{i}.safetensors", "val")["input_ids"])
    assert torch.equal(vals[0], vals[1])
    assert not (vals[0].shape == vals[2].shape and torch.equal(vals[0], vals[2]))


def test_dolly_plain_template(files, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    out = tmp_path / "plain.safetensors"
    m = prepare_instruct_data({"kind": "local", "path": str(files["dolly"])}, tok, out,
                              template="plain", max_length=1 << 16, val_fraction=0.05, max_examples=20)
    assert m["template"] == "plain" and m["num_dropped"] == 0 and m["num_truncated"] == 0
    rows = {r["response"]: r for r in _dolly(files)[:20]}
    d = load_instruct(out, "train")
    for ids, labels in zip(d["input_ids"], d["labels"]):
        target = tok.decode(ids[labels != -100].tolist())
        assert target.endswith(tok.eos_token)
        r = rows[target[: -len(tok.eos_token)]]
        prompt = tok.decode(ids[(labels == -100) & (ids != tok.pad_token_id)].tolist())
        assert prompt.startswith("### Instruction:\n" + r["instruction"]) and prompt.endswith("### Response:\n")


def test_instruct_missing_column_names_line(tmp_path, tiny_tokenizer):
    p = tmp_path / "d.jsonl"
    p.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "c", "answer": "d"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl: line 2: missing column 'response'"):
        prepare_instruct_data({"kind": "local", "path": str(p)}, tiny_tokenizer, tmp_path / "o.safetensors")


def test_hf_source_is_streamed_and_read_only_as_far_as_needed(monkeypatch, tiny_tokenizer, tmp_path):
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, *, split, streaming, revision=None):
        calls.append((path, name, split, streaming))

        def rows():
            for i in range(10):
                yield {"text": f"document number {i} " * 20}
            raise AssertionError("read past the token budget")

        return rows()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    src = {"kind": "hf", "path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "split": "train",
           "text_column": "text"}
    m = prepare_transfer_corpus(src, tiny_tokenizer, tmp_path / "hf.safetensors", seq_len=100, num_tokens=1000)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    assert m["num_sequences"] == 10 and m["files"] == [] and m["num_documents"] < 10
    pattern = r"hf:HuggingFaceFW/fineweb-edu/sample-10BT:train: row 1: missing column 'body'"
    with pytest.raises(DataError, match=pattern):
        prepare_transfer_corpus({**src, "text_column": "body"}, tiny_tokenizer, tmp_path / "x.safetensors")


def test_outputs_leave_no_temporary_files_and_readers_stay_importable_from_data(files, tiny_tokenizer, tmp_path):
    """The tensors and the manifest each go through files.atomic_write (nothing else is left in the
    folder); the readers live in hybrid_llama.sources and keep their names in hybrid_llama.data."""
    from hybrid_llama import data, sources

    src = {"kind": "local", "path": str(files["edu_jsonl"])}
    prepare_transfer_corpus(src, tiny_tokenizer, tmp_path / "a" / "c.safetensors", seq_len=64, num_tokens=640)
    out = tmp_path / "a"
    prepare_instruct_data({"kind": "local", "path": str(files["dolly"])}, tiny_tokenizer, out / "i.safetensors",
                          max_examples=20)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["c.json", "c.safetensors", "i.json", "i.safetensors"]
    for name in ("DataError", "doc_hash", "split_of", "split_documents", "iter_documents", "iter_rows"):
        assert getattr(data, name) is getattr(sources, name)
