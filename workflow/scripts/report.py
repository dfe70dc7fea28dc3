"""results/report.html: one self-contained page (hybrid_llama.report.html)."""

from pathlib import Path

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.html import write_report

inp = snakemake.input
write_report(
    snakemake.output[0],
    config=snakemake.params.config,
    mmlu=list(inp.mmlu),
    quality=list(inp.quality),
    throughput=list(inp.throughput),
    generations=list(inp.generations),
    plots=list(inp.plots),
    transfer_metrics=list(inp.transfer_metrics),
    lora_metrics=list(inp.lora_metrics),
    exports=list(inp.exports),
    zeroshot=list(inp.zeroshot),
    manifests=list(inp.manifests),
    benchmarks_dir="logs/benchmarks",
    repo_dir=Path(snakemake.scriptdir).parents[1],
)
