"""Component diagnostic of one hybrid stage: the window's share of each layer's normalizer
(hybrid_llama.eval.components)."""

from common import heldout, quality_table, start

start(snakemake)

from hybrid_llama.eval.components import window_shares


def measure(model, tokenizer, cfg, stage):
    return window_shares(
        model,
        tokenizer,
        heldout(snakemake),
        context_lens=cfg["context_lens"],
        tail=cfg["tail"],
        max_windows=cfg["max_windows"],
        stage=stage,
    )


quality_table(snakemake, "components", measure)
