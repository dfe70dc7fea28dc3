"""Tokenize the instruction data with the model's tokenizer and template (hybrid_llama.data)."""

import json

from common import model_dir, start

start(snakemake, torch_threads=False)

from hybrid_llama.data import prepare_instruct_data

manifest = prepare_instruct_data(
    dict(snakemake.params.source),
    str(model_dir(snakemake)),
    snakemake.output.tokens,
    **snakemake.params.settings,
)
print(json.dumps(manifest, indent=1))
