"""NLL vs context length on the held-out books (hybrid_llama.eval.perplexity, windows inside one book)."""

from common import quality_table, start

start(snakemake)

from hybrid_llama.books import heldout_books
from hybrid_llama.eval.perplexity import perplexity_vs_context


def measure(model, tokenizer, cfg, stage):
    source = snakemake.params.source
    return perplexity_vs_context(
        model,
        tokenizer,
        heldout_books(source["dir"], source["heldout"]),
        context_lens=cfg["context_lens"],
        tail=cfg["tail"],
        max_windows=cfg["max_windows"],
        batch_size=cfg["batch_size"],
        within_documents=True,
        # every slot's windows end where the longest configured length's do, so a slot that runs the
        # short lengths only scores the targets base scores (the report pairs them window by window)
        anchor_len=cfg["anchor_len"],
        stage=stage,
    )


quality_table(snakemake, "books", measure)
