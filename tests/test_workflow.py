"""The Snakemake workflow: lint/format, config validation before any job, and the whole DAG on
config/test.yaml with incremental-rebuild checks on the exact set of planned jobs.

Every run happens in a temporary copy of the workflow (Snakefile, workflow/, config/, envs/ and a
link to src/), so no result lands in the repository. Snakemake is pinned (pyproject.toml): the
dry-run output parsed below is the 9.x format.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_report_render import assert_headline_above_the_fold, needs_chromium

from hybrid_llama.pipeline import shared_data_dir

REPO = Path(__file__).resolve().parents[1]
SHARED = shared_data_dir()
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def _env() -> dict:
    env = dict(os.environ, HYBRID_LLAMA_SHARED_DATA=str(SHARED), OMP_NUM_THREADS="1")
    env.pop("SNAKEMAKE_PROFILE", None)
    return env


def copy_workflow(dest: Path) -> Path:
    """A runnable copy of the workflow in dest (src/ is linked, not copied)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "Snakefile", dest / "Snakefile")
    for name in ("workflow", "config", "envs"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "profiles"))
    (dest / "src").symlink_to(REPO / "src")
    return dest


def snakemake(workdir: Path, *args: str, configfile: Path | None = None, timeout: int = 1800):
    cmd = [*SNAKEMAKE, *args]
    if configfile is not None:
        cmd += ["--configfile", str(configfile), "--replace-workflow-config"]
    return subprocess.run(cmd, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=timeout)


def planned_jobs(output: str) -> set[tuple[str, str | None]]:
    """{(rule, first output file)} of a dry run's job blocks ('rule x:' / 'localrule x:')."""
    jobs, block = set(), None
    for line in output.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line)
        if m:
            if block:
                jobs.add(tuple(block))
            block = [m.group(1), None]
        elif block and line.startswith("    output: "):
            block[1] = line.removeprefix("    output: ").split(", ")[0].strip()
        elif block and not line.startswith("    "):
            jobs.add(tuple(block))
            block = None
    if block:
        jobs.add(tuple(block))
    return jobs


def test_planned_jobs_parser():
    text = (
        "rule a:\n    input: x\n    output: o1, o2\n    jobid: 1\n"
        "localrule b:\n    output: o3\n    wildcards: w=1\n"
        "rule all:\n    input: o1\n    jobid: 0\n\nJob stats:\n"
    )
    assert planned_jobs(text) == {("a", "o1"), ("b", "o3"), ("all", None)}


# ------------------------------------------------------------------------------------------ lint


