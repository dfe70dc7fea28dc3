"""NLL vs context length on held-out transfer-corpus text (hybrid_llama.eval.quality)."""

from common import stage_model, start

start(snakemake)

from hybrid_llama.eval.quality import heldout_texts, perplexity_vs_context, write_perplexity_csv

w, cfg = snakemake.wildcards, snakemake.params.perplexity
model, tokenizer, _, device = stage_model(snakemake, device=w.device, dtype=snakemake.params.dtype)
texts = heldout_texts(
    dict(snakemake.params.source), n_docs=cfg["n_docs"], exclude_manifest=list(snakemake.input.manifests)
)
rows = perplexity_vs_context(
    model,
    tokenizer,
    texts,
    context_lens=cfg["context_lens"],
    tail=cfg["tail"],
    max_windows=cfg["max_windows"],
    batch_size=cfg["batch_size"],
    stage=w.stage,
)
write_perplexity_csv(rows, snakemake.output[0])
print(rows)
