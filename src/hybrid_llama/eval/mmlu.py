"""MMLU through lm-eval with task definitions generated at run time.

Two prompt formats, both as lm-eval defines them for MMLU:

- ``mc``: ``"<question>\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:"``, choices ``" A".." D"``, metric acc
  (lm-eval's ``mmlu`` task);
- ``cloze``: ``"Question: <question>\\nAnswer:"``, the four answer texts as choices, metrics acc and
  acc_norm (lm-eval's ``mmlu_continuation`` task).

Few-shot examples are the first ``shots`` rows of the dev split. Data comes either from the local CSV
copy (``{kind: local, path: dir}`` with ``dev/*_dev.csv`` and ``test/*_test.csv``, columns
question,choice0..3,answer, answer a 0-based index) or from HF ``cais/mmlu`` (``{kind: hf}``).
Local CSVs are converted to JSON lines with cais/mmlu's fields (question, subject, choices, answer),
so both sources go through the same templates; the YAML holds absolute paths because lm-eval
resolves relative ``data_files`` against the working directory.

CLI: ``python -m hybrid_llama.eval.mmlu compare a.json b.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_llama.names import MMLU_FORMATS as FORMATS
from hybrid_llama.runtime import device_name, for_eval

if TYPE_CHECKING:
    import torch

# torch and lm-eval are imported inside the functions that need them: the `compare` CLI stays fast.

LETTERS = ("A", "B", "C", "D")
SCHEMA = "hybrid_llama.mmlu/1"
CHANCE = 0.25  # four answer choices

# lm-eval's MMLU templates (tasks/mmlu/default and tasks/mmlu/continuation).
_TEMPLATES = {
    "mc": {
        "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\n"
        "C. {{choices[2]}}\nD. {{choices[3]}}\nAnswer:",
        "doc_to_choice": list(LETTERS),
        "description": "The following are multiple choice questions (with answers) about {}.\n\n",
        "metrics": ["acc"],
    },
    "cloze": {
        "doc_to_text": "Question: {{question.strip()}}\nAnswer:",
        "doc_to_choice": "choices",  # a feature name: lm-eval uses doc["choices"] directly
        "description": "The following are questions (with answers) about {}.\n\n",
        "metrics": ["acc", "acc_norm"],
    },
}


# ---------------------------------------------------------------- data -> lm-eval task YAMLs


def _local_subjects(root: Path) -> list[str]:
    return sorted(p.name[: -len("_test.csv")] for p in (root / "test").glob("*_test.csv"))


def _hf_subjects() -> list[str]:
    import lm_eval

    default = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
    return sorted(p.stem[len("mmlu_") :] for p in default.glob("mmlu_*.yaml"))


def read_mmlu_csv(path: str | Path, subject: str) -> list[dict]:
    """Rows of one local MMLU CSV as cais/mmlu-style records (choices list, 0-based int answer)."""
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            answer = int(r["answer"])
            if answer not in range(4):
                raise ValueError(f"{path}: answer {answer!r} is not a 0-based index 0..3")
            rows.append(
                {
                    "question": r["question"],
                    "subject": subject,
                    "choices": [r[f"choice{i}"] for i in range(4)],
                    "answer": answer,
                }
            )
    return rows


def _write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def task_name(fmt: str, subject: str) -> str:
    return f"hl_mmlu_{fmt}_{subject}"


def write_task_yamls(data: dict, subjects: list[str], fmt: str, out_dir: str | Path) -> str:
    """Write one lm-eval task YAML per subject plus a group YAML; return the group name."""
    import yaml

    out_dir = Path(out_dir)
    tpl = _TEMPLATES[fmt]
    kind = data.get("kind", "hf")
    tasks = []
    for subject in subjects:
        cfg: dict[str, Any] = {
            "task": task_name(fmt, subject),
            "task_alias": subject,
            "test_split": "test",
            "fewshot_split": "dev",
            "fewshot_config": {"sampler": "first_n"},
            "output_type": "multiple_choice",
            "doc_to_text": tpl["doc_to_text"],
            "doc_to_choice": tpl["doc_to_choice"],
            "doc_to_target": "answer",
            "description": tpl["description"].format(subject.replace("_", " ")),
            "metric_list": [
                {"metric": m, "aggregation": "mean", "higher_is_better": True} for m in tpl["metrics"]
            ],
            "metadata": {"version": 1.0},
        }
        if kind == "local":
            root = Path(data["path"]).resolve()
            files = {}
            for split in ("dev", "test"):
                rows = read_mmlu_csv(root / split / f"{subject}_{split}.csv", subject)
                files[split] = str((out_dir / f"{subject}_{split}.jsonl").resolve())
                _write_jsonl(rows, Path(files[split]))
            cfg["dataset_path"] = "json"
            cfg["dataset_kwargs"] = {"data_files": files}
        elif kind == "hf":
            cfg["dataset_path"] = data.get("id", "cais/mmlu")
            cfg["dataset_name"] = subject
            if data.get("revision"):
                cfg["dataset_kwargs"] = {"revision": data["revision"]}
        else:
            raise ValueError(f"unknown MMLU data kind {kind!r} (expected 'local' or 'hf')")
        (out_dir / f"{cfg['task']}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        tasks.append(cfg["task"])

    group = f"hl_mmlu_{fmt}"
    group_cfg = {
        "group": group,
        "task": tasks,
        "aggregate_metric_list": [{"metric": m, "weight_by_size": True} for m in tpl["metrics"]],
        "metadata": {"version": 1.0},
    }
    (out_dir / f"{group}.yaml").write_text(yaml.safe_dump(group_cfg, sort_keys=False))
    return group


# ---------------------------------------------------------------- run


def _aggregate(per_subject: dict[str, dict], metric: str) -> dict[str, float]:
    n = [s["n"] for s in per_subject.values()]
    acc = [s[metric] for s in per_subject.values()]
    se = [s[f"{metric}_stderr"] for s in per_subject.values()]
    k = len(acc)
    return {
        f"{metric}_weighted": sum(a * m for a, m in zip(acc, n)) / sum(n),
        f"{metric}_mean": sum(acc) / k,
        # independent subjects: the variance of a plain mean is the mean of variances / k
        f"{metric}_mean_stderr": math.sqrt(sum(s * s for s in se)) / k,
    }


def _question_record(sample: dict, subject: str, fmt: str, log_prompts: bool) -> dict:
    doc = sample["doc"]
    lls = [float(r[0]) for r in sample["filtered_resps"]]
    gold = int(sample["target"])
    if gold != int(doc["answer"]):
        raise AssertionError(f"lm-eval target {gold} != data answer {doc['answer']}")
    pred = max(range(4), key=lambda i: lls[i])
    rec = {
        "subject": subject,
        "doc_id": int(sample["doc_id"]),
        "gold": LETTERS[gold],
        "pred": LETTERS[pred],
        "loglikelihoods": lls,
        "acc": int(sample["acc"]),
        "prompt_hash": sample["prompt_hash"],
    }
    # Cross-check our reading of the loglikelihood order against lm-eval's own scoring.
    if (pred == gold) != bool(rec["acc"]):
        raise AssertionError(f"{subject}#{rec['doc_id']}: argmax {pred} vs lm-eval acc {sample['acc']}")
    if fmt == "cloze":
        lens = [len(c) for c in doc["choices"]]
        rec["pred_norm"] = LETTERS[max(range(4), key=lambda i: lls[i] / lens[i])]
        rec["acc_norm"] = int(sample["acc_norm"])
    if log_prompts:
        rec["prompt"] = sample["arguments"][0][0]
        rec["continuations"] = [a[1] for a in sample["arguments"]]
    return rec


def run_mmlu(
    model,
    tokenizer,
    *,
    data: dict,
    shots: int,
    fmt: str = "mc",
    limit: int | None = None,
    subjects: list[str] | None = None,
    batch_size: int | str = 1,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    meta: dict | None = None,
    log_prompts: bool = False,
) -> dict:
    """Evaluate ``model`` on MMLU with lm-eval and return the result dict (keys: see ``write_result``
    and docs/design.md)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    import lm_eval
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    data = dict(data)
    if data.get("kind") == "local":
        data["path"] = str(Path(data["path"]).resolve())
        available = _local_subjects(Path(data["path"]))
    else:
        available = _hf_subjects()
    subjects = sorted(subjects) if subjects else available
    missing = set(subjects) - set(available)
    if missing:
        raise ValueError(f"unknown MMLU subjects: {sorted(missing)}")

    model = for_eval(model, device, dtype)
    param_dtype = next(model.parameters()).dtype

    # Scoring never decodes: building a cache (KV or hybrid state) in every forward is wasted work.
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = False
    try:
        with tempfile.TemporaryDirectory(prefix="hl_mmlu_") as tmp:
            group = write_task_yamls(data, subjects, fmt, tmp)
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            started = datetime.now(timezone.utc)
            t0 = time.perf_counter()
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=[group],
                num_fewshot=shots,
                limit=limit,
                log_samples=True,
                task_manager=TaskManager(include_path=tmp, include_defaults=False),
            )
            wall = time.perf_counter() - t0
    finally:
        if config is not None:
            config.use_cache = use_cache

    metrics = _TEMPLATES[fmt]["metrics"]
    per_subject, questions = {}, []
    for subject in subjects:
        name = task_name(fmt, subject)
        res = out["results"][name]
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        entry: dict[str, Any] = {"n": len(samples)}
        for m in metrics:
            entry[m] = float(res[f"{m},none"])
            entry[f"{m}_stderr"] = float(res[f"{m}_stderr,none"])
        per_subject[subject] = entry
        questions += [_question_record(s, subject, fmt, log_prompts) for s in samples]

    aggregate: dict[str, Any] = {
        "n": sum(s["n"] for s in per_subject.values()),
        "n_subjects": len(per_subject),
    }
    group_res = out["results"][group]
    for m in metrics:
        aggregate.update(_aggregate(per_subject, m))
        aggregate[f"{m}_weighted_stderr"] = float(group_res[f"{m}_stderr,none"])
        aggregate[f"lm_eval_group_{m}"] = float(group_res[f"{m},none"])
        aggregate[f"lm_eval_group_{m}_stderr"] = float(group_res[f"{m}_stderr,none"])

    meta = dict(meta or {})

    return {
        "schema": SCHEMA,
        "fmt": fmt,
        "shots": shots,
        "limit": limit,
        "subjects": subjects,
        "data": data,
        "batch_size": batch_size,
        "lm_eval_version": lm_eval.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "dtype": str(param_dtype).replace("torch.", ""),
        "device": str(device),
        "device_name": device_name(device),
        "max_length": int(lm.max_length),
        "wall_time_s": wall,
        "started_utc": started.isoformat(timespec="seconds"),
        "meta": meta,
        "model_hash": meta.get("model_hash"),
        "adapter_hash": meta.get("adapter_hash"),
        "chance": CHANCE,
        "per_subject": per_subject,
        "aggregate": aggregate,
        "questions": questions,
    }


