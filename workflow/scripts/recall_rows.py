"""Build the recall rows a distilled LoRA stage trains beside its corpus (hybrid_llama.recall_rows)."""

import json

from common import model_dir, start

start(snakemake, torch_threads=False)

from hybrid_llama.names import RecallShape
from hybrid_llama.recall_rows import prepare_recall_rows

w = snakemake.wildcards
shape = RecallShape.parse(w.facts)
manifest = prepare_recall_rows(
    dict(snakemake.params.books),
    str(model_dir(snakemake)),
    snakemake.output.tokens,
    seq_len=int(w.seq_len),
    rows=int(w.rows),
    facts=shape.facts,
    asks=shape.asks,
    same_attribute=shape.same_attribute,
    subjects=shape.subjects,
)
print(json.dumps({k: v for k, v in manifest.items() if k != "rows"}, indent=1))
