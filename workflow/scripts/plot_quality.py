"""NLL vs context length and the passkey heatmap of one variant (hybrid_llama.report.quality_plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.quality_plots import plot_nll_vs_context, plot_passkey_heatmap

device, out = snakemake.wildcards.device, snakemake.output
plot_nll_vs_context(snakemake.input.perplexity, out.nll.removesuffix(".png"), device=device)
plot_passkey_heatmap(snakemake.input.passkey, out.passkey.removesuffix(".png"), device=device)
