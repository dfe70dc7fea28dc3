"""The zero-shot suite (hybrid_llama.tasks, hybrid_llama.eval.zeroshot, hybrid_llama.report.zeroshot).

The reference is lm-eval's own built-in task of each data set: its YAML (prompt templates, its
process_docs and doc_to_* functions, metrics) is loaded from lm-eval's package and only its dataset
is replaced by the same rows ours reads, so the built-in formatting runs offline. Our task must
render the same requests (context, continuation) and targets, and score the same accuracy.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_llama.eval.tables import paired_scores
from hybrid_llama.eval.zeroshot import LOLCATS_METRICS, beyond_window, sample_doc_ids, suite_key
from hybrid_llama.pipeline import shared_data_dir
from hybrid_llama.tasks import LOCAL_FILES, TASK_NAMES, task_manager

SRC = Path(__file__).resolve().parents[1] / "src"
DATA = shared_data_dir()
SINGLE = ["piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "lambada_openai"]
MMLU_SUBJECTS = ["abstract_algebra", "high_school_geography"]
ROWS = 6  # rows per task compared request by request


def _has(task: str) -> bool:
    return all((DATA / rel).exists() for rel in LOCAL_FILES[task])


needs = {t: pytest.mark.skipif(not _has(t), reason=f"no offline copy of {t} under {DATA}") for t in TASK_NAMES}


# ----------------------------------------------------------------- the built-in task on our rows


def _builtin(task: str, dataset, subject: str | None = None):
    """lm-eval's built-in task, its dataset replaced by ``dataset`` (the built-in formatting stays)."""
    import lm_eval
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    root = Path(lm_eval.__file__).parent / "tasks"
    yaml_file = {"piqa": "piqa/piqa.yaml", "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                 "hellaswag": "hellaswag/hellaswag.yaml", "winogrande": "winogrande/default.yaml",
                 "lambada_openai": "lambada/lambada_openai.yaml", "mmlu": f"mmlu/default/mmlu_{subject}.yaml"}[task]
    cfg = load_yaml(root / yaml_file, resolve_func=True)
    while "include" in cfg:  # arc_challenge and the MMLU subjects include a base config
        base = load_yaml(root / yaml_file.rsplit("/", 1)[0] / cfg.pop("include"), resolve_func=True)
        cfg = {**base, **cfg}
    cfg.pop("tag", None)
    for key in ("training_split", "validation_split", "test_split"):  # splits the mirror does not hold
        if cfg.get(key) not in dataset:
            cfg.pop(key, None)
    cfg["custom_dataset"] = lambda **_: dataset
    return ConfigurableTask(config=cfg)


def _ours(task: str):
    """Our task (or MMLU's subject tasks) as lm-eval builds it from our folder, on the mirror."""
    return task_manager("local", str(DATA)).load([TASK_NAMES[task]])["tasks"]


def _requests(task, n: int, num_fewshot: int = 0) -> list[tuple]:
    task.set_config("num_fewshot", num_fewshot)
    task.build_all_requests(limit=n, rank=0, world_size=1)
    return [(i.doc_id, tuple(i.arguments)) for i in task.instances]


@pytest.mark.parametrize("task", SINGLE)
def test_requests_and_targets_equal_the_builtin_task(task):
    if not _has(task):
        pytest.skip(f"no offline copy of {task}")
    ours = _ours(task)[TASK_NAMES[task]]
    builtin = _builtin(task, ours.dataset)  # the rows ours read, in the Hub's fields
    mine, ref = _requests(ours, ROWS), _requests(builtin, ROWS)
    assert len(mine) >= ROWS and mine == ref
    docs_a, docs_b = list(ours.eval_docs)[:ROWS], list(builtin.eval_docs)[:ROWS]
    assert [ours.doc_to_target(d) for d in docs_a] == [builtin.doc_to_target(d) for d in docs_b]
    if task != "lambada_openai":  # the only task scored by loglikelihood of one target, no choices
        assert [ours.doc_to_choice(d) for d in docs_a] == [builtin.doc_to_choice(d) for d in docs_b]
    assert len(ours.eval_docs) == len(builtin.eval_docs)


