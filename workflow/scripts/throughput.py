"""Prefill/decode speed and memory vs length: base vs each variant's hybrid per backend."""

from common import model_dir, start

start(snakemake)

from hybrid_llama.eval.throughput import (
    build_throughput_variants,
    measure_throughput,
    share_measurements,
    write_csv,
)
from hybrid_llama.runtime import require_device

device, cfg = require_device(snakemake.wildcards.device), snakemake.params.throughput
variants, first_with, same_as = {}, {}, {}
for name, hybrid in snakemake.params.hybrids.items():
    built = build_throughput_variants(
        model_dir(snakemake), dict(hybrid), device, cfg["dtype"], backends=tuple(cfg["backends"])
    )
    # Speed depends on the hybrid settings only (not on trained weights): each distinct set once.
    twin = first_with.setdefault(repr(sorted(dict(hybrid).items())), name)
    for label, make in built.items():
        # The base model is the same for every variant: measure it once.
        if label == "base":
            variants[label] = make
        elif twin == name:
            variants[f"{name}/{label}"] = make
        else:
            same_as[f"{name}/{label}"] = f"{twin}/{label}"
frame = measure_throughput(
    variants,
    seq_lens=cfg["seq_lens"],
    decode_tokens=cfg["decode_tokens"],
    repeats=cfg["repeats"],
    warmup=cfg["warmup"],
    prefill_min_s=cfg["prefill_min_s"],
    device=device,
    dtype=cfg["dtype"],
    batch=cfg["batch"],
    time_budget_s=cfg["time_budget_s"],
    seed=cfg["seed"],
)
frame = share_measurements(frame, same_as)
write_csv(frame, snakemake.output[0])
print(frame.to_string())
