"""Export one variant's final stage as a hybrid_llama model directory with its model card."""

from pathlib import Path

from common import job_hybrid, model_dir, start

start(snakemake)

import torch

from hybrid_llama.files import atomic_path
from hybrid_llama.models import load_hybrid, save_hybrid
from hybrid_llama.report.model_card import pipeline_model_card
from hybrid_llama.stages import load_stage

inp, params, w = snakemake.input, snakemake.params, snakemake.wildcards
adapter = getattr(inp, "adapter", None)
hybrid = job_hybrid(snakemake, params.hybrid)
model, tokenizer = load_stage(model_dir(snakemake), params.stage, hybrid=hybrid,
                              hybrid_layers=inp.layers, adapter=Path(adapter).parent if adapter else None)
out = snakemake.output[0]
card = pipeline_model_card(
    model=w.model, variant=w.variant, stage=params.stage, hybrid=hybrid, base_spec=params.base_spec,
    num_layers=model.config.num_hidden_layers, transfer_metrics=inp.transfer_metrics,
    lora_metrics=getattr(inp, "lora_metrics", None), data=params.data, results=list(inp.results), path=out,
)
with atomic_path(out) as tmp:
    save_hybrid(model, tmp, tokenizer=tokenizer, card=card)
    # The directory must load back as this model (the pipeline's loader, i.e. the Auto classes' path).
    ids = tokenizer("The exported model loads back as itself.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        if not torch.equal(load_hybrid(tmp)(ids).logits, model(ids).logits):
            raise RuntimeError(f"{out}: the saved model does not reproduce the stage's logits")
print(card)
