"""Attention transfer of one variant (hybrid_llama.train.transfer.run_transfer)."""

import hashlib
import json
import shutil
from pathlib import Path

from hl_script import model_dir, require_device, start

start(snakemake)

from hybrid_llama.train.transfer import run_transfer

hybrid, train = dict(snakemake.params.hybrid), dict(snakemake.params.train)
# Checkpoints are keyed by the settings, so a changed config never resumes a stale run.
key = hashlib.sha256(json.dumps([hybrid, train], sort_keys=True).encode()).hexdigest()[:12]
train["device"] = require_device(train["device"])
w = snakemake.wildcards
ckpt = Path("resources/checkpoints/transfer") / w.model / w.variant / key
train["checkpoint_dir"] = str(ckpt)
metrics = run_transfer(
    model_dir(snakemake), snakemake.input.tokens, hybrid, train, Path(snakemake.output.layers).parent
)
shutil.rmtree(ckpt, ignore_errors=True)
print(json.dumps(metrics, indent=1, default=str))
