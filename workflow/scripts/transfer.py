"""Attention transfer of one variant (hybrid_llama.train.transfer.run_transfer)."""

import json
from pathlib import Path

from common import job_hybrid, model_dir, start, training_checkpoints

start(snakemake)

from hybrid_llama.train.transfer import run_transfer

w, hybrid, train = snakemake.wildcards, job_hybrid(snakemake, snakemake.params.hybrid), dict(snakemake.params.train)
with training_checkpoints(snakemake, "transfer", w.variant, hybrid, train) as train:
    metrics = run_transfer(model_dir(snakemake), snakemake.input.tokens, hybrid, train,
                           Path(snakemake.output.layers).parent)
print(json.dumps(metrics, indent=1, default=str))
