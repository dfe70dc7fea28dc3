"""Data and document functions of the zero-shot suite's lm-eval tasks (the YAMLs beside this file).

lm-eval imports this file by path for the YAMLs' ``!function`` tags, so it imports the package
absolutely. Each ``load_*`` is a task's ``custom_dataset``: lm-eval calls it with the task's
metadata (TaskManager / ``--metadata``: ``source`` and ``shared_data``) and ``dataset_kwargs``, and
it returns the Hugging Face data set the built-in task reads, with the same split names and fields:
from the offline mirror when its files are there (``source: auto`` or ``local``), else from the Hub
(``auto`` or ``hf``), with the dataset id the built-in task names.

The mirror keeps PIQA and WinoGrande in their original layout (jsonl plus a labels file), ARC with
the stem and choices nested under ``question``, HellaSwag with an integer label; each loader maps
its rows onto the Hub's fields, so the prompts below see the same documents either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets

from hybrid_llama.eval.mmlu import read_mmlu_csv
from hybrid_llama.pipeline.paths import shared_data_dir
from hybrid_llama.tasks import HUB, LOCAL_FILES

SOURCES = ("auto", "local", "hf")


def local_paths(task: str, shared_data: str | Path = "auto") -> list[Path]:
    """The mirror files of ``task`` under ``shared_data`` ('auto': $HYBRID_LLAMA_SHARED_DATA, else
    ../shared/data beside the repository)."""
    root = shared_data_dir(str(shared_data))
    return [root / rel for rel in LOCAL_FILES[task]]


def use_local(task: str, source: str = "auto", shared_data: str | Path = "auto") -> bool:
    """Whether ``task`` reads the mirror: 'local' always (missing files then fail), 'hf' never,
    'auto' when every file of the task is there."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if source == "auto":
        return all(p.exists() for p in local_paths(task, shared_data))
    return source == "local"


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _labels(path: Path, n: int) -> list[str]:
    labels = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if len(labels) != n:
        raise ValueError(f"{path}: {len(labels)} labels for {n} rows")
    return labels


def _hub(task: str, name: str | None = None) -> datasets.DatasetDict:
    path, default_name = HUB[task]
    return datasets.load_dataset(path, name or default_name)


def _loader(task: str, split: str, read: Callable[[list[Path]], list[dict]]) -> Callable[..., datasets.DatasetDict]:
    def load(source: str = "auto", shared_data: str = "auto", **_: Any) -> datasets.DatasetDict:
        if not use_local(task, source, shared_data):
            return _hub(task)
        return datasets.DatasetDict({split: datasets.Dataset.from_list(read(local_paths(task, shared_data)))})

    load.__name__ = f"load_{task}"
    return load


# ------------------------------------------------------------------ mirror rows -> Hub fields


def _piqa_rows(paths: list[Path]) -> list[dict]:
    rows = _jsonl(paths[0])
    return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(lab)}
            for r, lab in zip(rows, _labels(paths[1], len(rows)))]


def _arc_rows(paths: list[Path]) -> list[dict]:
    out = []
    for r in _jsonl(paths[0]):
        choices = r["question"]["choices"]
        out.append({"id": r["id"], "question": r["question"]["stem"],
                    "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]},
                    "answerKey": r["answerKey"]})
    return out


def _hellaswag_rows(paths: list[Path]) -> list[dict]:
    keys = ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type")
    return [{**{k: r[k] for k in keys}, "label": str(r["label"])} for r in _jsonl(paths[0])]  # a string on the Hub


def _winogrande_rows(paths: list[Path]) -> list[dict]:
    rows = _jsonl(paths[0])
    for r, lab in zip(rows, _labels(paths[1], len(rows))):
        if r["answer"] != lab:
            raise ValueError(f"{paths[0]}: {r['qID']} answer {r['answer']!r} but the labels file says {lab!r}")
    return [{k: r[k] for k in ("sentence", "option1", "option2", "answer")} for r in rows]


def _lambada_rows(paths: list[Path]) -> list[dict]:
    return [{"text": r["text"]} for r in _jsonl(paths[0])]


load_piqa = _loader("piqa", "validation", _piqa_rows)
load_arc_easy = _loader("arc_easy", "test", _arc_rows)
load_arc_challenge = _loader("arc_challenge", "test", _arc_rows)
load_hellaswag = _loader("hellaswag", "validation", _hellaswag_rows)
load_winogrande = _loader("winogrande", "validation", _winogrande_rows)
load_lambada_openai = _loader("lambada_openai", "test", _lambada_rows)


def load_mmlu(subject: str, source: str = "auto", shared_data: str = "auto", **_: Any) -> datasets.DatasetDict:
    """One MMLU subject's test and dev splits (cais/mmlu's fields: question, subject, choices, answer)."""
    if not use_local("mmlu", source, shared_data):
        return _hub("mmlu", subject)
    test_dir, dev_dir = local_paths("mmlu", shared_data)
    return datasets.DatasetDict({
        "test": datasets.Dataset.from_list(read_mmlu_csv(test_dir / f"{subject}_test.csv", subject)),
        "dev": datasets.Dataset.from_list(read_mmlu_csv(dev_dir / f"{subject}_dev.csv", subject)),
    })


# ------------------------------------------------------------------ documents (as lm-eval's built-ins)


def hellaswag_preprocess(text: str) -> str:
    """HellaSwag's text cleaning: WikiHow's bracketed markers go, ' [title]' becomes a sentence end."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


_PROCESSED: dict[str, datasets.Dataset] = {}


def hellaswag_process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """HellaSwag's query, choices and gold. lm-eval asks for the processed docs several times per run,
    and an in-memory data set (the mirror's) has no cache file, so each result is kept by the data
    set's fingerprint instead of mapping the 10,042 rows again every time."""
    key = dataset._fingerprint
    if key not in _PROCESSED:
        _PROCESSED[key] = dataset.map(_hellaswag_fields)
    return _PROCESSED[key]


def _hellaswag_fields(doc: dict) -> dict:
    context = doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {"query": hellaswag_preprocess(context),
            "choices": [hellaswag_preprocess(e) for e in doc["endings"]],
            "gold": int(doc["label"])}


# WinoGrande is scored by partial evaluation: each option fills the blank in its own context, and the
# shared rest of the sentence is the continuation, so the contexts are the choices.
def winogrande_doc_to_text(doc: dict) -> int:
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_doc_to_target(doc: dict) -> str:
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


def winogrande_doc_to_choice(doc: dict) -> list[str]:
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]
