"""The workflow on a real (one-node) SLURM cluster, through workflow/profiles/slurm.

tests/slurm/up.sh starts slurmctld + slurmd + munge on localhost with one fake GPU
(gres `File=/dev/null`); tests/slurm/down.sh stops them, also when a test fails.
The DAG of config/test.yaml, narrowed to one hybrid variant (``slurm_config``), runs through the
SLURM executor plugin; the test checks that the jobs went through sbatch, that the results equal a
local run's, and that jobs asking for the one GPU never ran at the same time.

Run: `pytest -m slurm tests/test_slurm.py` as root (installs Debian packages on first use).
The profile checks at the bottom need no cluster and run in the normal suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SLURM_PROFILE = REPO / "workflow" / "profiles" / "slurm" / "config.yaml"
DEFAULT_PROFILE = REPO / "workflow" / "profiles" / "default" / "config.yaml"
TEST_CONFIG = REPO / "config" / "test.yaml"
UP = REPO / "tests" / "slurm" / "up.sh"
DOWN = REPO / "tests" / "slurm" / "down.sh"

# In this CPU-only test these rules ask for the fake GPU although they run on the CPU, so that
# SLURM has several gpu=1 jobs to keep apart (on a real cluster the rules ask for it when their
# device is cuda).
FAKE_GPU_RULES = ("transfer", "lora", "base_lora", "mmlu")
# This one asks for the fake GPU by its model (up.sh: `Gres=gpu:testgpu:1`), through `gpu_model`.
TYPED_GPU_RULE = "lora"
# Rules that run on the submitting host (localrules in the workflow) or are not jobs at all.
HOST_RULES = {"weights", "transfer_data", "instruct_data", "mmlu_download", "all"}
# The one hybrid variant of config/test.yaml the cluster run keeps (as the recommended one). Every
# rule still runs; the other variants would add jobs of the same rules, and every job costs two
# Snakemake starts inside SLURM (about 2.5 s of CPU each) besides its own work. The local test DAG
# (tests/test_workflow.py) runs them all.
SLURM_VARIANT = "lc16"
# Deterministic artifacts a local run makes too, compared with the cluster's.
COMPARED = [
    "resources/data/transfer/tiny/L128_N1024.safetensors",  # SLURM_VARIANT's transfer rows
    "resources/data/instruct/tiny.safetensors",
    f"results/tiny/{SLURM_VARIANT}/transfer/hybrid_layers.safetensors",
    f"results/tiny/{SLURM_VARIANT}/lora/adapter_model.safetensors",
    "results/tiny/base_lora/lora/adapter_model.safetensors",
    "results/tiny/base/mmlu/cpu/base/mc_0shot.json",
    f"results/tiny/{SLURM_VARIANT}/mmlu/cpu/transfer/mc_0shot.json",
    f"results/tiny/{SLURM_VARIANT}/mmlu/cpu/transfer_lora/mc_0shot.json",
    "results/tiny/base_lora/mmlu/cpu/base_lora/mc_0shot.json",
]
RUN_TIMEOUT_S = 3600


# ---------------------------------------------------------------------------------------------
# helpers


def snakemake_cmd(workdir: Path, *args: str, overlay: Path | None = None) -> list[str]:
    return [
        sys.executable, "-m", "snakemake",
        "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir),
        *args,
        # last: --configfile takes every path that follows it
        "--configfile", str(TEST_CONFIG), *([str(overlay)] if overlay else []),
    ]  # fmt: skip


def slurm_config(tmp: Path) -> Path:
    """A config file laid over config/test.yaml (Snakemake merges it key by key, lists replaced)
    that keeps only SLURM_VARIANT among the variants and makes it the recommended one."""
    variants = yaml.safe_load(TEST_CONFIG.read_text())["variants"]
    overlay = {
        "variants": [v for v in variants if v["name"] == SLURM_VARIANT],
        "recommended": SLURM_VARIANT,
        "zeroshot": {"variants": [SLURM_VARIANT]},
    }
    out = tmp / "slurm-config.yaml"
    out.write_text(yaml.safe_dump(overlay, sort_keys=False))
    return out


def run_snakemake(cmd: list[str], log: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=RUN_TIMEOUT_S)
    text = log.read_text()
    assert proc.returncode == 0, f"snakemake failed ({proc.returncode}):\n{text[-6000:]}"
    return text


def site_profile(tmp: Path) -> Path:
    """workflow/profiles/slurm adapted to the test cluster, the way docs/cluster.md tells a user
    to adapt it to a site: memory that fits the node (21 GB, 2 CPUs), one CPU per job so that
    two jobs share the node, quick status polling, SLURM logs kept for the assertions. The
    partitions (cpu, gpu) are the profile's own: up.sh creates them."""
    prof = yaml.safe_load(SLURM_PROFILE.read_text())
    prof["default-resources"] = {**prof["default-resources"], "mem_mb": 1500, "runtime": 30}
    set_res = {rule: dict(res) for rule, res in prof.get("set-resources", {}).items()}
    for res in set_res.values():
        if "mem_mb" in res:
            res["mem_mb"] = 1500
    for rule in FAKE_GPU_RULES:
        set_res.setdefault(rule, {})["gpu"] = 1
    # one rule asks for the GPU by model, as a `cuda-<model>` device does in the real profile
    set_res[TYPED_GPU_RULE]["gpu_model"] = "testgpu"
    prof["set-resources"] = set_res
    prof["set-threads"] = {rule: 1 for rule in prof.get("set-threads", {})}
    prof["slurm-init-seconds-before-status-checks"] = 2
    prof["slurm-keep-successful-logs"] = True
    prof["latency-wait"] = 5
    prof["keep-going"] = False
    out = tmp / "site-profile"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(prof, sort_keys=False))
    return out


