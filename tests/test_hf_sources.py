"""The ``kind: hf`` data paths, exercised offline.

Each fixture builds a local directory laid out like the Hugging Face Hub dataset repository it stands
for (README.md front matter with ``configs``, parquet/jsonl files where the Hub keeps them), filled
with the real rows of ../shared/data. ``datasets.load_dataset(<dir>, <config>, split=...)`` resolves
such a directory exactly as it resolves the Hub id (same builder, same config and split selection,
same file order), so the hf code paths run unchanged; the local-file path of the same rows is the
independent reference every test compares against.

Nothing here may reach the network: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set, every cache is
redirected under a tmp dir, and opening an AF_INET/AF_INET6 socket raises.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from hybrid_llama.data import (
    DataError,
    iter_documents,
    iter_rows,
    load_instruct,
    load_packed,
    prepare_instruct_data,
    prepare_transfer_corpus,
)
from hybrid_llama.pipeline import Pipeline, shared_data_dir

REPO = Path(__file__).resolve().parents[1]
SHARED = shared_data_dir()
EDU = SHARED / "fineweb-edu" / "fineweb-edu-sample-10BT.150docs.text.jsonl"
DOLLY = SHARED / "dolly" / "databricks-dolly-15k.head.jsonl"
MMLU = SHARED / "mmlu"
# The repo holds three subjects; evaluation uses two (short questions: 5-shot fits the tiny model).
MMLU_REPO_SUBJECTS = ["abstract_algebra", "anatomy", "college_mathematics"]
MMLU_EVAL_SUBJECTS = ["abstract_algebra", "college_mathematics"]
MMLU_LIMIT = 4

pytestmark = pytest.mark.skipif(
    not (EDU.is_file() and DOLLY.is_file() and (MMLU / "dev").is_dir()), reason=f"no shared data under {SHARED}"
)


# ------------------------------------------------------------------------------------ offline env


def _offline_env(cache: Path) -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cache / "hf_home"),
        "HF_DATASETS_CACHE": str(cache / "datasets"),
        "HF_MODULES_CACHE": str(cache / "modules"),
    }


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_cache")


@pytest.fixture(scope="module", autouse=True)
def offline(hf_cache):
    """Offline mode and tmp caches for this module (env for subprocesses, module attributes for this
    process: ``datasets`` and ``huggingface_hub`` read the env only at import), and no IP sockets."""
    import datasets
    import huggingface_hub.constants as hub_constants

    mp = pytest.MonkeyPatch()
    for key, value in _offline_env(hf_cache).items():
        mp.setenv(key, value)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    mp.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_CACHE_HOME", hf_cache / "hf_home")
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", hf_cache / "datasets")
    mp.setattr(datasets.config, "HF_MODULES_CACHE", hf_cache / "modules")
    mp.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", hf_cache / "datasets" / "downloads")
    mp.setattr(datasets.config, "EXTRACTED_DATASETS_PATH", hf_cache / "datasets" / "downloads" / "extracted")

    real_connect = socket.socket.connect

    def no_network(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"test tried to reach the network: {address}")
        return real_connect(self, address)

    mp.setattr(socket.socket, "connect", no_network)
    yield
    mp.undo()


# ------------------------------------------------------------------------------------ fake Hub repos


def _edu_texts() -> list[str]:
    return [json.loads(line)["text"] for line in EDU.read_text(encoding="utf-8").splitlines()]


def _card(front_matter: dict, title: str) -> str:
    return "---\n" + yaml.safe_dump(front_matter, sort_keys=False) + "---\n\n# " + title + "\n"


@pytest.fixture(scope="module")
def fineweb_repo(tmp_path_factory) -> Path:
    """HuggingFaceFW/fineweb-edu's layout: ``sample/10BT/NNN_00000.parquet`` shards (the 150 real
    documents, split over three shards in order) and a ``default`` config over ``data/*/*`` that holds
    other rows, so selecting the wrong config shows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("hub") / "fineweb-edu"
    texts = _edu_texts()
    (root / "sample" / "10BT").mkdir(parents=True)
    bounds = [0, 40, 95, len(texts)]  # uneven shards: order across and within shards must hold
    for k in range(3):
        part = texts[bounds[k] : bounds[k + 1]]
        table = pa.table(
            {
                "text": part,
                "id": [f"<urn:uuid:{bounds[k] + i:08d}>" for i in range(len(part))],
                "token_count": pa.array([len(t.split()) for t in part], pa.int64()),
            }
        )
        pq.write_table(table, root / "sample" / "10BT" / f"{k:03d}_00000.parquet")
    (root / "data" / "CC-MAIN-2024-10").mkdir(parents=True)
    decoy = ["A document of the default config, not of sample-10BT."] * 7
    pq.write_table(
        pa.table({"text": decoy, "id": ["x"] * 7, "token_count": pa.array([9] * 7, pa.int64())}),
        root / "data" / "CC-MAIN-2024-10" / "000_00000.parquet",
    )
    card = {
        "license": "odc-by",
        "configs": [
            {"config_name": "default", "data_files": [{"split": "train", "path": "data/*/*"}]},
            {"config_name": "sample-10BT", "data_files": [{"split": "train", "path": "sample/10BT/*"}]},
        ],
    }
    (root / "README.md").write_text(_card(card, "FineWeb-Edu (offline test copy)"))
    return root


