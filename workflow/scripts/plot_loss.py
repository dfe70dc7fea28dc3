"""Transfer (per-layer MSE) or LoRA (train/val) loss curves (hybrid_llama.report.plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.report.plots import plot_lora_loss, plot_transfer_loss

w = snakemake.wildcards
plot = plot_transfer_loss if snakemake.rule == "plot_transfer_loss" else plot_lora_loss
kind = "attention transfer" if plot is plot_transfer_loss else "LoRA"
plot(snakemake.input[0], snakemake.output.png.removesuffix(".png"), title=f"{w.model} {w.variant}: {kind}")