def test_lint_clean():
    out = snakemake(REPO, "--lint", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Lints for" not in out.stdout + out.stderr


def test_snakefmt_check():
    files = [str(REPO / "Snakefile"), *map(str, sorted((REPO / "workflow" / "rules").glob("*.smk")))]
    out = subprocess.run([sys.executable, "-m", "snakefmt", "--check", *files], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_rule_has_log_benchmark_conda():
    text = "\n".join(p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk"))
    blocks = re.split(r"\n(?=rule \w+:)", text)[1:]
    assert len(blocks) >= 15
    for block in blocks:
        name = re.match(r"rule (\w+):", block).group(1)
        for directive in ("log:", "benchmark:", "conda:", "script:"):
            assert f"\n    {directive}" in block, f"rule {name} lacks {directive}"


# ------------------------------------------------------------------------------------------ config


def test_config_files_equal_when_merged_or_replaced():
    """`--configfile X` extends config.yaml; X must set every key config.yaml sets, so the result
    is the same as with --replace-workflow-config (lists such as models/variants are replaced)."""
    from snakemake.utils import update_config

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for name in ("paper.yaml", "test.yaml"):
        other = yaml.safe_load((REPO / "config" / name).read_text())
        merged = copy.deepcopy(base)
        update_config(merged, other)
        assert merged == other, f"config/{name} does not override every key of config/config.yaml"


def _walk_properties(node: dict, defs: dict, path=()):
    """Yield (path, subschema, resolved subschema) for every named property in the schema."""
    if not isinstance(node, dict):
        return
    for key, sub in (node.get("properties") or {}).items():
        resolved = defs[sub["$ref"].split("/")[-1]] if "$ref" in sub else sub
        yield path + (key,), sub, resolved
        yield from _walk_properties(sub, defs, path + (key,))
        if resolved is not sub:
            yield from _walk_properties(resolved, defs, path + (key,))
    for k in ("items", "additionalProperties", "then"):
        if isinstance(node.get(k), dict):
            yield from _walk_properties(node[k], defs, path)
    for k in ("allOf", "anyOf", "oneOf"):
        for sub in node.get(k, []):
            yield from _walk_properties(sub, defs, path)


def test_schema_is_valid_and_describes_every_key():
    import jsonschema

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    defs = schema["$defs"]
    undocumented = [
        ".".join(path)
        for path, sub, resolved in _walk_properties(schema, defs)
        if set(sub) != {"default"} and not (sub.get("description") or resolved.get("description"))
    ]
    for d in defs.values():
        undocumented += [
            ".".join(p)
            for p, sub, r in _walk_properties(d, defs)
            if not (sub.get("description") or r.get("description"))
        ]
    assert undocumented == []


def test_schema_fills_defaults_for_a_minimal_config():
    from snakemake.utils import validate

    cfg = {
        "models": [{"name": "m", "kind": "random", "preset": "tiny"}],
        "variants": [{"name": "v", "hybrid": {"layers": [0]}}],
    }
    validate(cfg, str(REPO / "config" / "schema.yaml"))
    assert cfg["variants"][0]["hybrid"] == {
        "layers": [0],
        "window": 64,
        "formulation": "hybrid",
        "feature_map": "elu1",
        "backend": "auto",
        "sparse_cache": 0,
        "sinks": 0,
        "cache_score": "sre",
        "softmax_heads": [],
        "decay": None,
    }
    assert cfg["lora"]["r"] == 8 and cfg["lora"]["alpha"] == 16 and cfg["lora"]["lr"] == 1e-4
    assert cfg["base_lora"]["target"] == "all" and "r" not in cfg["base_lora"]  # overrides only
    assert cfg["transfer"]["trainable"] == "logits+qkvo"
    assert cfg["mmlu"]["shots"] == [0, 5] and cfg["mmlu"]["formats"] == ["mc", "cloze"]
    assert cfg["transfer"]["num_tokens"] == 1_000_000 and cfg["data"]["instruct"]["source"] == "auto"
    assert cfg["quality"]["passkey"]["depths"] is None and cfg["quality"]["passkey"]["trials"] == 16
    assert cfg["devices"] == ["cpu"]
    assert "transfer" not in cfg["variants"][0]  # a variant only holds what it overrides


@pytest.fixture(scope="module")
def wf_copy(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("wf"))


def _bad(wf: Path, name: str, mutate) -> subprocess.CompletedProcess:
    cfg = yaml.safe_load((REPO / "config" / "test.yaml").read_text())
    mutate(cfg)
    path = wf / f"bad_{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return snakemake(wf, "-n", "--cores", "1", configfile=path, timeout=600)


BAD_CONFIGS = {
    "window_zero": (lambda c: c["variants"][0]["hybrid"].update(window=0), ["window", "minimum"]),
    "unknown_kind": (lambda c: c["models"][0].update(kind="ftp"), ["kind", "ftp"]),
    "shots_not_list": (lambda c: c["mmlu"].update(shots="0,5"), ["shots", "not of type 'array'"]),
    "shots_duplicate": (lambda c: c["mmlu"].update(shots=[0, 0]), ["shots", "non-unique"]),
    "layer_beyond_model": (
        lambda c: c["variants"][0]["hybrid"].update(layers=[0, 7]),
        ["'variants[w16].hybrid.layers'", "layer index 7", "4 layers"],
    ),
    "reserved_variant": (lambda c: c["variants"][0].update(name="base"), ["'name'", "should not be valid"]),
    "typo_key": (lambda c: c["transfer"].update(lrr=0.1), ["lrr", "Additional properties"]),
    "bad_device": (lambda c: c.update(devices=["gpu0"]), ["devices", "gpu0"]),
    "unknown_feature_map": (
        lambda c: c["variants"][0]["hybrid"].update(feature_map="relu"),
        ["feature_map", "relu", "is not one of"],
    ),
    "trainable_selects_nothing": (
        lambda c: c["variants"][0].update(transfer={"trainable": "feature_map"}),
        ["'variants[w16].transfer.trainable'", "selects nothing", "elu1"],
    ),
    "seq_len_beyond_positions": (
        lambda c: c["transfer"].update(seq_len=8192, num_tokens=8192 * 8),
        ["'transfer.seq_len'", "8192", "positions (4096)"],
    ),
    "too_few_tokens_for_a_batch": (
        lambda c: c["variants"][1]["transfer"].update(num_tokens=128 * 3),
        ["'variants[lc16].transfer.num_tokens'", "3 rows", "needs at least"],
    ),
    "distill_control": (lambda c: c.update(base_lora={"objective": "distill"}), ["'base_lora.objective'", "instruct"]),
    "more_ranked_heads_than_the_layers_hold": (
        lambda c: c["variants"][1]["hybrid"].update(softmax_heads={"top": 5}),
        ["'variants[lc16].hybrid.softmax_heads.top'", "5 heads asked", "4 KV heads in the 2 hybrid layers"],
    ),
    "ranking_longer_than_the_positions": (
        lambda c: c["retrieval_heads"].update(context_len=8192),
        ["'retrieval_heads.context_len'", "positions (4096)"],
    ),
    "missing_local_data": (
        lambda c: c["data"]["transfer"].update(local="nowhere/none.jsonl"),
        ["'data.transfer.local'", "does not exist"],
    ),
    "book_name_without_ebook_id": (
        lambda c: c["data"]["books"]["names"].append("moby_dick"),
        ["'data.books.names[8]'", "not a Project Gutenberg book name"],
    ),
    "heldout_book_not_on_the_hub": (
        lambda c: c["data"]["books"].update(source="hf", heldout=["pg84"]),
        ["'data.books.heldout'", "not among the books taken from the Hub"],
    ),
    "training_on_books_with_every_book_held_out": (
        lambda c: (c["variants"][1]["transfer"].update(corpus="books"),
                   c["data"]["books"].update(heldout=list(c["data"]["books"]["names"]))),
        ["'data.books.heldout'", "is held out, and ['lc16'] train on the others"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_fails_before_any_job(wf_copy, case):
    mutate, needles = BAD_CONFIGS[case]
    out = _bad(wf_copy, case, mutate)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    for needle in needles:
        assert needle in text, f"{case}: {needle!r} not in:\n{text[-3000:]}"
    assert not planned_jobs(text), "jobs were planned despite the bad config"
    assert "Building DAG" not in text


def test_good_test_config_dry_run(wf_copy):
    out = snakemake(wf_copy, "-n", "--cores", "1", configfile=wf_copy / "config" / "test.yaml", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = planned_jobs(out.stdout)
    rules = sorted(r for r, _ in jobs)
    # base, base_lora once; w16 and lc16 at transfer and transfer_lora; the control win16 only converted
    assert rules.count("mmlu") == 7  # one format (mc), one shot count
    assert rules.count("perplexity") == rules.count("passkey") == rules.count("generations") == 7
    # every stage scores the books' and the needles' short lengths; the long ones only some (same jobs)
    assert rules.count("book_nll") == rules.count("niah") == 7 and rules.count("plot_long_context") == 1
    assert rules.count("components") == 5  # hybrid stages only
    assert rules.count("transfer") == rules.count("lora") == 2 and rules.count("transfer_data") == 2
    assert rules.count("retrieval_heads") == 1  # lc16 keeps ranked heads: one ranking for the model
    # the trained variants' final stages are exported; the untrained control is not
    assert {j for j in jobs if j[0] == "export"} == {("export", "results/tiny/w16/model"),
                                                     ("export", "results/tiny/lc16/model")}
    assert ("report", "results/report.html") in jobs
    assert "books_download" not in rules  # the mirror's books are read where they are


def _schedule_sim():
    import importlib.util

    spec = importlib.util.spec_from_file_location("schedule_sim", REPO / "benchmarks" / "schedule_sim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["schedule_sim"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


def test_every_job_training_waits_for_has_trainings_priority(wf_copy):
    """Training takes two cores and Snakemake fills one free core with any ready job, so a job
    upstream of training with a lower priority than the evaluations' would let them starve it."""
    sim = _schedule_sim()
    out = snakemake(wf_copy, "-n", "--cores", "2", configfile=wf_copy / "config" / "test.yaml", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = sim.read_dry_run(out.stdout, wf_copy, untimed_s=1.0)
    training = {j for j, job in jobs.items() if job.rule in ("transfer", "lora", "base_lora")}
    upstream, todo = set(training), list(training)
    while todo:
        for dep in jobs[todo.pop()].deps - upstream:
            upstream.add(dep)
            todo.append(dep)
    assert len(training) == 5 and {jobs[j].rule for j in upstream} >= {"weights", "transfer_data"}
    assert {(jobs[j].rule, jobs[j].priority) for j in upstream if jobs[j].priority < 10} == set()
    evaluations = [job for j, job in jobs.items() if j not in upstream and job.rule != "retrieval_heads"]
    assert max(job.priority for job in evaluations) < 10


def test_schedule_sim_replays_a_starved_two_core_job():
    """A two-core job waits while one-core jobs keep the freed core busy (Snakemake's policy), and
    its priority only helps once both cores are free at once."""
    sim = _schedule_sim()

    def job(rule, seconds, threads=1, priority=0, deps=()):
        return sim.Job(rule, [rule], [], threads, priority, seconds, True, set(deps))

    # w (1 s) gates t (2 cores, 10 s); b (20 s) starts beside w, and t waits for it
    jobs = {0: job("w", 1, priority=10), 1: job("t", 10, threads=2, priority=10, deps=[0]), 2: job("b", 20)}
    assert sim.makespan(jobs, 2, sim.random.Random(0)) == 30
    # a (5 s, priority 5) starts beside w instead, but b fills the core w frees: t still waits for b
    jobs[3] = job("a", 5, priority=5)
    assert sim.makespan(jobs, 2, sim.random.Random(0)) == 31
    # once nothing else is ready when w ends, t starts at once
    del jobs[3]
    jobs[2] = job("b", 4, deps=[1])
    assert sim.makespan(jobs, 2, sim.random.Random(0)) == 15


def test_books_from_the_hub_are_downloaded_once_for_every_book_job(wf_copy, tmp_path):
    """data.books.source hf: one books_download job writes every book of data.books.names, and the
    book jobs read the held-out book from there instead of the mirror; so do the book rows of a
    variant on transfer.corpus books."""
    cfg = yaml.safe_load((wf_copy / "config" / "test.yaml").read_text())
    cfg["data"]["books"]["source"] = "hf"
    cfg["variants"][1]["transfer"]["corpus"] = "books"
    file = tmp_path / "hub_books.yaml"
    file.write_text(yaml.safe_dump(cfg))
    out = snakemake(wf_copy, "-n", "--cores", "1", configfile=file, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = sorted(r for r, _ in planned_jobs(out.stdout))
    assert rules.count("books_download") == 1 and rules.count("book_nll") == rules.count("niah") == 7
    block = out.stdout.split("rule books_download:\n", 1)[1].split("\n\n", 1)[0]
    outputs = [f"resources/data/books/{n}.txt" for n in cfg["data"]["books"]["names"]]
    assert f"    output: {', '.join(outputs)}, resources/data/books/manifest.json\n" in block
    book_jobs = [b for b in re.split(r"\n(?=\[)", out.stdout) if re.search(r"^rule (book_nll|niah):$", b, re.M)]
    assert len(book_jobs) == 14
    assert all("resources/data/books/pg5200.txt" in b and str(SHARED) not in b for b in book_jobs)
    _check_book_rows_plan(out.stdout, cfg, "resources/data/books")


def _check_book_rows_plan(stdout: str, cfg: dict, where: str, corpus: str = "books") -> None:
    """lc16 on transfer.corpus books: one book_rows job reads every book not held out (from ``where``)
    and lc16's transfer and distillation read its rows; w16 keeps its packed documents. On corpus
    mixed, lc16's rows interleave 512 tokens of book rows with 512 of packed documents."""
    rules = sorted(r for r, _ in planned_jobs(stdout))
    mixed = corpus == "mixed"
    assert rules.count("book_rows") == 1 and rules.count("transfer_data") == 1 + mixed  # w16's corpus (+ lc16's half)
    blocks = {b.split(":\n", 1)[0]: b for b in re.split(r"\n(?=rule )", stdout) if b.startswith("rule ")}
    books = {f"{where}/{n}.txt" for n in cfg["data"]["books"]["names"] if n != "pg5200"}  # pg5200 is held out
    inputs = blocks["rule book_rows"].split("    input: ", 1)[1].split("\n", 1)[0].split(", ")
    assert inputs[0] == "resources/weights/tiny/config.json" and set(inputs[1:]) == books
    rows = f"resources/data/{'mixed' if mixed else 'book'}_rows/tiny/L128_N1024.safetensors"
    if mixed:
        assert rules.count("mixed_rows") == 1
        assert f"    input: resources/data/transfer/tiny/L128_N512.safetensors, resources/data/book_rows/tiny/" \
               f"L128_N512.safetensors\n    output: {rows}," in blocks["rule mixed_rows"]
    for rule, output in (("transfer", "results/tiny/lc16/transfer/"), ("lora", "results/tiny/lc16/lora/")):
        block = stdout.split(f"rule {rule}:\n")
        assert any(output in b.split("\n\n", 1)[0] and rows in b.split("\n\n", 1)[0] for b in block[1:]), rule


def test_a_variant_on_a_mixed_corpus_trains_and_distills_on_documents_and_the_mirrors_book_rows(wf_copy, tmp_path):
    """... and its distillation adds recall rows, built once from the training books."""
    cfg = yaml.safe_load((wf_copy / "config" / "test.yaml").read_text())
    cfg["variants"][1]["transfer"]["corpus"] = "mixed"
    cfg["variants"][1]["lora"].update(recall_rows=2, recall_facts=1, recall_seq_len=128, answer_weight=5)
    file = tmp_path / "books_local.yaml"
    file.write_text(yaml.safe_dump(cfg))
    out = snakemake(wf_copy, "-n", "--cores", "1", configfile=file, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    _check_book_rows_plan(out.stdout, cfg, str(SHARED / "gutenberg"), corpus="mixed")
    blocks = [b for b in re.split(r"\n(?=\[)", out.stdout) if re.search(r"^rule (recall_rows|lora):$", b, re.M)]
    recall = "resources/data/recall_rows/tiny/L128_R2_F1.safetensors"
    built = [b for b in blocks if "rule recall_rows:" in b]
    assert len(built) == 1 and f"output: {recall}," in built[0]
    inputs = built[0].split("    input: ", 1)[1].split("\n", 1)[0].split(", ")
    books = {str(SHARED / "gutenberg" / f"{n}.txt") for n in cfg["data"]["books"]["names"] if n != "pg5200"}
    assert inputs[0] == "resources/weights/tiny/config.json" and set(inputs[1:]) == books
    lora = [b for b in blocks if "rule lora:" in b and "results/tiny/lc16/lora/" in b]
    assert len(lora) == 1 and recall in lora[0].split("output:", 1)[0]


_PARSE_PROBE = """
import os, sys
from snakemake.cli import main
sys.argv = ["snakemake", "-n", "--cores", "1", "--configfile", "config/test.yaml", "--replace-workflow-config"]
try:
    main()
except SystemExit as e:
    print(e.code, "torch" in sys.modules, "transformers" in sys.modules, os.environ.get("HYBRID_LLAMA_REGISTER"))
"""


def test_parsing_keeps_torch_out(wf_copy):
    """The Snakefile imports the package without registering the model type (which would import torch
    and transformers: seconds per snakemake call, per job on a cluster), and leaves the environment
    as it found it, so the jobs register."""
    out = subprocess.run([sys.executable, "-c", _PARSE_PROBE], cwd=wf_copy, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.stdout.split("\n")[-2] == "0 False False None", out.stdout[-2000:] + out.stderr[-2000:]


def test_derived_variants_plan_no_training_of_their_own(wf_copy, tmp_path):
    """A variant derived from lc16 trains nothing (its stages read lc16's layers and adapter); one with
    a 'lora' of its own adds one LoRA job, which reads lc16's transfer layers and teacher states."""
    cfg = yaml.safe_load((wf_copy / "config" / "test.yaml").read_text())
    cfg["variants"] += [
        {"name": "lc16s", "from": "lc16", "hybrid": {"sparse_cache": 4, "sinks": 1}, "stages": ["transfer_lora"]},
        {"name": "lc16sd", "from": "lc16", "hybrid": {"sparse_cache": 4, "sinks": 1}, "lora": {},
         "stages": ["transfer_lora"]},
    ]
    file = tmp_path / "derived.yaml"
    file.write_text(yaml.safe_dump(cfg))
    out = snakemake(wf_copy, "-n", "--cores", "1", configfile=file, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = planned_jobs(out.stdout)
    rules = sorted(r for r, _ in jobs)
    assert rules.count("transfer") == 2 and rules.count("lora") == 3  # w16, lc16, and lc16sd's own LoRA
    assert ("passkey", "results/tiny/lc16s/quality/cpu/transfer_lora/passkey.csv") in jobs
    lora_block = "output: results/tiny/lc16sd/lora/adapter_model.safetensors"
    block = out.stdout.split(lora_block)[0].rsplit("rule lora:", 1)[1]
    assert "results/tiny/lc16/transfer/hybrid_layers.safetensors" in block
    assert "results/tiny/lc16/transfer/teacher_states.safetensors" in block
    passkey_block = "output: results/tiny/lc16s/quality/cpu/transfer_lora/passkey.csv"
    evals = out.stdout.split(passkey_block)[0].rsplit("rule ", 1)[1]
    assert "results/tiny/lc16/lora/adapter_model.safetensors" in evals


def test_passkey_variants_and_no_mmlu_shots_plan_only_those_jobs(wf_copy, tmp_path):
    """quality.passkey.variants: [lc16] runs the passkey for base, base_lora and lc16's stages only, and
    w16 still exports (its card reads no passkey table); mmlu.shots: [] plans no MMLU job or plot."""
    cfg = yaml.safe_load((wf_copy / "config" / "test.yaml").read_text())
    cfg["quality"]["passkey"]["variants"] = ["lc16"]
    cfg["mmlu"]["shots"] = []
    file = tmp_path / "fewer.yaml"
    file.write_text(yaml.safe_dump(cfg))
    out = snakemake(wf_copy, "-n", "--cores", "1", configfile=file, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = planned_jobs(out.stdout)
    passkeys = sorted(f for r, f in jobs if r == "passkey")
    assert passkeys == sorted(f"results/tiny/{slot}/quality/cpu/{stage}/passkey.csv" for slot, stage in [
        ("base", "base"), ("base_lora", "base_lora"), ("lc16", "transfer"), ("lc16", "transfer_lora")])
    assert ("quality_table", "results/tiny/w16/quality/cpu/passkey.csv") not in jobs
    assert ("quality_table", "results/tiny/lc16/quality/cpu/passkey.csv") in jobs
    assert ("export", "results/tiny/w16/model") in jobs
    assert not [r for r, _ in jobs if "mmlu" in r]
    assert sorted(r for r, _ in jobs).count("perplexity") == 7  # the other evaluations as before


def test_a_parent_with_no_stages_plans_its_training_and_nothing_of_its_own(wf_copy, tmp_path):
    """stages: [] (the default's lolcats_sparse_distill): its LoRA job runs for the variant derived
    from it; no job evaluates, tables, plots or exports it."""
    cfg = yaml.safe_load((wf_copy / "config" / "test.yaml").read_text())
    cfg["variants"] += [
        {"name": "lc16sd", "from": "lc16", "hybrid": {"sparse_cache": 4, "sinks": 1}, "lora": {}, "stages": []},
        {"name": "lc16sdh", "from": "lc16sd", "hybrid": {"sinks": 2}, "stages": ["transfer_lora"]},
    ]
    file = tmp_path / "parent.yaml"
    file.write_text(yaml.safe_dump(cfg))
    out = snakemake(wf_copy, "-n", "--cores", "1", configfile=file, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = planned_jobs(out.stdout)
    assert ("lora", "results/tiny/lc16sd/lora/adapter_model.safetensors") in jobs
    assert ("passkey", "results/tiny/lc16sdh/quality/cpu/transfer_lora/passkey.csv") in jobs
    own = [(r, f) for r, f in jobs if "/lc16sd/" in (f or "")]
    assert sorted(r for r, _ in own) == ["lora", "plot_lora_loss"], own
    assert "results/tiny/lc16sd/quality" not in out.stdout


# ------------------------------------------------------------------------------------------ whole DAG

# The test config's model, device and variants: V has the seed recipe's shape, L is LoLCATs-shaped
# (Hedgehog, LoRA distilled on its own corpus), C the window-only control (stage converted only).
M, D = "tiny", "cpu"
V, L, C = "w16", "lc16", "win16"
SLOTS = {V: ("transfer", "transfer_lora"), L: ("transfer", "transfer_lora"), C: ("converted",)}
ALL_SLOTS = [("base", "base"), ("base_lora", "base_lora")] + [(v, s) for v, st in SLOTS.items() for s in st]


def _stage_jobs(slot: str, stage: str, fmts=("mc",), shots=(0,)) -> set:
    jobs = {("mmlu", f"results/{M}/{slot}/mmlu/{D}/{stage}/{f}_{s}shot.json") for f in fmts for s in shots}
    jobs |= {
        ("perplexity", f"results/{M}/{slot}/quality/{D}/{stage}/perplexity.csv"),
        ("passkey", f"results/{M}/{slot}/quality/{D}/{stage}/passkey.csv"),
        ("book_nll", f"results/{M}/{slot}/quality/{D}/{stage}/books.csv"),
        ("niah", f"results/{M}/{slot}/quality/{D}/{stage}/niah.csv"),
        ("generations", f"results/{M}/{slot}/generations/{stage}.json"),
    }
    if slot in SLOTS:
        jobs.add(("components", f"results/{M}/{slot}/quality/{D}/{stage}/components.csv"))
    return jobs


def _tables(variant: str, kinds=("perplexity", "passkey", "components", "books", "niah")) -> set:
    """A variant's quality tables and the quality plot jobs (one per model and device, reading every table)."""
    jobs = {("quality_table", f"results/{M}/{variant}/quality/{D}/{k}.csv") for k in kinds}
    if set(kinds) & {"perplexity", "passkey", "components"}:
        jobs.add(("plot_quality", f"results/plots/{M}/nll_{D}.png"))
    if "books" in kinds:
        jobs.add(("plot_long_context", f"results/plots/{M}/books_nll_{D}.png"))
    return jobs


REPORT = {("plot_mmlu", f"results/plots/{M}/mmlu_mc.png"), ("report", "results/report.html"), ("all", None)}


def _exports(*variants: str) -> set:
    """Export jobs: a variant's model directory (its card quotes its quality tables and throughput)."""
    return {("export", f"results/{M}/{v}/model") for v in variants}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The whole DAG of config/test.yaml, run once; yields (workdir, config, seconds)."""
    if not (SHARED / "mmlu").is_dir():
        pytest.skip(f"shared data mirror not found at {SHARED} (set HYBRID_LLAMA_SHARED_DATA)")
    wf = copy_workflow(tmp_path_factory.mktemp("dag"))
    cfg_path = wf / "config" / "test.yaml"
    t0 = time.perf_counter()
    out = snakemake(wf, "--cores", "2", configfile=cfg_path, timeout=3000)
    seconds = time.perf_counter() - t0
    print(f"\nwhole test DAG: {seconds:.0f} s wall")
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-5000:]
    return wf, yaml.safe_load(cfg_path.read_text()), seconds


def _plan(wf: Path, cfg: dict, name: str) -> set:
    path = wf / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = snakemake(wf, "-n", "--cores", "2", configfile=path, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return planned_jobs(out.stdout)


@pytest.mark.slow
@needs_chromium
def test_dag_report_headline_is_above_the_fold(built, tmp_path):
    """The report the test DAG wrote, as a reader opens it: the headline table above the fold."""
    assert_headline_above_the_fold(built[0] / "results" / "report.html", tmp_path)


@pytest.mark.slow
def test_whole_dag_outputs(built):
    wf, cfg, seconds = built
    html = (wf / "results" / "report.html").read_text()
    assert 'id="mmlu-table"' in html and "data:image/png;base64," in html
    for rel in (
        f"results/{M}/{V}/transfer/hybrid_layers.safetensors",
        f"results/{M}/{V}/lora/adapter_model.safetensors",
        f"results/{M}/{L}/lora/adapter_model.safetensors",
        f"results/{M}/base_lora/lora/adapter_model.safetensors",
        f"results/{M}/base/mmlu/{D}/base/mc_0shot.json",
        f"results/{M}/{V}/mmlu/{D}/transfer_lora/mc_0shot.json",
        f"results/{M}/{C}/mmlu/{D}/converted/mc_0shot.json",
        f"results/{M}/{V}/quality/{D}/perplexity.csv",
        f"results/{M}/{V}/quality/{D}/passkey.csv",
        f"results/{M}/{L}/quality/{D}/components.csv",
        f"results/{M}/{L}/quality/{D}/books.csv",
        f"results/{M}/{L}/quality/{D}/niah.csv",
        f"results/plots/{M}/books_nll_{D}.png",
        f"results/{M}/throughput/{D}.csv",
        "resources/data/transfer/tiny/L64_N2048.json",
        "resources/data/transfer/tiny/L128_N1024.json",
        "logs/benchmarks/report.tsv",
        f"results/{M}/base/zeroshot/{D}/base.json",
        f"results/{M}/{L}/zeroshot/{D}/transfer_lora.json",
    ):
        assert (wf / rel).is_file(), rel
    assert 'id="zeroshot"' in html  # the zero-shot suite's table (base and zeroshot.variants)
    # each variant's quality tables hold its stages and the shared ones, base and control included
    for variant, stages in SLOTS.items():
        table = (wf / f"results/{M}/{variant}/quality/{D}/perplexity.csv").read_text().splitlines()[1:]
        assert {line.split(",")[0] for line in table} == {"base", *stages, "base_lora"}
    # the LoLCATs variant's LoRA distilled from the base model and trained its feature maps
    lora = json.loads((wf / f"results/{M}/{L}/lora/metrics.json").read_text())
    assert lora["objective"] == "distill" and lora["val_metric"] == "kl"
    assert "model.layers.2.self_attn.feature_map" in lora["modules_to_save"]
    # both of its stages trained at shifted positions, drawn as config/test.yaml asks
    transfer = json.loads((wf / f"results/{M}/{L}/transfer/metrics.json").read_text())
    assert transfer["train"]["max_position"] == 1024 and lora["lora"]["max_position"] == 1024
    assert transfer["train"]["position_draw"] == "cover" and lora["lora"]["position_draw"] == "uniform"
    # the window-only control's share of the normalizer is the window's, entirely
    shares = (wf / f"results/{M}/{C}/quality/{D}/components.csv").read_text().splitlines()[1:]
    assert shares and all(float(line.split(",")[3]) == 1.0 for line in shares)
    # throughput measures the trained variants, not the control; the longest length base and the
    # recommended variant (lc16) only
    lines = [line.split(",") for line in (wf / f"results/{M}/throughput/{D}.csv").read_text().splitlines()]
    rows = [dict(zip(lines[0], line)) for line in lines[1:]]
    assert {r["variant"] for r in rows} == {"base", f"{V}/hybrid_chunked", f"{L}/hybrid_chunked"}
    longest = str(max(cfg["throughput"]["seq_lens"]))
    assert {r["variant"] for r in rows if r["seq_len"] == longest and r["status"] == "ok"} == {
        "base", f"{L}/hybrid_chunked"}
    # the long lengths of the books and the passkey: base and lc16 (books), lc16 alone (passkey)
    books = (wf / f"results/{M}/{L}/quality/{D}/books.csv").read_text().splitlines()[1:]
    long = cfg["quality"]["long_context"]["from_len"]
    assert {line.split(",")[0] for line in books if int(line.split(",")[1]) >= long} == {
        "base", "transfer", "transfer_lora"}
    passkey = (wf / f"results/{M}/{V}/quality/{D}/passkey.csv").read_text().splitlines()[1:]
    assert passkey and all(int(line.split(",")[1]) < long for line in passkey)
    niah = (wf / f"results/{M}/{L}/quality/{D}/niah.csv").read_text().splitlines()[1:]
    assert {(line.split(",")[1], int(line.split(",")[2])) for line in niah if line.startswith("transfer_lora,")} == {
        (h, n) for h in ("filler", "book") for n in cfg["quality"]["long_context"]["niah"]["context_lens"]}
    assert 'class="recommended"' in html and "Recommended: lc16" in html
    # lc16 keeps base's best-ranked KV head of its layers exact (softmax_heads: {top: 1}), through
    # training and export
    ranking = json.loads((wf / f"results/{M}/retrieval_heads.json").read_text())
    best = next([h["layer"], h["kv_head"]] for h in ranking["heads"] if h["layer"] in (0, 2))
    exported = json.loads((wf / f"results/{M}/{L}/model/config.json").read_text())
    assert exported["hybrid"]["softmax_heads"] == [best] and len(ranking["heads"]) == 4 * 2


# A fresh process: load an exported directory through the Auto classes (after `import hybrid_llama`
# unless told not to) and save its logits and greedy tokens for a fixed prompt.
_AUTO_LOAD = """
import sys, torch
from safetensors.torch import save_file
if sys.argv[3] == "import":
    import hybrid_llama
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.tensor([list(range(40, 100))])
with torch.no_grad():
    logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
save_file({"logits": logits, "tokens": tokens}, sys.argv[2])
print(type(model).__name__)
"""


@pytest.mark.slow
@pytest.mark.parametrize("variant", [V, L])
def test_exported_model_loads_like_the_pipeline(built, tmp_path, variant):
    """The exported model's acceptance on the test DAG: in a fresh process, `import hybrid_llama` +
    AutoModelForCausalLM gives the stage loader's logits (the model the evaluations scored) and
    its greedy tokens; without the import the same call fails instead of returning a Llama."""
    import torch
    from safetensors.torch import load_file
    from snakemake.utils import validate

    from hybrid_llama.eval.retrieval_heads import ranked_softmax_heads
    from hybrid_llama.pipeline import Pipeline
    from hybrid_llama.stages import load_stage

    wf, cfg, _ = built
    export = wf / f"results/{M}/{variant}/model"
    run = lambda how: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _AUTO_LOAD, str(export), str(tmp_path / f"{how}.safetensors"), how],
        capture_output=True, text=True, env=_env(), timeout=600)
    out = run("import")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "HybridLlamaForCausalLM"
    got = load_file(str(tmp_path / "import.safetensors"))

    cfg = copy.deepcopy(cfg)
    validate(cfg, str(REPO / "config" / "schema.yaml"))
    pipe = Pipeline(cfg, REPO)
    stage = pipe.export_stage(variant)
    assert stage == "transfer_lora"
    files = pipe.stage_inputs(M, variant, stage)
    # lc16 keeps ranked heads (softmax_heads: {top: 1}): the pairs come from the run's ranking
    ranking = wf / files["retrieval_heads"] if "retrieval_heads" in files else None
    hybrid = ranked_softmax_heads(pipe.hybrid(variant), ranking)
    model, _ = load_stage(wf / Path(files["weights"]).parent, stage, hybrid=hybrid,
                          hybrid_layers=wf / files["layers"], adapter=(wf / files["adapter"]).parent)
    ids = torch.tensor([list(range(40, 100))])  # 60 tokens: far beyond the window of 16
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], model(ids).logits, rtol=1.3e-6, atol=1e-5)  # fp32
        tokens = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(got["tokens"], tokens)

    out = run("plain")
    assert out.returncode != 0 and not (tmp_path / "plain.safetensors").exists()
    assert "does not recognize this architecture" in out.stderr and "hybrid_llama" in out.stderr


@pytest.mark.slow
def test_exported_model_cards_quote_the_result_files(built):
    from hybrid_llama.eval.tables import read_perplexity_csv

    wf, _, _ = built
    html = (wf / "results" / "report.html").read_text()
    for variant in (V, L):
        card = (wf / f"results/{M}/{variant}/model/README.md").read_text()
        header, body = card.split("---\n")[1], card.split("---\n", 2)[2]
        assert "library_name: transformers" in header and "pipeline_tag: text-generation" in header
        assert "base_model:" not in header  # a random model has none
        transfer = json.loads((wf / f"results/{M}/{variant}/transfer/metrics.json").read_text())
        lora = json.loads((wf / f"results/{M}/{variant}/lora/metrics.json").read_text())
        assert f"| {transfer['train_tokens']:,} |" in body and f"| {lora['train_tokens']:,} |" in body
        rows = read_perplexity_csv(wf / f"results/{M}/{variant}/quality/{D}/perplexity.csv")
        for r in rows:
            if r["stage"] == "transfer_lora":
                assert f"| {r['context_len']} | {r['nll']:.3f} |" in body
        assert "Passkey retrieval" in body and "Decode cache" in body
        assert f"pretrained=results/{M}/{variant}/model" in body
        # the report links the directory and its card, relative to the report
        assert f'href="{M}/{variant}/model/README.md"' in html and f'href="{M}/{variant}/model/"' in html
    assert not (wf / f"results/{M}/{C}/model").exists()  # the untrained control is not exported


@pytest.mark.slow
def test_second_run_does_nothing(built):
    wf, cfg, _ = built
    assert _plan(wf, cfg, "same") == set()


@pytest.mark.slow
def test_lora_change_reruns_only_lora_and_dependents(built):
    wf, cfg, _ = built
    cfg = copy.deepcopy(cfg)
    cfg["lora"]["r"] = cfg["lora"]["r"] // 2
    expected = (
        {
            ("lora", f"results/{M}/{V}/lora/adapter_model.safetensors"),
            ("lora", f"results/{M}/{L}/lora/adapter_model.safetensors"),
            ("base_lora", f"results/{M}/base_lora/lora/adapter_model.safetensors"),
            ("plot_lora_loss", f"results/plots/{M}/{V}/lora_loss.png"),
            ("plot_lora_loss", f"results/plots/{M}/{L}/lora_loss.png"),
            ("plot_lora_loss", f"results/plots/{M}/base_lora/lora_loss.png"),
        }
        | _stage_jobs(V, "transfer_lora")
        | _stage_jobs(L, "transfer_lora")
        | _stage_jobs("base_lora", "base_lora")
        # every variant's perplexity and passkey tables hold the base_lora control's rows
        | _tables(V)
        | _tables(L)
        | _tables(C, ("perplexity", "passkey", "books", "niah"))
        | _exports(V, L)
        # the zero-shot suite scores L's final stage (test.yaml's zeroshot.variants); base's stays
        | {("zeroshot", f"results/{M}/{L}/zeroshot/{D}/transfer_lora.json")}
        | REPORT
    )
    assert _plan(wf, cfg, "lora_r") == expected


@pytest.mark.slow
def test_window_change_reruns_transfer_onward(built):
    wf, cfg, _ = built
    cfg = copy.deepcopy(cfg)
    cfg["variants"][0]["hybrid"]["window"] = 8
    expected = (
        {
            ("transfer", f"results/{M}/{V}/transfer/hybrid_layers.safetensors"),
            ("lora", f"results/{M}/{V}/lora/adapter_model.safetensors"),
            ("plot_transfer_loss", f"results/plots/{M}/{V}/transfer_loss.png"),
            ("plot_lora_loss", f"results/plots/{M}/{V}/lora_loss.png"),
            # throughput compares the variants' hybrid layouts, so it depends on the window too
            ("throughput", f"results/{M}/throughput/{D}.csv"),
            ("plot_throughput", f"results/plots/{M}/throughput_{D}.png"),
        }
        | _stage_jobs(V, "transfer")
        | _stage_jobs(V, "transfer_lora")
        | _tables(V)
        # V's model changed; L's card quotes the throughput file, which is measured again
        | _exports(V, L)
        | REPORT
    )
    assert _plan(wf, cfg, "window") == expected


@pytest.mark.slow
def test_corpus_change_repacks_and_retrains_only_that_variant(built):
    wf, cfg, _ = built
    cfg = copy.deepcopy(cfg)
    cfg["variants"][1]["transfer"]["num_tokens"] = 768
    planned = _plan(wf, cfg, "corpus")
    assert ("transfer_data", "resources/data/transfer/tiny/L128_N768.safetensors") in planned
    assert {j for j in planned if j[0] in ("transfer", "lora", "base_lora")} == {
        ("transfer", f"results/{M}/{L}/transfer/hybrid_layers.safetensors"),
        ("lora", f"results/{M}/{L}/lora/adapter_model.safetensors"),
    }
    # the held-out text is the same, but perplexity and the diagnostic read every corpus' manifest
    assert not any(
        j[1] and f"/{V}/" in j[1]
        and j[0] not in ("perplexity", "components", "quality_table", "plot_quality", "export")
        for j in planned
    )
    assert _exports(V, L) <= planned  # V's card quotes its perplexity table, which is computed again


@pytest.mark.slow
def test_adding_shots_adds_only_those_mmlu_jobs(built):
    wf, cfg, _ = built
    cfg = copy.deepcopy(cfg)
    cfg["mmlu"]["shots"] = cfg["mmlu"]["shots"] + [1]
    new = {("mmlu", f"results/{M}/{slot}/mmlu/{D}/{stage}/mc_1shot.json") for slot, stage in ALL_SLOTS}
    assert _plan(wf, cfg, "shots") == new | REPORT


@pytest.mark.slow
def test_editing_a_script_reruns_that_rule(built):
    wf, cfg, _ = built
    script = wf / "workflow" / "scripts" / "passkey.py"
    original, stat = script.read_text(), script.stat()
    try:
        script.write_text(original + "\n# edited\n")
        expected = {("passkey", f"results/{M}/{slot}/quality/{D}/{stage}/passkey.csv") for slot, stage in ALL_SLOTS}
        expected |= (
            _tables(V, ("passkey",))
            | _tables(L, ("passkey",))
            | _tables(C, ("passkey",))
            | _exports(V, L)
            | {("report", "results/report.html"), ("all", None)}
        )
        assert _plan(wf, cfg, "script") == expected
    finally:
        script.write_text(original)
        os.utime(script, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.slow
def test_snakemake_report(built):
    wf, cfg, _ = built
    out = snakemake(
        wf, "--report", "results/snakemake-report.html", configfile=wf / "config" / "test.yaml", timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = (wf / "results" / "snakemake-report.html").read_text(errors="replace")
    assert "mmlu" in text.lower() and len(text) > 10_000


# ------------------------------------------------------------------------------------------ devices


def test_require_device():
    import torch

    from hybrid_llama.runtime import require_device

    assert require_device("cpu") == "cpu"
    if torch.cuda.is_available():
        assert require_device("cuda-h100") == "cuda"
        return
    for device in ("cuda", "cuda:1", "cuda:0-h100"):
        with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
            require_device(device)


# ------------------------------------------------------------------------------------------ memory

# A fresh process frees a 64 MB tensor (above glibc's largest mmap threshold) and reports whether
# keep_freed_memory took effect and how much of the tensor its resident memory still holds.
_FREED_MEMORY_PROBE = """
import os, torch
from hybrid_llama.runtime import keep_freed_memory
kept = keep_freed_memory()
def resident(): return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
before = resident()
x = torch.ones(64 * 2**20 // 4)
del x
print(kept, (resident() - before) / 2**20)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or platform.libc_ver()[0] != "glibc",
                    reason="needs Linux with glibc")
def test_keep_freed_memory_keeps_a_freed_tensor_resident_for_reuse():
    def probe(switch: str) -> tuple[str, float]:
        env = {**os.environ, "HYBRID_LLAMA_KEEP_FREED_MEMORY": switch}
        out = subprocess.run([sys.executable, "-c", _FREED_MEMORY_PROBE], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0], float(out[1])

    kept, held_mb = probe("1")
    assert kept == "True" and held_mb > 60  # the freed pages stay mapped: the next tensor reuses them
    kept, held_mb = probe("0")
    assert kept == "False" and held_mb < 8  # glibc's default: unmapped on free, zero-filled again next time
