"""Rank the base model's KV heads by the attention they put on a passkey (softmax_heads: {top: N})."""

import json

from common import model_dir, start

start(snakemake)

from hybrid_llama.eval.retrieval_heads import rank_model
from hybrid_llama.files import atomic_write

ranking = rank_model(model_dir(snakemake), **snakemake.params.ranking)
atomic_write(snakemake.output[0], json.dumps(ranking, indent=1) + "\n")
for head in ranking["heads"][:12]:
    print(head)
