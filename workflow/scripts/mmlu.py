"""MMLU of one stage, format and shot count on one device (hybrid_llama.eval.mmlu)."""

from common import stage_model, start

start(snakemake)

from hybrid_llama.eval.mmlu import run_mmlu, write_result

w, cfg = snakemake.wildcards, snakemake.params.mmlu
model, tokenizer, meta, device = stage_model(snakemake, device=w.device, dtype=cfg["dtype"])
result = run_mmlu(
    model,
    tokenizer,
    data=dict(cfg["data"]),
    shots=int(w.shots),
    fmt=w.fmt,
    limit=cfg["limit"],
    subjects=cfg["subjects"],
    batch_size=cfg["batch_size"],
    device=device,
    dtype=cfg["dtype"],
    meta=meta,
)
write_result(result, snakemake.output[0])
print(result["aggregate"])