@pytest.fixture(scope="module")
def dolly_repo(tmp_path_factory) -> Path:
    """databricks/databricks-dolly-15k's layout: one ``databricks-dolly-15k.jsonl`` at the root and a
    card without ``configs`` (the json builder infers a single ``train`` split)."""
    root = tmp_path_factory.mktemp("hub") / "databricks-dolly-15k"
    root.mkdir()
    shutil.copyfile(DOLLY, root / "databricks-dolly-15k.jsonl")
    card = {
        "license": "cc-by-sa-3.0",
        "task_categories": ["question-answering", "summarization"],
        "language": ["en"],
        "size_categories": ["10K<n<100K"],
    }
    (root / "README.md").write_text(_card(card, "databricks-dolly-15k (offline test copy)"))
    return root


def _mmlu_csv_rows(split: str, subject: str) -> list[dict]:
    from hybrid_llama.eval.mmlu import read_mmlu_csv

    return read_mmlu_csv(MMLU / split / f"{subject}_{split}.csv", subject)


@pytest.fixture(scope="module")
def mmlu_repo(tmp_path_factory) -> Path:
    """cais/mmlu's layout: ``<subject>/{test,dev}-00000-of-00001.parquet`` per subject plus ``all/``,
    one config per subject and ``all``, features as on the Hub (answer a ClassLabel A..D)."""
    import datasets

    features = datasets.Features(
        {
            "question": datasets.Value("string"),
            "subject": datasets.Value("string"),
            "choices": datasets.Sequence(datasets.Value("string")),
            "answer": datasets.ClassLabel(names=list("ABCD")),
        }
    )
    root = tmp_path_factory.mktemp("hub") / "mmlu"
    configs = []
    for subject in [*MMLU_REPO_SUBJECTS, "all"]:
        (root / subject).mkdir(parents=True)
        files = []
        for split in ("test", "dev"):
            subjects = MMLU_REPO_SUBJECTS if subject == "all" else [subject]
            rows = [r for s in subjects for r in _mmlu_csv_rows(split, s)]
            datasets.Dataset.from_list(rows, features=features).to_parquet(
                str(root / subject / f"{split}-00000-of-00001.parquet")
            )
            files.append({"split": split, "path": f"{subject}/{split}-*"})
        configs.append({"config_name": subject, "data_files": files})
    (root / "README.md").write_text(_card({"license": "mit", "configs": configs}, "MMLU (offline test copy)"))
    return root


# ------------------------------------------------------------------------------------ 1. fineweb-edu


def _edu_hf(repo: Path, **extra) -> dict:
    return {"kind": "hf", "path": str(repo), "name": "sample-10BT", "split": "train", **extra}


