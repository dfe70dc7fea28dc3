"""LoRA finetune of a variant's transferred model, or of the base model (the base_lora control)."""

import json
from pathlib import Path

from common import job_hybrid, model_dir, start, training_checkpoints

start(snakemake)

from hybrid_llama.train.finetune import run_finetune

w, hybrid, lora = snakemake.wildcards, job_hybrid(snakemake, snakemake.params.hybrid), dict(snakemake.params.lora)
with training_checkpoints(snakemake, "lora", getattr(w, "variant", "base_lora"), hybrid, lora) as lora:
    metrics = run_finetune(
        model_dir(snakemake),
        snakemake.input.data,
        lora,
        Path(snakemake.output.adapter).parent,
        hybrid=dict(hybrid) if hybrid else None,
        hybrid_layers=getattr(snakemake.input, "layers", None),
        teacher_states=getattr(snakemake.input, "teacher_states", None),
        recall_rows=getattr(snakemake.input, "recall", None),
    )
print(json.dumps(metrics, indent=1, default=str))