def write_result(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return path


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------- compare


_SETTINGS = (
    "fmt",
    "shots",
    "limit",
    "subjects",
    "lm_eval_version",
    "dtype",
    "device_name",
    "model_hash",
    "adapter_hash",
)


def compare(path_a: str | Path | dict, path_b: str | Path | dict) -> dict:
    """Questions whose predicted letter differs between two results, and loglikelihood differences."""
    a = path_a if isinstance(path_a, dict) else load_result(path_a)
    b = path_b if isinstance(path_b, dict) else load_result(path_b)
    qa = {(q["subject"], q["doc_id"]): q for q in a["questions"]}
    qb = {(q["subject"], q["doc_id"]): q for q in b["questions"]}
    common = sorted(qa.keys() & qb.keys())
    changed, diffs = [], []
    max_diff, max_at, prompts_differ = 0.0, None, 0
    for key in common:
        x, y = qa[key], qb[key]
        d = max(abs(u - v) for u, v in zip(x["loglikelihoods"], y["loglikelihoods"]))
        diffs.append(d)
        if d > max_diff or max_at is None:
            max_diff, max_at = d, {"subject": key[0], "doc_id": key[1]}
        prompts_differ += x.get("prompt_hash") != y.get("prompt_hash")
        if x["pred"] != y["pred"]:
            changed.append(
                {
                    "subject": key[0],
                    "doc_id": key[1],
                    "gold": x["gold"],
                    "pred_a": x["pred"],
                    "pred_b": y["pred"],
                    "loglikelihoods_a": x["loglikelihoods"],
                    "loglikelihoods_b": y["loglikelihoods"],
                    "max_abs_diff": d,
                }
            )

    def acc(qs: dict) -> float | None:
        return sum(qs[k]["acc"] for k in common) / len(common) if common else None

    return {
        "a": str(path_a) if not isinstance(path_a, dict) else None,
        "b": str(path_b) if not isinstance(path_b, dict) else None,
        "settings_differ": {k: [a.get(k), b.get(k)] for k in _SETTINGS if a.get(k) != b.get(k)},
        "n_common": len(common),
        "n_only_a": len(qa.keys() - qb.keys()),
        "n_only_b": len(qb.keys() - qa.keys()),
        "n_changed": len(changed),
        "changed": changed,
        "max_abs_ll_diff": max_diff if common else None,
        "max_abs_ll_diff_at": max_at,
        "mean_abs_ll_diff": sum(diffs) / len(diffs) if diffs else None,
        "prompts_differ": prompts_differ,
        "acc_a": acc(qa),
        "acc_b": acc(qb),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_llama.eval.mmlu")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="questions whose prediction changed between two result files")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=int, default=None, help="list at most this many changed questions")
    args = p.parse_args(argv)
    res = compare(args.a, args.b)
    if args.top is not None:
        res["changed"] = sorted(res["changed"], key=lambda r: -r["max_abs_diff"])[: args.top]
    json.dump(res, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