def test_fineweb_hf_documents_equal_local_in_order(fineweb_repo):
    hf = list(iter_documents(_edu_hf(fineweb_repo)))
    local = list(iter_documents({"kind": "local", "path": str(EDU)}))
    assert len(local) == 150
    assert [t for t, _ in hf] == [t for t, _ in local] == _edu_texts()
    label = f"hf:{fineweb_repo}/sample-10BT:train"
    assert [o for _, o in hf] == [f"{label}: row {i}" for i in range(1, 151)]
    # Rows keep every column of the shards (the text column is picked by text_column).
    row, _ = next(iter_rows(_edu_hf(fineweb_repo)))
    assert set(row) == {"text", "id", "token_count"} and row["id"] == "<urn:uuid:00000000>"
    # The default config of the same repo is a different data set: the name selects.
    other = [t for t, _ in iter_documents({"kind": "hf", "path": str(fineweb_repo), "split": "train"})]
    assert len(other) == 7 and not set(other) & set(_edu_texts())


@pytest.mark.parametrize(
    "settings",
    [
        {"seq_len": 128, "num_tokens": 20_000},  # stops streaming once the budget is met
        {"seq_len": 256, "num_tokens": None},  # everything
        {"seq_len": 64, "num_tokens": 30_000, "split": "heldout", "heldout_fraction": 0.2, "seed": 3},
    ],
    ids=["budget", "all", "heldout"],
)
def test_fineweb_hf_corpus_equals_local(fineweb_repo, tiny_tokenizer, tmp_path, settings):
    hf_spec = _edu_hf(fineweb_repo)
    a = prepare_transfer_corpus(hf_spec, tiny_tokenizer, tmp_path / "hf.safetensors", **settings)
    b = prepare_transfer_corpus({"kind": "local", "path": str(EDU)}, tiny_tokenizer, tmp_path / "local.safetensors",
                                **settings)
    ta, tb = load_packed(tmp_path / "hf.safetensors"), load_packed(tmp_path / "local.safetensors")
    assert ta.shape == tb.shape and ta.shape[0] > 0
    assert torch.equal(ta, tb)
    for key in ("num_documents", "doc_hashes", "inputs_sha256", "token_count", "num_sequences"):
        assert a[key] == b[key], key
    if settings["num_tokens"] is None:
        assert a["num_documents"] == 150
    else:
        assert a["num_documents"] < 150
    assert a["source"] == hf_spec and a["files"] == []  # the manifest names the hf source
    assert b["source"]["kind"] == "local" and len(b["files"]) == 1


def test_fineweb_hf_errors_name_the_source(fineweb_repo, tiny_tokenizer, tmp_path):
    repo = re.escape(str(fineweb_repo))
    with pytest.raises(DataError, match=rf"hf:{repo}/sample-100BT:train: cannot open dataset.*sample-100BT"):
        list(iter_documents(_edu_hf(fineweb_repo, name="sample-100BT")))
    with pytest.raises(DataError, match=rf"hf:{repo}/sample-10BT:validation: cannot open dataset.*validation"):
        prepare_transfer_corpus(_edu_hf(fineweb_repo, split="validation"), tiny_tokenizer, tmp_path / "x.safetensors",
                                seq_len=64, num_tokens=1024)
    with pytest.raises(DataError, match=rf"hf:{re.escape(str(tmp_path))}/no-such-repo:train: cannot open dataset"):
        list(iter_rows({"kind": "hf", "path": str(tmp_path / "no-such-repo"), "split": "train"}))
    with pytest.raises(DataError, match=rf"hf:{repo}/sample-10BT:train: row 1: missing column 'content'"):
        list(iter_documents(_edu_hf(fineweb_repo, text_column="content")))
    with pytest.raises(DataError, match=rf"{repo}: only \d+ tokens in 150 documents"):
        prepare_transfer_corpus(_edu_hf(fineweb_repo), tiny_tokenizer, tmp_path / "x.safetensors",
                                seq_len=1024, num_tokens=10_000_000)
    assert not (tmp_path / "x.safetensors").exists()


def test_stream_failing_part_way_is_a_data_error(monkeypatch):
    """A Hub stream can break after some rows (connection reset, rate limit): the error names the
    source and how far it got, and the rows before it were yielded."""
    import datasets

    def flaky_stream(*args, **kwargs):
        yield {"text": "first"}
        yield {"text": "second"}
        raise ConnectionError("429 Too Many Requests")

    monkeypatch.setattr(datasets, "load_dataset", flaky_stream)
    got = []
    with pytest.raises(DataError, match=r"hf:org/data:train: reading failed after row 2 \(ConnectionError: 429"):
        for text, _origin in iter_documents({"kind": "hf", "path": "org/data", "split": "train"}):
            got.append(text)
    assert got == ["first", "second"]


