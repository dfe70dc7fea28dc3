"""Passkey retrieval accuracy vs context length and depth (hybrid_llama.eval.quality)."""

from common import stage_model, start

start(snakemake)

from hybrid_llama.eval.quality import passkey_accuracy, write_passkey_csv

w, cfg = snakemake.wildcards, snakemake.params.passkey
model, tokenizer, _, device = stage_model(snakemake, device=w.device, dtype=snakemake.params.dtype)
rows = passkey_accuracy(
    model,
    tokenizer,
    context_lens=cfg["context_lens"],
    depths=cfg["depths"],
    trials=cfg["trials"],
    seed=cfg["seed"],
    batch_size=cfg["batch_size"],
    stage=w.stage,
)
write_passkey_csv(rows, snakemake.output[0])
print(rows)
