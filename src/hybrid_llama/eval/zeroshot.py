"""The zero-shot suite (PIQA, ARC-Easy, ARC-Challenge, HellaSwag, WinoGrande, LAMBADA, MMLU 5-shot)
through lm-eval's own task machinery, with every example's result kept so that stages can be paired.

The tasks are the YAMLs of ``hybrid_llama.tasks`` (the built-in tasks' prompts on the offline
mirror or the Hub). ``run_suite`` evaluates a model on a seeded sample of each task's examples
(``sample_doc_ids``: the same examples for every model, since it depends only on the seed and the
task sizes; MMLU draws from its 14,042 questions pooled) and returns lm-eval's accuracy and stderr
per task plus one record per example: the per-metric 0/1 scores, the choices' loglikelihoods, and
the token lengths of its requests (for the share of tokens beyond the softmax window;
``beyond_window``).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_llama.eval.tables import mean_sd
from hybrid_llama.files import atomic_write
from hybrid_llama.runtime import device_name, for_eval
from hybrid_llama.tasks import TASK_NAMES, task_manager

if TYPE_CHECKING:
    import torch

SCHEMA = "hybrid_llama.zeroshot/1"
SUITE = tuple(TASK_NAMES)  # every task, in the report's order
# The six tasks of the linearization papers' table (LoLCATs, Liger, LoLA) and the metric each reports.
LOLCATS_METRICS = {"piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
                   "winogrande": "acc", "mmlu": "acc"}
METRICS = {"piqa": ("acc", "acc_norm"), "arc_easy": ("acc", "acc_norm"), "arc_challenge": ("acc", "acc_norm"),
           "hellaswag": ("acc", "acc_norm"), "winogrande": ("acc",), "lambada_openai": ("acc", "perplexity"),
           "mmlu": ("acc",)}


def suite_key(lm_eval_task: str) -> str:
    """The suite task ('piqa', 'mmlu', ...) an lm-eval task name belongs to (MMLU's subjects are
    'hybrid_mmlu::<subject>')."""
    for key, name in TASK_NAMES.items():
        if lm_eval_task == name or lm_eval_task.startswith(name + "::"):
            return key
    raise KeyError(f"{lm_eval_task!r} is not a task of the zero-shot suite")


def sample_doc_ids(sizes: dict[str, int], limit: int | dict | None, seed: int) -> dict[str, list[int]]:
    """{lm-eval task: sorted doc ids}: ``limit`` examples per suite task (a number for every task, or
    {suite task: number}, where a task left out or None takes all), the same for every model.

    They are drawn without replacement, by a generator seeded with (seed, suite task), from the pool
    of all the suite task's docs: MMLU's subjects together, so each keeps its share in expectation
    and lm-eval's size-weighted group score is the plain mean over the drawn questions. A subject
    may draw none (``run_suite`` then leaves it out). ``limit`` None (or beyond the pool) takes all."""
    pools: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name in sorted(sizes):
        pools[suite_key(name)] += [(name, i) for i in range(sizes[name])]
    out: dict[str, list[int]] = {name: [] for name in sizes}
    for key, pool in pools.items():
        n = limit.get(key) if isinstance(limit, dict) else limit
        chosen = pool if n is None or n >= len(pool) else random.Random(f"{seed}:{key}").sample(pool, n)
        for name, i in chosen:
            out[name].append(i)
    return {name: sorted(ids) for name, ids in out.items()}


def _load_sample(manager: Any, names: list[str], limit: int | dict | None, seed: int) -> tuple[list, dict, dict]:
    """(the tasks and groups to evaluate, {task: doc ids}, {task: size}): every task of ``names``
    loaded once, with the subjects that drew no example taken out of their group (lm-eval would run
    every doc of a task whose sample is empty)."""
    loaded = manager.load(names)
    sizes = {name: len(task.eval_docs) for name, task in loaded["tasks"].items()}
    samples = sample_doc_ids(sizes, limit, seed)
    top = []
    for name in names:
        obj = loaded["groups"].get(name) or loaded["tasks"][name]
        for child in [c for c in getattr(obj, "child_names", []) if not samples.get(c)]:
            obj.pop(child)
        top.append(obj)
    return top, {k: v for k, v in samples.items() if v}, sizes


def _example(sample: dict, name: str, lm: Any) -> dict:
    """One example's record from an lm-eval logged sample."""
    args = [tuple(a) for a in sample["arguments"]]
    resps = list(sample["filtered_resps"])
    rec: dict[str, Any] = {
        "task": suite_key(name),
        "subtask": name.split("::", 1)[1] if "::" in name else None,
        "doc_id": int(sample["doc_id"]),
        "target": sample["target"],
        "loglikelihoods": [float(r[0]) for r in resps],
        # (context, continuation) tokens of each request, as lm-eval's model encodes them
        "tokens": [[len(c), len(t)] for c, t in (lm._encode_pair(ctx, cont) for ctx, cont in args)],
    }
    for metric in METRICS[rec["task"]]:
        if metric == "perplexity":  # lm-eval's per-sample value is the target's loglikelihood
            rec["loglikelihood"] = float(sample["perplexity"])
        else:
            rec[metric] = int(bool(sample[metric]))
    return rec