def test_hub_id_offline_is_a_data_error():
    """The real Hub id, with no network and an empty cache: a DataError naming the source, promptly."""
    spec = {"kind": "hf", "path": "HuggingFaceFW/fineweb-edu", "name": "sample-10BT", "split": "train"}
    with pytest.raises(DataError, match=r"hf:HuggingFaceFW/fineweb-edu/sample-10BT:train: cannot open .*(?i:offline)"):
        next(iter_rows(spec))


# ------------------------------------------------------------------------------------ 2. dolly


@pytest.mark.parametrize("settings", [{"max_length": 256, "max_examples": 120, "val_fraction": 0.1},
                                      {"max_length": 96, "max_examples": None, "template": "plain"}],
                         ids=["config_yaml", "all_rows"])
def test_dolly_hf_instruct_equals_local(dolly_repo, tiny_tokenizer, tmp_path, settings):
    hf_spec = {"kind": "hf", "path": str(dolly_repo), "split": "train"}
    rows = [r for r, _ in iter_rows(hf_spec)]
    local_rows = [json.loads(line) for line in DOLLY.read_text().splitlines()]
    assert rows == local_rows and len(rows) == 208  # same columns, values and order

    a = prepare_instruct_data(hf_spec, tiny_tokenizer, tmp_path / "hf.safetensors", **settings)
    b = prepare_instruct_data({"kind": "local", "path": str(DOLLY)}, tiny_tokenizer, tmp_path / "local.safetensors",
                              **settings)
    assert a["num_rows"] == (settings["max_examples"] or 208)
    assert a["source"] == hf_spec and a["files"] == []
    drop = {"source", "files"}
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    for split in ("train", "val"):
        ha, hb = load_instruct(tmp_path / "hf.safetensors", split), load_instruct(tmp_path / "local.safetensors", split)
        assert ha.keys() == hb.keys()
        for k in ha:
            assert torch.equal(ha[k], hb[k]), (split, k)


# ------------------------------------------------------------------------------------ 3. MMLU


