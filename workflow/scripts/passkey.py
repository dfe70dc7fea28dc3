"""Passkey retrieval per trial vs context length (hybrid_llama.eval.passkey)."""

from common import quality_table, start

start(snakemake)

from hybrid_llama.eval.passkey import passkey_accuracy


def measure(model, tokenizer, cfg, stage):
    return passkey_accuracy(
        model,
        tokenizer,
        context_lens=cfg["context_lens"],
        depths=cfg["depths"],
        trials=cfg["trials"],
        generate_trials=cfg["generate_trials"],
        seed=cfg["seed"],
        batch_size=cfg["batch_size"],
        stage=stage,
    )


quality_table(snakemake, "passkey", measure)
