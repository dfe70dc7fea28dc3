"""NLL vs context length on held-out transfer-corpus text (hybrid_llama.eval.perplexity)."""

from common import heldout, quality_table, start

start(snakemake)

from hybrid_llama.eval.perplexity import perplexity_vs_context


def measure(model, tokenizer, cfg, stage):
    return perplexity_vs_context(
        model,
        tokenizer,
        heldout(snakemake, n_docs=cfg["n_docs"]),
        context_lens=cfg["context_lens"],
        tail=cfg["tail"],
        max_windows=cfg["max_windows"],
        batch_size=cfg["batch_size"],
        stage=stage,
    )


quality_table(snakemake, "perplexity", measure)
