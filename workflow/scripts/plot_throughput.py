"""Throughput and memory vs length for one model and device (hybrid_llama.report.plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.plots import plot_memory, plot_throughput

w, out = snakemake.wildcards, snakemake.output
where = f"{w.model} on {w.device}"
plot_throughput(snakemake.input[0], out.throughput.removesuffix(".png"),
                title=f"Throughput vs prompt length: {where} (×: where a variant overtakes base)")
plot_memory(snakemake.input[0], out.memory.removesuffix(".png"),
            title=f"Cache and peak memory vs prompt length: {where}")