def parse_kv_line(line: str) -> dict:
    """`Key=Value Key2=Value2 ...` of a jobcomp/filetxt record (values have no spaces)."""
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


def slurm_time(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S").timestamp()


def jobcomp_records(path: Path, run_id: str) -> dict[str, dict]:
    """jobcomp records of this run's SLURM jobs (job name = the plugin's run id), by job id."""
    records = {}
    for line in path.read_text().splitlines():
        rec = parse_kv_line(line)
        if rec.get("Name") == run_id:
            records[rec["JobId"]] = rec
    return records


def scontrol_job(job_id: str) -> dict:
    """`scontrol show job` fields of a job (finished jobs stay visible for MinJobAge, set by up.sh)."""
    proc = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return parse_kv_line(proc.stdout)


def slurm_logs(workdir: Path) -> dict[str, tuple[str, str]]:
    """SLURM job id -> (rule, wildcards) from the plugin's logs:
    .snakemake/slurm_logs/rule_<rule>/<wildcards>/<jobid>.log"""
    base = workdir / ".snakemake" / "slurm_logs"
    out = {}
    for log in base.rglob("*.log"):
        parts = log.relative_to(base).parts
        assert parts[0].startswith("rule_"), log
        out[log.stem] = (parts[0][len("rule_"):], "/".join(parts[1:-1]))
    return out


def job_stats(log_text: str) -> dict[str, int]:
    """Snakemake's 'Job stats' table (rule -> count) from the first time it is printed."""
    lines = log_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Job stats:"))
    counts = {}
    for line in lines[start + 3 :]:
        name, _, count = line.partition(" ")
        if name == "total":
            break
        counts[name] = int(count)
    return counts


def assert_same_artifact(rel: str, local: Path, cluster: Path) -> None:
    a, b = local / rel, cluster / rel
    assert a.is_file() and b.is_file(), rel
    if rel.endswith(".safetensors"):
        from safetensors.torch import load_file

        ta, tb = load_file(a), load_file(b)
        assert sorted(ta) == sorted(tb), rel
        for name in ta:
            # same seed, one thread each: the tensors are expected bit for bit equal
            assert ta[name].dtype == tb[name].dtype, (rel, name)
            assert ta[name].equal(tb[name]), f"{rel}: tensor {name} differs"
    elif rel.endswith(".json"):
        ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
        assert ja["aggregate"] == jb["aggregate"], rel
        assert ja["per_subject"] == jb["per_subject"], rel
        assert [q["loglikelihoods"] for q in ja["questions"]] == [
            q["loglikelihoods"] for q in jb["questions"]
        ], rel
        assert ja["model_hash"] == jb["model_hash"], rel
    else:
        assert a.read_bytes() == b.read_bytes(), rel


# ---------------------------------------------------------------------------------------------
# cluster fixture


@pytest.fixture(scope="session")
def slurm_cluster(request) -> dict:
    if os.geteuid() != 0:
        pytest.skip("the SLURM test needs root: tests/slurm/up.sh installs and starts slurmctld/slurmd/munge")
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        pytest.skip("no apt-get to install SLURM from (Debian/Ubuntu only)")

    def down() -> None:
        proc = subprocess.run([str(DOWN)], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            print(f"tests/slurm/down.sh failed:\n{proc.stderr}", file=sys.stderr)

    # registered before starting anything, so that a half-started cluster is stopped too
    request.addfinalizer(down)
    start = time.monotonic()
    proc = subprocess.run([str(UP)], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(f"could not install SLURM from Debian packages: {proc.stderr.strip()}")
    if proc.returncode:
        pytest.fail(f"tests/slurm/up.sh failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    info = dict(line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith("SLURM_UP_"))
    info["up_seconds"] = time.monotonic() - start
    print(f"SLURM up in {info['up_seconds']:.1f} s", file=sys.stderr)
    return info


# ---------------------------------------------------------------------------------------------
# the test


@pytest.mark.slurm
@pytest.mark.slow
def test_dag_on_slurm_matches_local_run(slurm_cluster, tmp_path):
    ctld_log = Path(slurm_cluster["SLURM_UP_CTLD_LOG"])
    jobcomp_log = Path(slurm_cluster["SLURM_UP_JOBCOMP_LOG"])
    ctld_offset = ctld_log.stat().st_size

    # --- the whole DAG through the SLURM profile ---
    cluster_dir = tmp_path / "cluster"
    overlay = slurm_config(tmp_path)
    start = time.monotonic()
    text = run_snakemake(
        snakemake_cmd(cluster_dir, "--workflow-profile", str(site_profile(tmp_path)), overlay=overlay),
        tmp_path / "cluster.log",
    )
    cluster_s = time.monotonic() - start
    assert (cluster_dir / "results" / "report.html").is_file()

    # --- every rule of the whole test DAG (every variant) ran with SLURM_VARIANT alone ---
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    assert set(job_stats(text)) == {j["rule"] for j in dry_run_jobs(DEFAULT_PROFILE.parent, full_dir)}

    # --- it went through sbatch ---
    run_id = re.search(r"SLURM run ID: (\S+)", text).group(1)
    records = jobcomp_records(jobcomp_log, run_id)
    logs = slurm_logs(cluster_dir)
    expected = {r: n for r, n in job_stats(text).items() if r not in HOST_RULES}
    seen: dict[str, int] = {}
    for rule, _ in logs.values():
        seen[rule] = seen.get(rule, 0) + 1
    assert seen == expected, "every non-local job must be one SLURM job"
    assert set(records) == set(logs), "SLURM's job records and the plugin's logs disagree"
    assert all(r["JobState"] == "COMPLETED" for r in records.values())
    submitted = set(re.findall(r"_slurm_rpc_submit_batch_job: JobId=(\d+)", ctld_log.read_text()[ctld_offset:]))
    assert set(records) <= submitted, "slurmctld did not log the submissions"
    # the profile's partitions: training on `gpu`, cpu-device evaluation and plots on `cpu`
    part = {logs[j][0]: r["Partition"] for j, r in records.items()}
    assert part["transfer"] == "gpu" and part["mmlu"] == "cpu" and part["report"] == "cpu"

    # --- the GPU requests SLURM got: typed for gpu_model, untyped for gpu=1, none for CPU jobs ---
    for job, (rule, _) in logs.items():
        tres = scontrol_job(job).get("TresPerJob", "")
        want = {TYPED_GPU_RULE: "gres:gpu:testgpu:1"}.get(rule, "gres:gpu:1" if rule in FAKE_GPU_RULES else "")
        assert tres == want, f"job {job} ({rule}) asked SLURM for {tres!r}, expected {want!r}"

    # --- the one GPU was never shared ---
    gpu_jobs = sorted(
        (slurm_time(r["StartTime"]), slurm_time(r["EndTime"]), slurm_time(r["SubmitTime"]), j)
        for j, r in records.items()
        if logs[j][0] in FAKE_GPU_RULES
    )
    assert len(gpu_jobs) >= 2
    for (_, e1, _, j1), (s2, _, _, j2) in zip(gpu_jobs, gpu_jobs[1:]):
        assert s2 >= e1, f"GPU jobs {j1} ({logs[j1]}) and {j2} ({logs[j2]}) overlapped"
    # ...because SLURM held them back, not because nothing else could run: some GPU job waited
    # in the queue while another held the GPU, and some CPU job ran beside a GPU job.
    assert any(sub2 < e1 for (_, e1, _, _), (_, _, sub2, _) in zip(gpu_jobs, gpu_jobs[1:]))
    cpu_jobs = [
        (slurm_time(r["StartTime"]), slurm_time(r["EndTime"]))
        for j, r in records.items()
        if logs[j][0] not in FAKE_GPU_RULES
    ]
    assert any(cs < ge and gs < ce for cs, ce in cpu_jobs for gs, ge, _, _ in gpu_jobs)

    # --- the same results as a local run ---
    local_dir = tmp_path / "local"
    start = time.monotonic()
    run_snakemake(
        snakemake_cmd(local_dir, "--workflow-profile", str(DEFAULT_PROFILE.parent), "--cores", "2", *COMPARED,
                      overlay=overlay),
        tmp_path / "local.log",
    )
    local_s = time.monotonic() - start
    for rel in COMPARED:
        assert_same_artifact(rel, local_dir, cluster_dir)
    print(
        f"cluster DAG {cluster_s:.0f} s ({len(records)} SLURM jobs, {len(gpu_jobs)} on the GPU), "
        f"local subset {local_s:.0f} s",
        file=sys.stderr,
    )


# ---------------------------------------------------------------------------------------------
# profile checks without a cluster (dry runs)


def dry_run_jobs(profile_dir: Path, tmp_path: Path, *args: str) -> list[dict]:
    """Jobs of a dry run as {rule, wildcards, threads, resources} dicts."""
    cmd = snakemake_cmd(tmp_path, "--workflow-profile", str(profile_dir), "--dry-run", *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    jobs, job = [], None
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"(?:local)?rule (\w+):$", line)
        if m:
            job = {"rule": m.group(1)}
            jobs.append(job)
        elif job is not None and ":" in line and line.startswith("    "):
            key, _, value = line.strip().partition(": ")
            job[key] = value
    return jobs


def resources_of(job: dict) -> dict:
    return dict(kv.split("=", 1) for kv in job.get("resources", "").split(", ") if "=" in kv)


def test_slurm_profile_maps_devices_to_partitions_and_gpus(tmp_path):
    jobs = dry_run_jobs(
        SLURM_PROFILE.parent, tmp_path, "--config", "devices=['cpu','cuda:0','cuda-a100']"
    )
    for rule in ("mmlu", "perplexity", "passkey", "throughput"):
        res = {j["wildcards"]: resources_of(j) for j in jobs if j["rule"] == rule}
        cuda = [r for w, r in res.items() if "device=cuda:0" in w]
        a100 = [r for w, r in res.items() if "device=cuda-a100" in w]
        cpu = [r for w, r in res.items() if "device=cpu" in w]
        assert cuda and a100 and cpu, rule
        # any GPU for cuda:N, the labelled model for cuda-<model>, none for cpu
        assert all(r["slurm_partition"] == "gpu" and r["gpu"] == "1" and not r["gpu_model"] for r in cuda)
        assert all(r["slurm_partition"] == "gpu" and r["gpu"] == "1" and r["gpu_model"] == "a100" for r in a100)
        assert all(r["slurm_partition"] == "cpu" and r["gpu"] == "0" and not r["gpu_model"] for r in cpu)
    by_rule = {j["rule"]: j for j in jobs}
    assert resources_of(by_rule["transfer"])["slurm_partition"] == "gpu"
    assert resources_of(by_rule["report"])["slurm_partition"] == "cpu"
    assert int(resources_of(by_rule["transfer"])["mem_mb"]) >= 16000


def test_slurm_profile_has_no_slurm_extra_and_checks_status_with_squeue():
    prof = yaml.safe_load(SLURM_PROFILE.read_text())
    assert prof["executor"] == "slurm"
    assert prof["slurm-status-command"] == "squeue"
    assert "slurm_extra" not in json.dumps(prof)
    assert {"slurm_partition", "mem_mb", "runtime"} <= set(prof["default-resources"])


def test_default_profile_runs_one_gpu_job_at_a_time(tmp_path):
    """The local profile's `resources: gpu=1`: two GPU jobs never overlap, a CPU job runs beside."""
    stamp = 'date +%s.%N > {output}; sleep 2; date +%s.%N >> {output}'
    (tmp_path / "Snakefile").write_text(
        "rule all:\n"
        "    input: 'g0.txt', 'g1.txt', 'c.txt'\n"
        "rule g:\n"
        "    output: 'g{i}.txt'\n"
        "    resources: gpu=1\n"
        f"    shell: '{stamp}'\n"
        "rule c:\n"
        "    output: 'c.txt'\n"
        f"    shell: '{stamp}'\n"
    )
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(tmp_path / "Snakefile"),
           "--directory", str(tmp_path), "--workflow-profile", str(DEFAULT_PROFILE.parent),
           "--cores", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    span = {n: tuple(map(float, (tmp_path / f"{n}.txt").read_text().split())) for n in ("g0", "g1", "c")}
    (s0, e0), (s1, e1) = sorted([span["g0"], span["g1"]])
    assert s1 >= e0, "two gpu=1 jobs ran at once"
    cs, ce = span["c"]
    assert any(cs < e and s < ce for s, e in ((s0, e0), (s1, e1))), "the CPU job should run beside a GPU job"
