"""Attention transfer of one variant (hybrid_llama.train.transfer.run_transfer)."""

import json
import shutil
from pathlib import Path

from common import model_dir, start

start(snakemake)

from hybrid_llama.pipeline import path, settings_key
from hybrid_llama.runtime import require_device
from hybrid_llama.train.transfer import run_transfer

w, hybrid, train = snakemake.wildcards, dict(snakemake.params.hybrid), dict(snakemake.params.train)
# Checkpoints are keyed by the settings, so a changed config never resumes a stale run.
ckpt = path("checkpoints", kind="transfer", model=w.model, variant=w.variant, key=settings_key(hybrid, train))
train["device"] = require_device(train["device"])
train["checkpoint_dir"] = ckpt
out_dir = Path(snakemake.output.layers).parent
metrics = run_transfer(model_dir(snakemake), snakemake.input.tokens, hybrid, train, out_dir)
shutil.rmtree(ckpt, ignore_errors=True)
print(json.dumps(metrics, indent=1, default=str))
