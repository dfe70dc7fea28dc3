"""Pack the transfer corpus with the model's tokenizer (hybrid_llama.data)."""

import json

from common import model_dir, start

start(snakemake, torch_threads=False)

from hybrid_llama.data import prepare_transfer_corpus

manifest = prepare_transfer_corpus(
    dict(snakemake.params.source),
    str(model_dir(snakemake)),
    snakemake.output.tokens,
    **snakemake.params.settings,
)
print(json.dumps({k: v for k, v in manifest.items() if k != "doc_hashes"}, indent=1))
