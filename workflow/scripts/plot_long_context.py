"""NLL vs context on the held-out books, every variant on one axis, and the paired gap to base
(hybrid_llama.report.long_context_plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.eval.tables import read_perplexity_csv
from hybrid_llama.pipeline import parse_result_path
from hybrid_llama.report.long_context_plots import plot_books_nll

w = snakemake.wildcards
tables = {parse_result_path(f, ["quality"])[1]["variant"]: read_perplexity_csv(f) for f in snakemake.input.books}
plot_books_nll(tables, snakemake.output.books.removesuffix(".png"), windows=snakemake.params.windows,
               title=f"Held-out books ({', '.join(snakemake.params.heldout)}): NLL vs context, {w.model} on {w.device}")