@needs["mmlu"]
@pytest.mark.parametrize("subject", MMLU_SUBJECTS)
def test_mmlu_5shot_requests_equal_the_builtin_subject(subject):
    ours = _ours("mmlu")[f"hybrid_mmlu::{subject}"]
    builtin = _builtin("mmlu", ours.dataset, subject)
    mine, ref = _requests(ours, ROWS, num_fewshot=5), _requests(builtin, ROWS, num_fewshot=5)
    assert mine == ref
    context = mine[0][1][0]
    assert context.startswith(f"The following are multiple choice questions (with answers) about "
                              f"{subject.replace('_', ' ')}.\n\n") and context.count("\nAnswer:") == 6


# ----------------------------------------------------------------- the mirror's rows in the Hub's fields


@needs["piqa"]
def test_piqa_rows_join_the_labels_file():
    rows = _ours("piqa")["hybrid_piqa"].dataset["validation"]
    assert len(rows) == 1838 and set(rows.features) == {"goal", "sol1", "sol2", "label"}
    labels = [int(x) for x in (DATA / "piqa/valid-labels.lst").read_text().split()]
    assert rows["label"] == labels and rows[0]["goal"].startswith("How do I ready a guinea pig cage")


@needs["arc_challenge"]
def test_arc_rows_have_the_hub_layout():
    rows = _ours("arc_challenge")["hybrid_arc_challenge"].dataset["test"]
    first = json.loads((DATA / LOCAL_FILES["arc_challenge"][0]).read_text().splitlines()[0])
    assert rows[0]["question"] == first["question"]["stem"]
    assert rows[0]["choices"] == {"text": [c["text"] for c in first["question"]["choices"]],
                                  "label": [c["label"] for c in first["question"]["choices"]]}
    assert rows[0]["answerKey"] == first["answerKey"] and len(rows) == 1172


@needs["hellaswag"]
def test_hellaswag_and_winogrande_labels_are_strings_as_on_the_hub():
    hs = _ours("hellaswag")["hybrid_hellaswag"].dataset["validation"]
    assert hs[0]["label"] == "3" and hs[0]["ind"] == 24 and len(hs) == 10042
    if _has("winogrande"):
        wg = _ours("winogrande")["hybrid_winogrande"].dataset["validation"]
        assert wg[0]["answer"] == "2" and len(wg) == 1267


def test_hub_fallback_when_the_mirror_is_absent(monkeypatch, tmp_path):
    from hybrid_llama.tasks import utils

    calls = []
    monkeypatch.setattr(utils.datasets, "load_dataset", lambda path, name=None: calls.append((path, name)) or "hub")
    assert utils.load_piqa(source="auto", shared_data=str(tmp_path)) == "hub"
    assert utils.load_mmlu("anatomy", source="hf", shared_data=str(DATA)) == "hub"
    assert calls == [("baber/piqa", None), ("cais/mmlu", "anatomy")]
    with pytest.raises(FileNotFoundError):
        utils.load_arc_easy(source="local", shared_data=str(tmp_path))


# ----------------------------------------------------------------- accuracy against the built-in task


@pytest.mark.skipif(not all(_has(t) for t in ("piqa", "winogrande", "lambada_openai")), reason="no mirror")
def test_accuracy_on_a_tiny_model_equals_the_builtin_task(tiny_model):
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from hybrid_llama.eval.zeroshot import run_suite

    model, tok = tiny_model
    tasks = ["piqa", "winogrande", "lambada_openai"]
    ours = run_suite(model, tok, tasks=tasks, limit=8, seed=3, source="local", shared_data=str(DATA), batch_size=2)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2)
    for task in tasks:
        ids = sorted({e["doc_id"] for e in ours["examples"] if e["task"] == task})
        assert len(ids) == 8
        builtin = _builtin(task, _ours(task)[TASK_NAMES[task]].dataset)
        ref = lm_eval.evaluator.evaluate(lm, {task: builtin}, samples={task: ids}, log_samples=True)
        for metric in ("acc", "acc_norm", "perplexity"):
            if f"{metric},none" in ref["results"][task]:
                assert ours["results"][task][metric] == pytest.approx(ref["results"][task][f"{metric},none"], abs=1e-9)
        ref_ll = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in ref["samples"][task]}
        for e in (e for e in ours["examples"] if e["task"] == task):
            assert e["loglikelihoods"] == pytest.approx(ref_ll[e["doc_id"]], abs=1e-5)


