"""The shared start of every workflow script (Snakemake puts workflow/scripts on sys.path):
keep freed memory in the heap, send output to the rule's log file, cap torch's threads at the
job's `threads`, and hand the library the files and labels of the stage a job evaluates."""

import logging
import os
import sys
from pathlib import Path


def start(snakemake, *, torch_threads: bool = True):
    """Redirect stdout, stderr and logging to snakemake.log[0]; return the log file.

    ``torch_threads=False`` marks a job that loads no model (tables, plots, the report, data
    preparation): it neither caps torch's threads nor registers the hybrid model type with
    transformers. Registering imports torch and transformers, about 5 s of CPU in a job whose own
    work takes a fraction of a second."""
    if not torch_threads:
        os.environ["HYBRID_LLAMA_REGISTER"] = "0"  # read when hybrid_llama is first imported, just below
    from hybrid_llama.runtime import keep_freed_memory

    kept = keep_freed_memory()  # before torch allocates anything: see its docstring
    log = open(snakemake.log[0], "w", buffering=1)
    sys.stdout = sys.stderr = log
    logging.basicConfig(stream=log, level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    logging.info("rule %s, wildcards %s, freed memory kept in the heap: %s", snakemake.rule,
                 dict(snakemake.wildcards), kept)
    if torch_threads:
        import torch

        torch.set_num_threads(max(1, int(snakemake.threads)))
    return log


def model_dir(snakemake) -> Path:
    """The resolved weights directory (every rule's `weights` input is its config.json)."""
    return Path(snakemake.input.weights).parent


def job_hybrid(snakemake, hybrid):
    """A rule's hybrid params as the job builds the model: ranked heads (softmax_heads: {top: N})
    become the pairs of the job's retrieval_heads input; anything else comes back as it is."""
    if not hybrid:
        return hybrid
    from hybrid_llama.eval.retrieval_heads import ranked_softmax_heads

    return ranked_softmax_heads(dict(hybrid), getattr(snakemake.input, "retrieval_heads", None))


def stage_model(snakemake, *, device: str, dtype=None):
    """(model, tokenizer, meta, torch device) of the stage named by the job's wildcards."""
    from hybrid_llama.stages import load_stage_for_eval

    w = snakemake.wildcards
    return load_stage_for_eval(
        model_dir(snakemake),
        w.stage,
        hybrid=job_hybrid(snakemake, snakemake.params.hybrid),
        hybrid_layers=getattr(snakemake.input, "layers", None),
        adapter=getattr(snakemake.input, "adapter", None),
        device=device,
        dtype=dtype,
        # the requested device (wildcard or config, label included); results also record the real one
        labels={"model": w.model, "variant": w.variant, "device": getattr(w, "device", None)},
    )


# ---------------------------------------------------------------- quality jobs


def heldout(snakemake, n_docs: int | None = None) -> list[str]:
    """The held-out transfer-corpus documents of the rule's `source`, none of the corpora training packed."""
    from hybrid_llama.eval.heldout import heldout_texts

    return heldout_texts(dict(snakemake.params.source), n_docs=n_docs, exclude_manifest=list(snakemake.input.manifests))


def quality_table(snakemake, kind: str, measure) -> list[dict]:
    """The body of the perplexity, passkey and components jobs: load the stage the wildcards name on
    their device in the quality dtype, rows = measure(model, tokenizer, cfg, stage) with cfg the rule's
    params[kind], write them as the kind's CSV to output[0] and echo them to the log."""
    from hybrid_llama.eval.tables import QUALITY_WRITERS

    w = snakemake.wildcards
    model, tokenizer, _, _ = stage_model(snakemake, device=w.device, dtype=snakemake.params.dtype)
    rows = measure(model, tokenizer, getattr(snakemake.params, kind), w.stage)
    QUALITY_WRITERS[kind](rows, snakemake.output[0])
    print(rows)
    return rows


# ---------------------------------------------------------------- training jobs


def training_checkpoints(snakemake, kind: str, slot: str, hybrid, settings: dict):
    """A context manager: ``with training_checkpoints(...) as settings:`` gets ``settings`` with the
    torch device resolved and ``checkpoint_dir`` set. The directory is keyed by the settings, so a
    changed config never resumes a stale run; it is removed once the block succeeds (a failed job
    keeps it for the rerun to resume)."""
    import shutil
    from contextlib import contextmanager

    from hybrid_llama.config import settings_key
    from hybrid_llama.pipeline import path
    from hybrid_llama.runtime import require_device

    ckpt = path("checkpoints", kind=kind, model=snakemake.wildcards.model, variant=slot,
                key=settings_key(hybrid, settings))

    @contextmanager
    def checkpointed():
        yield {**settings, "device": require_device(settings["device"]), "checkpoint_dir": ckpt}
        shutil.rmtree(ckpt, ignore_errors=True)

    return checkpointed()