def test_mmlu_hf_configs_hold_the_csv_rows(mmlu_repo):
    """The repo as lm-eval will load it (non-streaming, per-subject config, test and dev splits)."""
    import datasets

    for subject in MMLU_REPO_SUBJECTS:
        ds = datasets.load_dataset(str(mmlu_repo), subject)
        assert set(ds) == {"test", "dev"}
        assert ds["test"].features["answer"].names == list("ABCD")
        for split in ("test", "dev"):
            assert ds[split].to_list() == _mmlu_csv_rows(split, subject), (subject, split)
    # The datasets cache (arrow files of the non-streaming load) went to the tmp cache, not ~.
    assert any(datasets.config.HF_DATASETS_CACHE.rglob("*.arrow"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from hybrid_llama.models import load_model

    return load_model(tiny_model_dir, dtype=torch.float32)


MMLU_RUNS = [("mc", 0), ("mc", 5), ("cloze", 1)]


@pytest.fixture(scope="module")
def mmlu_runs(tiny, mmlu_repo):
    from hybrid_llama.eval.mmlu import run_mmlu

    model, tok = tiny
    out = {}
    for fmt, shots in MMLU_RUNS:
        sources = {"hf": {"kind": "hf", "id": str(mmlu_repo)}, "local": {"kind": "local", "path": str(MMLU)}}
        for name, data in sources.items():
            out[name, fmt, shots] = run_mmlu(model, tok, data=data, shots=shots, fmt=fmt, limit=MMLU_LIMIT,
                                             subjects=MMLU_EVAL_SUBJECTS, batch_size=4, device="cpu", log_prompts=True)
    return out


@pytest.mark.parametrize("fmt,shots", MMLU_RUNS)
def test_mmlu_hf_matches_local(mmlu_runs, mmlu_repo, fmt, shots):
    from hybrid_llama.eval.mmlu import compare

    hf, local = mmlu_runs["hf", fmt, shots], mmlu_runs["local", fmt, shots]
    assert hf["data"] == {"kind": "hf", "id": str(mmlu_repo)}
    assert hf["subjects"] == local["subjects"] == MMLU_EVAL_SUBJECTS
    n = MMLU_LIMIT * len(MMLU_EVAL_SUBJECTS)
    assert len(hf["questions"]) == len(local["questions"]) == n
    # Same questions in the same order, same prompts and scores, hence same predictions and accuracies.
    assert hf["questions"] == local["questions"]
    c = compare(hf, local)
    assert (c["n_common"], c["n_only_a"], c["n_only_b"], c["n_changed"]) == (n, 0, 0, 0)
    assert c["prompts_differ"] == 0 and c["max_abs_ll_diff"] == 0.0
    assert hf["per_subject"] == local["per_subject"] and hf["aggregate"] == local["aggregate"]
    # ... and those are the CSV rows (not another subject's config, not shuffled, right few-shot rows).
    for subject in MMLU_EVAL_SUBJECTS:
        test, dev = _mmlu_csv_rows("test", subject), _mmlu_csv_rows("dev", subject)
        qs = [q for q in hf["questions"] if q["subject"] == subject]
        assert [q["doc_id"] for q in qs] == list(range(MMLU_LIMIT))
        for q in qs:
            row = test[q["doc_id"]]
            assert q["gold"] == "ABCD"[row["answer"]]
            assert row["question"].strip() in q["prompt"].split("\n\n")[-1]
            for shot in dev[:shots]:
                assert shot["question"].strip() in q["prompt"]
            for shot in dev[shots:]:
                assert shot["question"].strip() not in q["prompt"]


def test_mmlu_hf_task_yaml_points_at_repo_config(mmlu_repo, tmp_path):
    from hybrid_llama.eval.mmlu import write_task_yamls

    write_task_yamls({"kind": "hf", "id": str(mmlu_repo), "revision": "main"}, ["anatomy"], "mc", tmp_path)
    cfg = yaml.safe_load((tmp_path / "hl_mmlu_mc_anatomy.yaml").read_text())
    assert (cfg["dataset_path"], cfg["dataset_name"]) == (str(mmlu_repo), "anatomy")
    assert cfg["dataset_kwargs"] == {"revision": "main"}
    assert (cfg["test_split"], cfg["fewshot_split"]) == ("test", "dev")


def _run_workflow_script(script: str, sm: dict, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run a workflow script with a stand-in ``snakemake`` object, as Snakemake's ``script:`` does."""
    driver = textwrap.dedent(
        f"""
        import runpy, sys, types
        sys.path.insert(0, {str(REPO / "workflow" / "scripts")!r})
        sm = {sm!r}
        snakemake = types.SimpleNamespace(
            output=types.SimpleNamespace(**sm["output"]), params=types.SimpleNamespace(**sm["params"]),
            log=sm["log"], rule=sm["rule"], wildcards={{}}, threads=1)
        runpy.run_path({str(REPO / "workflow" / "scripts" / script)!r}, init_globals={{"snakemake": snakemake}},
                       run_name="__main__")
        """
    )
    return subprocess.run([sys.executable, "-c", driver], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_mmlu_download_script_writes_the_local_layout(mmlu_repo, hf_cache, tmp_path):
    """The workflow's MMLU hf path: rule mmlu_download (config 'all') writes the mirror's CSV layout,
    which must read back as exactly the shared CSV rows."""
    from hybrid_llama.eval.mmlu import _local_subjects, read_mmlu_csv

    env = {**os.environ, **_offline_env(hf_cache / "subprocess"), "OMP_NUM_THREADS": "1"}
    sm = {"output": {"manifest": "resources/data/mmlu/manifest.json"}, "params": {"id": str(mmlu_repo)},
          "log": [str(tmp_path / "mmlu_download.log")], "rule": "mmlu_download"}
    proc = _run_workflow_script("mmlu_download.py", sm, tmp_path, env)
    log = (tmp_path / "mmlu_download.log").read_text() if (tmp_path / "mmlu_download.log").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + log[-3000:]
    root = tmp_path / "resources" / "data" / "mmlu"
    assert _local_subjects(root) == MMLU_REPO_SUBJECTS
    for split in ("dev", "test"):
        for subject in MMLU_REPO_SUBJECTS:
            got = read_mmlu_csv(root / split / f"{subject}_{split}.csv", subject)
            assert got == _mmlu_csv_rows(split, subject), (split, subject)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["source"] == {"kind": "hf", "id": str(mmlu_repo)}
    assert manifest["rows"] == {s: sum(len(_mmlu_csv_rows(s, x)) for x in MMLU_REPO_SUBJECTS) for s in ("dev", "test")}
    assert len(manifest["files"]) == 2 * len(MMLU_REPO_SUBJECTS)


# ------------------------------------------------------------------------------------ 4. workflow config


def _pipeline(config: dict) -> Pipeline:
    """The workflow's view of ``config`` (hybrid_llama.pipeline), after schema validation as the
    Snakefile does it."""
    from snakemake.utils import validate

    config = copy.deepcopy(config)
    validate(config, str(REPO / "config" / "schema.yaml"))
    return Pipeline(config, REPO)


def test_workflow_config_source_hf_resolves_to_tested_specs(fineweb_repo, dolly_repo, tiny_tokenizer, tmp_path,
                                                            monkeypatch):
    monkeypatch.chdir(tmp_path)  # the pipeline looks for resources/weights/* relative to the working dir
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["shared_data"] = str(SHARED)
    cfg["data"]["transfer"].update(source="hf", hf={"path": str(fineweb_repo), "name": "sample-10BT", "split": "train"})
    cfg["data"]["instruct"].update(source="hf", hf={"path": str(dolly_repo), "split": "train"})
    smk = _pipeline(cfg)

    transfer = smk.data_source("transfer")
    assert transfer == {"kind": "hf", "name": "sample-10BT", "path": str(fineweb_repo), "split": "train",
                        "text_column": "text"}
    assert smk.local_data_inputs("transfer") == []
    instruct = smk.data_source("instruct")
    assert instruct == {"kind": "hf", "path": str(dolly_repo), "split": "train"}

    # The same config with source local: the rules' specs and settings give identical outputs.
    local_cfg = copy.deepcopy(cfg)
    local_cfg["data"]["transfer"]["source"] = local_cfg["data"]["instruct"]["source"] = "local"
    local = _pipeline(local_cfg)
    assert local.data_source("transfer") == {"kind": "local", "path": str(EDU), "text_column": "text"}
    assert local.data_source("instruct") == {"kind": "local", "path": str(DOLLY)}

    variant = next(iter(smk.variants))  # what the transfer_data rule packs for this variant
    settings = smk.corpus_settings(**smk.corpus(variant))
    assert settings == local.corpus_settings(**local.corpus(variant)) and settings["split"] == "train"
    a = prepare_transfer_corpus(transfer, tiny_tokenizer, tmp_path / "t_hf.safetensors", **settings)
    b = prepare_transfer_corpus(local.data_source("transfer"), tiny_tokenizer, tmp_path / "t_local.safetensors",
                                **settings)
    assert a["num_sequences"] == settings["num_tokens"] // settings["seq_len"]
    assert a["doc_hashes"] == b["doc_hashes"]
    assert torch.equal(load_packed(tmp_path / "t_hf.safetensors"), load_packed(tmp_path / "t_local.safetensors"))

    isettings = smk.data_settings("instruct")
    a = prepare_instruct_data(instruct, tiny_tokenizer, tmp_path / "i_hf.safetensors", **isettings)
    b = prepare_instruct_data(local.data_source("instruct"), tiny_tokenizer, tmp_path / "i_local.safetensors",
                              **isettings)
    assert a["num_rows"] == isettings["max_examples"] and a["inputs_sha256"] == b["inputs_sha256"]
    for split in ("train", "val"):
        ha = load_instruct(tmp_path / "i_hf.safetensors", split)
        hb = load_instruct(tmp_path / "i_local.safetensors", split)
        assert all(torch.equal(ha[k], hb[k]) for k in ha)

    # MMLU with source hf goes through rule mmlu_download into a local copy (tested above).
    mcfg = copy.deepcopy(cfg)
    mcfg["data"]["mmlu"].update(source="hf", hf="cais/mmlu")
    msmk = _pipeline(mcfg)
    assert msmk.mmlu_data() == {"kind": "local", "path": "resources/data/mmlu"}
