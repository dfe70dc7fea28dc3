"""MMLU accuracy bars for one model and format (hybrid_llama.report.plots)."""

from hl_script import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.plots import plot_mmlu

w = snakemake.wildcards
plot_mmlu(
    list(snakemake.input),
    snakemake.output.png.removesuffix(".png"),
    # lm-eval's usual metric per format: letters (mc) -> acc, answer texts (cloze) -> acc_norm
    metric="acc" if w.fmt == "mc" else "acc_norm",
    title=f"MMLU ({w.fmt}) - {w.model}",
)
