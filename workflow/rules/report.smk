# Plots (flagged for `snakemake --report`) and the self-contained results/report.html.


rule plot_mmlu:
    input:
        lambda wildcards: mmlu_files(wildcards.model, wildcards.fmt),
    output:
        png=report(
            "results/plots/{model}_mmlu_{fmt}.png",
            caption="../report/mmlu.rst",
            category="MMLU",
            labels={"model": "{model}", "format": "{fmt}"},
        ),
        svg="results/plots/{model}_mmlu_{fmt}.svg",
    log:
        "logs/plots/{model}_mmlu_{fmt}.log",
    benchmark:
        "logs/benchmarks/plots/{model}_mmlu_{fmt}.tsv"
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_mmlu.py"


rule plot_throughput:
    input:
        "results/{model}/throughput/{device}.csv",
    output:
        throughput=report(
            "results/plots/{model}_throughput_{device}.png",
            caption="../report/throughput.rst",
            category="Throughput",
            labels={"model": "{model}", "device": "{device}", "plot": "speed"},
        ),
        throughput_svg="results/plots/{model}_throughput_{device}.svg",
        memory=report(
            "results/plots/{model}_memory_{device}.png",
            caption="../report/memory.rst",
            category="Throughput",
            labels={"model": "{model}", "device": "{device}", "plot": "memory"},
        ),
        memory_svg="results/plots/{model}_memory_{device}.svg",
    log:
        "logs/plots/{model}_throughput_{device}.log",
    benchmark:
        "logs/benchmarks/plots/{model}_throughput_{device}.tsv"
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_throughput.py"


rule plot_transfer_loss:
    input:
        "results/{model}/{variant}/transfer/loss.csv",
    output:
        png=report(
            "results/plots/{model}_{variant}_transfer_loss.png",
            caption="../report/transfer_loss.rst",
            category="Training",
            labels={"model": "{model}", "variant": "{variant}", "plot": "transfer"},
        ),
        svg="results/plots/{model}_{variant}_transfer_loss.svg",
    log:
        "logs/plots/{model}_{variant}_transfer_loss.log",
    benchmark:
        "logs/benchmarks/plots/{model}_{variant}_transfer_loss.tsv"
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_loss.py"


rule plot_lora_loss:
    input:
        "results/{model}/{variant}/lora/loss.csv",
    output:
        png=report(
            "results/plots/{model}_{variant}_lora_loss.png",
            caption="../report/lora_loss.rst",
            category="Training",
            labels={"model": "{model}", "variant": "{variant}", "plot": "lora"},
        ),
        svg="results/plots/{model}_{variant}_lora_loss.svg",
    log:
        "logs/plots/{model}_{variant}_lora_loss.log",
    benchmark:
        "logs/benchmarks/plots/{model}_{variant}_lora_loss.tsv"
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_loss.py"


rule plot_quality:
    input:
        perplexity="results/{model}/{variant}/quality/{device}/perplexity.csv",
        passkey="results/{model}/{variant}/quality/{device}/passkey.csv",
    output:
        nll=report(
            "results/plots/{model}_{variant}_nll_{device}.png",
            caption="../report/nll.rst",
            category="Quality",
            labels={
                "model": "{model}",
                "variant": "{variant}",
                "device": "{device}",
                "plot": "nll",
            },
        ),
        nll_svg="results/plots/{model}_{variant}_nll_{device}.svg",
        passkey=report(
            "results/plots/{model}_{variant}_passkey_{device}.png",
            caption="../report/passkey.rst",
            category="Quality",
            labels={
                "model": "{model}",
                "variant": "{variant}",
                "device": "{device}",
                "plot": "passkey",
            },
        ),
        passkey_svg="results/plots/{model}_{variant}_passkey_{device}.svg",
    log:
        "logs/plots/{model}_{variant}_quality_{device}.log",
    benchmark:
        "logs/benchmarks/plots/{model}_{variant}_quality_{device}.tsv"
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/plot_quality.py"


rule report:
    input:
        **report_inputs(),
    output:
        report(
            "results/report.html",
            caption="../report/report.rst",
            category="Report",
        ),
    log:
        "logs/report.log",
    benchmark:
        "logs/benchmarks/report.tsv"
    conda:
        "../../envs/report.yaml"
    params:
        config=canonical(config),
    script:
        "../scripts/report.py"
