"""Throughput and memory vs length for one model and device (hybrid_llama.report.plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.plots import plot_memory, plot_throughput

w, out = snakemake.wildcards, snakemake.output
plot_throughput(snakemake.input[0], out.throughput.removesuffix(".png"), title=f"{w.model} throughput")
plot_memory(snakemake.input[0], out.memory.removesuffix(".png"), title=f"{w.model} peak memory")
