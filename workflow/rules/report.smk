# Plots (flagged for `snakemake --report`) and the self-contained results/report.html.


rule plot_mmlu:
    input:
        lambda wildcards: P.mmlu_files(wildcards.model, wildcards.fmt),
    output:
        png=report(
            path("plot_mmlu"),
            caption="../report/mmlu.rst",
            category="MMLU",
            labels={"model": "{model}", "format": "{fmt}"},
        ),
        svg=svg(path("plot_mmlu")),
    log:
        log_of("plots/{model}/mmlu_{fmt}"),
    benchmark:
        benchmark_of("plots/{model}/mmlu_{fmt}")
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_mmlu.py"


rule plot_throughput:
    input:
        path("throughput"),
    output:
        throughput=report(
            path("plot_throughput"),
            caption="../report/throughput.rst",
            category="Throughput",
            labels={"model": "{model}", "device": "{device}", "plot": "speed"},
        ),
        throughput_svg=svg(path("plot_throughput")),
        memory=report(
            path("plot_memory"),
            caption="../report/memory.rst",
            category="Throughput",
            labels={"model": "{model}", "device": "{device}", "plot": "memory"},
        ),
        memory_svg=svg(path("plot_memory")),
    log:
        log_of("plots/{model}/throughput_{device}"),
    benchmark:
        benchmark_of("plots/{model}/throughput_{device}")
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_throughput.py"


rule plot_transfer_loss:
    input:
        path("transfer_loss"),
    output:
        png=report(
            path("plot_transfer_loss"),
            caption="../report/transfer_loss.rst",
            category="Training",
            labels={"model": "{model}", "variant": "{variant}", "plot": "transfer"},
        ),
        svg=svg(path("plot_transfer_loss")),
    log:
        log_of("plots/{model}/{variant}/transfer_loss"),
    benchmark:
        benchmark_of("plots/{model}/{variant}/transfer_loss")
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_loss.py"


rule plot_lora_loss:
    input:
        path("lora_loss"),
    output:
        png=report(
            path("plot_lora_loss"),
            caption="../report/lora_loss.rst",
            category="Training",
            labels={"model": "{model}", "variant": "{variant}", "plot": "lora"},
        ),
        svg=svg(path("plot_lora_loss")),
    log:
        log_of("plots/{model}/{variant}/lora_loss"),
    benchmark:
        benchmark_of("plots/{model}/{variant}/lora_loss")
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_loss.py"


rule plot_quality:
    input:
        perplexity=lambda w: P.quality_tables(w.model, w.device, "perplexity"),
        passkey=lambda w: P.quality_tables(w.model, w.device, "passkey"),
        components=lambda w: P.quality_tables(w.model, w.device, "components"),
    output:
        nll=report(
            path("plot_nll"),
            caption="../report/nll.rst",
            category="Quality",
            labels={"model": "{model}", "device": "{device}", "plot": "nll"},
        ),
        nll_svg=svg(path("plot_nll")),
        passkey=report(
            path("plot_passkey"),
            caption="../report/passkey.rst",
            category="Quality",
            labels={"model": "{model}", "device": "{device}", "plot": "passkey"},
        ),
        passkey_svg=svg(path("plot_passkey")),
        components=report(
            path("plot_components"),
            caption="../report/components.rst",
            category="Quality",
            labels={"model": "{model}", "device": "{device}", "plot": "components"},
        ),
        components_svg=svg(path("plot_components")),
    log:
        log_of("plots/{model}/quality_{device}"),
    benchmark:
        benchmark_of("plots/{model}/quality_{device}")
    conda:
        "../../envs/report.yaml"
    params:
        windows={v: P.hybrid(v)["window"] for v in VARIANTS},
    script:
        "../scripts/plot_quality.py"


rule report:
    input:
        **P.report_inputs(),
    output:
        report(
            path("report"),
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        log_of("report"),
    benchmark:
        benchmark_of("report")
    conda:
        "../../envs/report.yaml"
    params:
        config=canonical(config),
    script:
        "../scripts/report.py"