def _stderr(reported: Any, scores: list) -> float:
    """lm-eval's stderr; where it reports none ('N/A': a group whose subjects drew one question each
    has no per-subject stderr to pool), the same formula over the examples: sample sd / sqrt(n)."""
    try:
        return float(reported)
    except (TypeError, ValueError):
        xs = [float(x) for x in scores if x is not None]
        return mean_sd(xs)[1] / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def beyond_window(examples: list[dict], window: int) -> dict[str, float]:
    """Of the examples' tokens (every request: context + continuation), the share at positions the
    softmax window no longer covers from the start (position >= window, where older keys reach the
    linear part); of the examples, the share whose longest request is longer than the window."""
    total = beyond = longer = 0
    for ex in examples:
        lengths = [c + t for c, t in ex["tokens"]]
        total += sum(lengths)
        beyond += sum(max(0, n - window) for n in lengths)
        longer += max(lengths, default=0) > window
    return {"token_share": beyond / total if total else float("nan"),
            "example_share": longer / len(examples) if examples else float("nan"),
            "mean_tokens": total / sum(len(ex["tokens"]) for ex in examples) if examples else float("nan")}


def run_suite(
    model,
    tokenizer,
    *,
    tasks: list[str] | None = None,
    limit: int | dict | None = None,
    seed: int = 0,
    source: str = "auto",
    shared_data: str = "auto",
    batch_size: int | str = 1,
    share_prefixes: bool = False,
    device: str = "cpu",
    dtype: str | torch.dtype | None = None,
    meta: dict | None = None,
) -> dict:
    """Evaluate ``model`` on the suite's ``tasks`` (suite keys, default all) through lm-eval and return
    the result dict (``write_result``; docs/workflow.md lists its keys). ``share_prefixes`` scores the
    requests with their shared token prefixes run once (``SharedPrefixLM``), else each request's whole
    input (``TailLogitsLM``)."""
    import lm_eval
    import torch
    import transformers

    from hybrid_llama.eval.shared_prefix import SharedPrefixLM
    from hybrid_llama.eval.tail_logits import TailLogitsLM

    tasks = list(tasks or SUITE)
    unknown = set(tasks) - set(SUITE)
    if unknown:
        raise ValueError(f"unknown zero-shot tasks {sorted(unknown)} (known: {list(SUITE)})")
    model = for_eval(model, device, dtype)
    param_dtype = next(model.parameters()).dtype

    manager = task_manager(source, shared_data)
    top, samples, sizes = _load_sample(manager, [TASK_NAMES[t] for t in tasks], limit, seed)

    # Scoring never decodes: building a cache (KV or hybrid state) in every forward is wasted work.
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = False
    try:
        lm_class = SharedPrefixLM if share_prefixes else TailLogitsLM
        lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        started = datetime.now(timezone.utc)
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=top, samples=samples, log_samples=True,
                                      task_manager=manager, bootstrap_iters=1000)
        wall = time.perf_counter() - t0
    finally:
        if config is not None:
            config.use_cache = use_cache

    examples = []
    for name in sorted(out["samples"]):
        examples += [_example(s, name, lm) for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])]
    per_task = {}
    for key in tasks:
        res = out["results"][TASK_NAMES[key]]
        own = [e for e in examples if e["task"] == key]
        entry: dict[str, Any] = {"name": TASK_NAMES[key], "n": len(own),
                                 "n_docs": sum(n for name, n in sizes.items() if suite_key(name) == key)}
        for metric in METRICS[key]:
            entry[metric] = float(res[f"{metric},none"])
            entry[f"{metric}_stderr"] = _stderr(res[f"{metric}_stderr,none"], [e.get(metric) for e in own])
        per_task[key] = entry

    meta = dict(meta or {})
    return {
        "schema": SCHEMA,
        "tasks": tasks,
        "limit": limit,
        "seed": seed,
        "source": source,
        "lm_eval_version": lm_eval.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "dtype": str(param_dtype).replace("torch.", ""),
        "device": str(device),
        "device_name": device_name(device),
        "batch_size": batch_size,
        "share_prefixes": bool(share_prefixes),
        "wall_time_s": wall,
        "started_utc": started.isoformat(timespec="seconds"),
        "meta": meta,
        "model_hash": meta.get("model_hash"),
        "adapter_hash": meta.get("adapter_hash"),
        "results": per_task,
        "examples": examples,
    }


def write_result(result: dict, path: str | Path) -> Path:
    return atomic_write(Path(path), json.dumps(result, indent=1, ensure_ascii=False) + "\n")


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
