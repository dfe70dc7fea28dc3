"""Stream the books of data.books.names from the Hugging Face Hub into <name>.txt files (the mirror's layout)."""

import json
from pathlib import Path

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.books_hub import find_books, write_books
from hybrid_llama.files import atomic_write

directory = Path(snakemake.output.manifest).parent
wanted = dict(snakemake.params.books)
# The readers take a directory's *.txt as its books: books of an earlier, longer list must go.
for stale in directory.glob("*.txt"):
    if stale.stem not in wanted:
        stale.unlink()
source = dict(snakemake.params.source)
books = write_books(find_books(source, wanted), directory)
manifest = {"source": source, "books": books}
atomic_write(snakemake.output.manifest, json.dumps(manifest, indent=1) + "\n")
