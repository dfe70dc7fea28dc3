"""LoRA finetune of a variant's transferred model, or of the base model (the base_lora control)."""

import json
import shutil
from pathlib import Path

from common import model_dir, start

start(snakemake)

from hybrid_llama.pipeline import path, settings_key
from hybrid_llama.runtime import require_device
from hybrid_llama.train.finetune import run_finetune

w, hybrid, lora = snakemake.wildcards, snakemake.params.hybrid, dict(snakemake.params.lora)
slot = getattr(w, "variant", "base_lora")
# Checkpoints are keyed by the settings, so a changed config never resumes a stale run.
ckpt = path("checkpoints", kind="lora", model=w.model, variant=slot, key=settings_key(hybrid, lora))
lora["device"] = require_device(lora["device"])
lora["checkpoint_dir"] = ckpt
metrics = run_finetune(
    model_dir(snakemake),
    snakemake.input.data,
    lora,
    Path(snakemake.output.adapter).parent,
    hybrid=dict(hybrid) if hybrid else None,
    hybrid_layers=getattr(snakemake.input, "layers", None),
    teacher_states=getattr(snakemake.input, "teacher_states", None),
)
shutil.rmtree(ckpt, ignore_errors=True)
print(json.dumps(metrics, indent=1, default=str))
