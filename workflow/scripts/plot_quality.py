"""NLL, passkey and component-share figures of one model and device, every variant on one axis
(hybrid_llama.report.quality_plots)."""

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.eval.tables import read_components_csv, read_passkey_csv, read_perplexity_csv
from hybrid_llama.pipeline import parse_result_path
from hybrid_llama.report.quality_plots import plot_components, plot_nll, plot_passkey

w, inp, out = snakemake.wildcards, snakemake.input, snakemake.output


def by_variant(files, reader) -> dict:
    return {parse_result_path(f, ["quality"])[1]["variant"]: reader(f) for f in files}


windows = snakemake.params.windows
where = f"{w.model} on {w.device}"
plot_nll(by_variant(inp.perplexity, read_perplexity_csv), out.nll.removesuffix(".png"),
         title=f"Held-out fineweb-edu NLL vs context: {where}", windows=windows)
plot_passkey(by_variant(inp.passkey, read_passkey_csv), out.passkey.removesuffix(".png"),
             title=f"Passkey retrieval vs context: {where}", windows=windows)
plot_components(by_variant(inp.components, read_components_csv), out.components.removesuffix(".png"),
                title=f"Window share of the attention normalizer: {where}")
