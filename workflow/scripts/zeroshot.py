"""The zero-shot suite of one stage on one device (hybrid_llama.eval.zeroshot)."""

from common import stage_model, start

start(snakemake)

from hybrid_llama.eval.zeroshot import run_suite, write_result

w, cfg = snakemake.wildcards, snakemake.params.zeroshot
model, tokenizer, meta, device = stage_model(snakemake, device=w.device, dtype=cfg["dtype"])
result = run_suite(
    model,
    tokenizer,
    tasks=list(cfg["tasks"]),
    limit=cfg["limit"],
    seed=cfg["seed"],
    source=cfg["source"],
    shared_data=cfg["shared_data"],
    batch_size=cfg["batch_size"],
    share_prefixes=cfg["share_prefixes"],
    device=device,
    dtype=cfg["dtype"],
    meta=meta,
)
write_result(result, snakemake.output[0])
print({task: {k: v for k, v in r.items()} for task, r in result["results"].items()})
