"""Interleave a mixed corpus's documents and book rows (hybrid_llama.data.mix_rows)."""

import json

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.data import mix_rows

manifest = mix_rows([snakemake.input.documents, snakemake.input.books], snakemake.output.tokens)
print(json.dumps({k: v for k, v in manifest.items() if k != "row_parts"}, indent=1))