def test_tail_logits_score_as_hflm_and_project_only_the_scored_positions(tiny_model):
    """TailLogitsLM's loglikelihoods equal plain HFLM's on requests of unequal lengths in one batch
    (right padding, an input that itself ends in the pad id, a one-token and a long continuation),
    and its model calls project fewer positions than the batch holds."""
    from lm_eval.models.huggingface import HFLM

    from hybrid_llama.eval.tail_logits import PAD, TailLogitsLM

    model, tok = tiny_model
    requests = [(("", ""), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [17]),
                (("", ""), [21, 22, 23, PAD], [24, 25]),
                (("", ""), [31, 32, 33, 34, 35, 36], [37, 38, 39, 40]),
                (("", ""), [41, 42, 43, 44, 45, 46, 47, 48], [49])]
    ref = HFLM(pretrained=model, tokenizer=tok, batch_size=4)._loglikelihood_tokens(requests)
    lm = TailLogitsLM(pretrained=model, tokenizer=tok, batch_size=4)
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append((args[0].shape[1], kwargs.get("logits_to_keep")))
        return forward(*args, **kwargs)

    model.forward = recording
    try:
        ours = lm._loglikelihood_tokens(requests)
    finally:
        model.forward = forward
    for (ll, greedy), (ll_ref, greedy_ref) in zip(ours, ref, strict=True):
        assert ll == pytest.approx(ll_ref, abs=1e-5) and greedy == greedy_ref
    # one batch of 4: padded to 12 positions, scored from position 3 on (the second request: 4 + 2 - 1
    # inputs, the last 2 scored), so the last 9 are projected
    assert seen == [(12, 9)]


# ----------------------------------------------------------------- sampling and statistics


def test_sample_is_seeded_the_same_for_every_call_and_pools_mmlu():
    sizes = {"hybrid_piqa": 1838, **{f"hybrid_mmlu::s{i}": 100 + 50 * i for i in range(10)}}
    a, b = sample_doc_ids(sizes, 40, seed=0), sample_doc_ids(sizes, 40, seed=0)
    assert a == b and a != sample_doc_ids(sizes, 40, seed=1)
    assert len(a["hybrid_piqa"]) == 40 and len(set(a["hybrid_piqa"])) == 40
    mmlu = {k: v for k, v in a.items() if k.startswith("hybrid_mmlu")}
    assert sum(map(len, mmlu.values())) == 40 and all(0 <= i < sizes[k] for k, ids in mmlu.items() for i in ids)
    # pooled: over many seeds each subject's share approaches its share of the questions
    total = sum(n for k, n in sizes.items() if k != "hybrid_piqa")
    counts = {k: 0 for k in mmlu}
    for seed in range(200):
        for k, ids in sample_doc_ids(sizes, 40, seed).items():
            counts[k] = counts.get(k, 0) + len(ids)
    for k in mmlu:
        assert counts[k] / (200 * 40) == pytest.approx(sizes[k] / total, abs=0.01)
    assert sample_doc_ids(sizes, None, 0)["hybrid_piqa"] == list(range(1838))
    assert suite_key("hybrid_mmlu::anatomy") == "mmlu"


@needs["mmlu"]
def test_subjects_that_draw_nothing_leave_the_group():
    from hybrid_llama.eval.zeroshot import _load_sample

    top, samples, sizes = _load_sample(task_manager("local", str(DATA)), ["hybrid_mmlu"], 5, seed=0)
    (group,) = top
    assert sum(map(len, samples.values())) == 5 and set(group.child_names) == set(samples)
    assert len(sizes) == 57 and sum(sizes.values()) == 14042


def _result(scores: dict[str, list[int]], tokens=None) -> dict:
    examples = [{"task": t, "subtask": None, "doc_id": i, **{LOLCATS_METRICS.get(t, "acc"): s, "acc": s},
                 "tokens": tokens or [[10, 2]]} for t, xs in scores.items() for i, s in enumerate(xs)]
    results = {t: {m: sum(xs) / len(xs) for m in ("acc", LOLCATS_METRICS.get(t, "acc"))} for t, xs in scores.items()}
    return {"examples": examples, "results": results}


def test_suite_comparison_is_the_paired_difference_of_the_six_task_average():
    from hybrid_llama.report.zeroshot import compare

    n = 50
    base = {t: [int(i % 2 == 0) for i in range(n)] for t in LOLCATS_METRICS}
    var = {t: list(xs) for t, xs in base.items()}
    var["piqa"][0] = 0  # one example lost on piqa
    var["mmlu"][1] = 1  # one gained on mmlu
    var["hellaswag"][3] = 1
    c = compare(_result(var), _result(base))
    s = c["suite"]
    # by hand: diffs -1/n, +1/n, +1/n on three tasks, each a single flip among n examples
    assert s["diff"] == pytest.approx((1 / n) / 6)
    se_one = 1 / n  # the sd of n-1 zeros and one +-1 is sqrt(1/n); over sqrt(n)
    assert s["stderr"] == pytest.approx(math.sqrt(3) * se_one / 6)
    assert s["avg_base"] == pytest.approx(0.5) and s["pct_of_base"] == pytest.approx(100 * s["avg"] / 0.5)
    assert c["tasks"]["piqa"]["acc"] == paired_scores({(None, i): x for i, x in enumerate(var["piqa"])},
                                                       {(None, i): x for i, x in enumerate(base["piqa"])})
    assert not s["significant"]


