"""Multi-key needle in a haystack per trial vs context length (hybrid_llama.eval.niah)."""

from common import quality_table, start

start(snakemake)

from hybrid_llama.books import heldout_books
from hybrid_llama.eval.niah import niah_accuracy


def measure(model, tokenizer, cfg, stage):
    source = snakemake.params.source
    books = heldout_books(source["dir"], source["heldout"]) if "book" in cfg["haystacks"] else None
    return niah_accuracy(
        model,
        tokenizer,
        context_lens=cfg["context_lens"],
        trials=cfg["trials"],
        n_keys=cfg["n_keys"],
        haystacks=cfg["haystacks"],
        book_texts=books,
        seed=cfg["seed"],
        stage=stage,
    )


quality_table(snakemake, "niah", measure)
