# Thin wrappers around hybrid_llama.pipeline, which owns the workflow's vocabulary: the table of
# artifact paths and result slots (pipeline.paths), the per-rule views of the config and the target
# lists (pipeline.views: each rule's params hold only the keys it uses, so Snakemake reruns exactly
# what a change affects) and the semantic checks (pipeline.checks, run here at parse time, before
# any job). Config defaults and merging come from hybrid_llama.config.

import os
import sys
from contextlib import contextmanager
from pathlib import Path

from snakemake.exceptions import WorkflowError

# This checkout's package, for parsing here and for every job (jobs inherit the environment, also
# inside the rules' conda envs, which hold only the dependencies; on a cluster each job parses this
# file again).
SRC = str(Path(workflow.basedir).resolve() / "src")
sys.path.insert(0, SRC)
os.environ.update(
    PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
)


@contextmanager
def environment(**values: str):
    """Set environment variables for the block only (the jobs, started later, see them as before)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ.update({name: value})


# Parsing needs only the pipeline's vocabulary: importing the package without registering the
# hybrid_llama model type with transformers keeps torch out of this process (3.5 s a parse;
# hybrid_llama.registration). The jobs register as usual.
with environment(HYBRID_LLAMA_REGISTER="0"):
    from hybrid_llama.config import ConfigError, canonical  # noqa: E402
    from hybrid_llama.pipeline import Pipeline, is_cuda, path  # noqa: E402
    from hybrid_llama.pipeline import long_context  # noqa: E402

try:
    P = Pipeline(config, Path(workflow.basedir))
    P.check()
except ConfigError as e:
    raise WorkflowError(str(e)) from None

MODELS, VARIANTS, DEVICES = list(P.models), list(P.variants), P.devices


def log_of(job: str) -> str:
    return path("log", job=job)


def benchmark_of(job: str) -> str:
    return path("benchmark", job=job)


def weights(wildcards) -> str:
    return path("weights", model=wildcards.model)


def stage_inputs(wildcards) -> dict:
    """The files a stage's model is built from: weights (+ transfer layers) (+ LoRA adapter)."""
    try:
        return P.stage_inputs(wildcards.model, wildcards.variant, wildcards.stage)
    except ValueError as e:
        raise WorkflowError(str(e)) from None


def stage_hybrid(wildcards):
    return P.stage_hybrid(wildcards.variant, wildcards.stage)


def mmlu_inputs(wildcards) -> dict:
    files = stage_inputs(wildcards)
    if P.data_kind("mmlu") == "hf":
        files["data"] = path("mmlu_manifest")
    return files


def svg(png: str) -> str:
    """The SVG twin of a plot's PNG path."""
    return png.removesuffix(".png") + ".svg"


def gpu_of_device(wildcards) -> int:
    return int(is_cuda(wildcards.device))


wildcard_constraints:
    **P.wildcard_constraints(),
