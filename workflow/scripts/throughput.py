"""Prefill/decode speed and memory vs length: base vs each variant's hybrid per backend."""

from common import model_dir, start

start(snakemake)

from hybrid_llama.eval.throughput import build_throughput_variants, measure_throughput, write_csv
from hybrid_llama.runtime import require_device

device, cfg = require_device(snakemake.wildcards.device), snakemake.params.throughput
variants = {}
for name, hybrid in snakemake.params.hybrids.items():
    built = build_throughput_variants(
        model_dir(snakemake), dict(hybrid), device, cfg["dtype"], backends=tuple(cfg["backends"])
    )
    for label, make in built.items():
        # The base model is the same for every variant: measure it once.
        variants[label if label == "base" else f"{name}/{label}"] = make
frame = measure_throughput(
    variants,
    seq_lens=cfg["seq_lens"],
    decode_tokens=cfg["decode_tokens"],
    repeats=cfg["repeats"],
    warmup=cfg["warmup"],
    device=device,
    dtype=cfg["dtype"],
    batch=cfg["batch"],
    time_budget_s=cfg["time_budget_s"],
    seed=cfg["seed"],
)
write_csv(frame, snakemake.output[0])
print(frame.to_string())
