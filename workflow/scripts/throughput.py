"""Prefill/decode speed and memory vs length: base vs each variant's hybrid per backend."""

from common import job_hybrid, model_dir, start

start(snakemake)

from hybrid_llama.eval.throughput import (
    build_throughput_variants,
    measure_throughput,
    share_measurements,
    write_csv,
)
from hybrid_llama.runtime import require_device

device, cfg = require_device(snakemake.wildcards.device), snakemake.params.throughput
hybrids = {name: job_hybrid(snakemake, hybrid) for name, hybrid in snakemake.params.hybrids.items()}
variants, first_with, same_as = {}, {}, {}
for name, hybrid in hybrids.items():
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
# Long prompts: base and the listed variants only (each under the label its twin is measured as).
long = snakemake.params.long
long_labels = {label for label in variants if label.split("/", 1)[0] in {
    first_with[repr(sorted(dict(hybrids[v]).items()))] for v in long["variants"]
    if v in hybrids}}
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
    long_from=long["from_len"],
    long_repeats=long["repeats"],
    long_warmup=long["warmup"],
    long_variants=long_labels,
)
frame = share_measurements(frame, same_as)
write_csv(frame, snakemake.output[0])
print(frame.to_string())
