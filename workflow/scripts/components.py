"""Component diagnostic of one hybrid stage: the window's share of each layer's normalizer
(hybrid_llama.eval.components)."""

from common import stage_model, start

start(snakemake)

from hybrid_llama.eval.components import window_shares, write_components_csv
from hybrid_llama.eval.quality import heldout_texts

w, cfg = snakemake.wildcards, snakemake.params.components
model, tokenizer, _, device = stage_model(snakemake, device=w.device, dtype=snakemake.params.dtype)
texts = heldout_texts(dict(snakemake.params.source), exclude_manifest=list(snakemake.input.manifests))
rows = window_shares(
    model,
    tokenizer,
    texts,
    context_lens=cfg["context_lens"],
    tail=cfg["tail"],
    max_windows=cfg["max_windows"],
    stage=w.stage,
)
write_components_csv(rows, snakemake.output[0])
print(rows)