def test_beyond_window_counts_positions_past_the_window():
    ex = [{"tokens": [[60, 10], [60, 2]]}, {"tokens": [[20, 5]]}]
    r = beyond_window(ex, 64)
    assert r["token_share"] == pytest.approx((6 + 0 + 0) / (70 + 62 + 25))
    assert r["example_share"] == 0.5


# ----------------------------------------------------------------- the command line


@needs["piqa"]
def test_cli_runs_a_suite_task_by_name_offline(tiny_model_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HYBRID_LLAMA_SHARED_DATA": str(DATA),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "hybrid_llama.lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={tiny_model_dir}", "--tasks", "hybrid_piqa", "--limit", "4", "--batch_size", "2",
                          "--device", "cpu", "--output_path", str(tmp_path / "out")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["hybrid_piqa"]
    assert 0 <= res["acc,none"] <= 1 and "acc_norm,none" in res


# ----------------------------------------------------------------- the report


def _suite_file(root: Path, slot: str, stage: str, flips: int) -> Path:
    """A zero-shot result of the test DAG's layout: 20 examples per task, base right on the even ones,
    the variant with ``flips`` of base's right answers lost on every task."""
    from hybrid_llama.pipeline import path

    examples, results = [], {}
    for task in ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "lambada_openai", "mmlu"):
        xs = [int(i % 2 == 0 and not (slot != "base" and i < 2 * flips)) for i in range(20)]
        for i, x in enumerate(xs):
            examples.append({"task": task, "subtask": "anatomy" if task == "mmlu" else None, "doc_id": i,
                             "acc": x, "acc_norm": x, "tokens": [[50 + i, 10]], "loglikelihood": -1.0})
        mean = sum(xs) / 20
        results[task] = {"n": 20, "acc": mean, "acc_stderr": 0.1, "acc_norm": mean, "acc_norm_stderr": 0.1,
                         "perplexity": 3.0, "perplexity_stderr": 0.1}
    file = root / path("zeroshot", model="tiny", variant=slot, device="cpu", stage=stage)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"results": results, "examples": examples, "wall_time_s": 3.0}))
    return file


def test_report_headline_and_table_give_the_suite_against_base(tmp_path):
    from test_report_render import headline, make_results

    from hybrid_llama.report.html import write_report
    from hybrid_llama.report.zeroshot import compare

    inputs = make_results(tmp_path)
    files = [_suite_file(tmp_path, "base", "base", 0), _suite_file(tmp_path, "lc16", "transfer_lora", 2)]
    html = write_report(tmp_path / "results/report.html", **inputs, zeroshot=files).read_text()
    rows = headline(html)
    base_cell, lc16_cell = rows["base"][-1][0], rows["lc16: hybrid after transfer + LoRA"][-1][0]
    assert base_cell == "50.0 %"  # every task's average is 10/20
    # the variant lost 2 of base's 10 right answers on every task: 40 % = 80 % of base, a paired
    # difference of -10 points whose stderr is sqrt(6 * (sd of the flips / sqrt 20)^2) / 6
    d = compare(json.loads(files[1].read_text()), json.loads(files[0].read_text()))["suite"]
    assert d["pct_of_base"] == pytest.approx(80.0) and d["diff"] == pytest.approx(-0.1)
    sd = math.sqrt((2 * 0.9**2 + 18 * 0.1**2) / 19)
    assert d["stderr"] == pytest.approx(math.sqrt(6 * (sd / math.sqrt(20)) ** 2) / 6)
    assert lc16_cell.startswith("80.0 % of base Δ -10.0 ± ")
    assert rows["w16: hybrid after transfer + LoRA"][-1][0] == "not measured"  # not in zeroshot.variants
    assert 'id="zeroshot"' in html and "six-task average" in html and "within noise" in html
    # beyond the 16-token window: every example is longer than it
    assert "100 % of examples" in html



# ----------------------------------------------------------------- the workflow's view


