"""LoRA finetune of a variant's transferred model, or of the base model (the base_lora control)."""

import hashlib
import json
import shutil
from pathlib import Path

from hl_script import model_dir, require_device, start

start(snakemake)

from hybrid_llama.train.finetune import run_finetune

hybrid, lora = snakemake.params.hybrid, dict(snakemake.params.lora)
# Checkpoints are keyed by the settings, so a changed config never resumes a stale run.
key = hashlib.sha256(json.dumps([hybrid, lora], sort_keys=True).encode()).hexdigest()[:12]
lora["device"] = require_device(lora["device"])
w = snakemake.wildcards
slot = getattr(w, "variant", "base_lora")
ckpt = Path("resources/checkpoints/lora") / w.model / slot / key
lora["checkpoint_dir"] = str(ckpt)
metrics = run_finetune(
    model_dir(snakemake),
    snakemake.input.instruct,
    lora,
    Path(snakemake.output.adapter).parent,
    hybrid=dict(hybrid) if hybrid else None,
    hybrid_layers=getattr(snakemake.input, "layers", None),
)
shutil.rmtree(ckpt, ignore_errors=True)
print(json.dumps(metrics, indent=1, default=str))
