"""Cut the training rows of a variant with transfer.corpus books (hybrid_llama.data.prepare_book_rows)."""

import json

from common import model_dir, start

start(snakemake, torch_threads=False)

from hybrid_llama.data import prepare_book_rows

manifest = prepare_book_rows(
    dict(snakemake.params.books),
    str(model_dir(snakemake)),
    snakemake.output.tokens,
    **snakemake.params.settings,
)
print(json.dumps({k: v for k, v in manifest.items() if k not in ("doc_hashes", "rows")}, indent=1))