def _pipeline(**zeroshot):
    import yaml
    from snakemake.utils import validate

    from hybrid_llama import config
    from hybrid_llama.pipeline import Pipeline

    cfg = yaml.safe_load((SRC.parent / "config" / "test.yaml").read_text())
    cfg["zeroshot"].update(zeroshot)
    validate(cfg, str(config.SCHEMA_PATH))
    return Pipeline(cfg, repo=SRC.parent)


def test_zeroshot_jobs_are_base_and_the_named_variants_final_stages():
    from hybrid_llama.config import ConfigError

    p = _pipeline()
    assert p.zeroshot_slots() == [("base", "base"), ("lc16", "transfer_lora")]
    assert p.zeroshot_files("tiny") == ["results/tiny/base/zeroshot/cpu/base.json",
                                        "results/tiny/lc16/zeroshot/cpu/transfer_lora.json"]
    assert p.report_inputs()["zeroshot"] == p.zeroshot_files("tiny")
    every = _pipeline(variants=None).zeroshot_slots()
    assert every == [("base", "base"), ("w16", "transfer_lora"), ("lc16", "transfer_lora"), ("win16", "converted")]
    settings = p.zeroshot_settings()
    assert settings["limit"] == 2 and settings["shared_data"] == str(p.shared_data())
    assert settings["share_prefixes"] is True  # the schema's default, passed to run_suite
    with pytest.raises(ConfigError, match=r"zeroshot\.variants\[0\]"):
        _pipeline(variants=["nope"]).check()
    q = _pipeline(source="local", tasks=["piqa"])
    q.config["shared_data"] = str(SRC)  # a directory without the mirror's files
    for name in ("transfer", "instruct", "mmlu"):
        q.config["data"][name]["source"] = "hf"
    with pytest.raises(ConfigError, match=r"zeroshot\.source.*piqa/valid\.jsonl"):
        q.check()


def test_mcnemar_and_bootstrap_against_independent_references():
    """McNemar's exact p equals scipy's two-sided binomial test on the discordant examples; the
    bootstrap's interval of a large sample's mean matches the normal interval."""
    import numpy as np

    from hybrid_llama.eval.paired_stats import bootstrap_mean_ci, mcnemar_exact

    stats = pytest.importorskip("scipy.stats")
    for gained, lost in [(0, 0), (3, 0), (7, 2), (10, 10), (1, 12), (40, 25)]:
        want = 1.0 if gained + lost == 0 else stats.binomtest(gained, gained + lost, 0.5).pvalue
        assert mcnemar_exact(gained, lost) == pytest.approx(want, rel=1e-9)
    d = np.random.default_rng(1).choice([-1.0, 0.0, 0.0, 0.0, 1.0, 1.0], size=4000)
    lo, hi = bootstrap_mean_ci([d], resamples=4000)
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert lo == pytest.approx(d.mean() - 1.96 * se, abs=0.15 * se)
    assert hi == pytest.approx(d.mean() + 1.96 * se, abs=0.15 * se)
    # stratified: two tasks weigh equally whatever their sizes
    lo2, hi2 = bootstrap_mean_ci([np.ones(10), np.zeros(1000)])
    assert lo2 == pytest.approx(0.5) and hi2 == pytest.approx(0.5)
    assert bootstrap_mean_ci([d]) == bootstrap_mean_ci([d])


def test_suite_verdicts_are_mcnemar_per_task_and_the_bootstrap_for_the_average():
    from hybrid_llama.report.zeroshot import compare

    n = 60
    base = {t: [int(i % 2 == 0) for i in range(n)] for t in LOLCATS_METRICS}
    var = {t: list(xs) for t, xs in base.items()}
    for i in range(0, 16, 2):  # 8 of base's right answers lost on PIQA, none gained: p = 2 / 2**8
        var["piqa"][i] = 0
    c = compare(_result(var), _result(base))
    piqa = c["tasks"]["piqa"]["acc"]
    assert piqa["p_mcnemar"] == pytest.approx(2 / 2**8) and piqa["significant"]
    assert piqa["ci95"][1] < 0
    s = c["suite"]
    lo, hi = s["ci95"]
    assert lo < s["diff"] < hi and hi < 0 and s["significant"]
    var["piqa"][1] = 1  # one gained back: still 8 lost vs 1 gained
    assert compare(_result(var), _result(base))["tasks"]["piqa"]["acc"]["p_mcnemar"] == pytest.approx(
        2 * 10 / 2**9)
