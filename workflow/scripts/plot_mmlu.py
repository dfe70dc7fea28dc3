"""MMLU accuracy bars for one model and format (hybrid_llama.report.plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.plots import plot_mmlu
from hybrid_llama.report.results import mmlu_metric

w = snakemake.wildcards
plot_mmlu(
    list(snakemake.input),
    snakemake.output.png.removesuffix(".png"),
    metric=mmlu_metric(w.fmt),
    title=f"MMLU ({w.fmt}) - {w.model}",
)
