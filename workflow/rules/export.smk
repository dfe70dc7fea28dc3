# The final stage of every trained variant (derived ones included) as a model directory: model type
# hybrid_llama (loads with `import hybrid_llama` + AutoModelForCausalLM, or lm-eval through
# `python -m hybrid_llama.lm_eval`), safetensors + JSON + tokenizer + a model card (README.md) that
# quotes this run's training metrics, quality tables and throughput. The card's numbers are inputs:
# an export reruns when they change (it writes the same weights again, and the card with them).


rule export:
    input:
        unpack(lambda wildcards: P.export_inputs(wildcards.model, wildcards.variant)),
    output:
        directory(path("export")),
    log:
        log_of("export/{model}/{variant}"),
    benchmark:
        benchmark_of("export/{model}/{variant}")
    wildcard_constraints:
        variant="|".join(VARIANTS),
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    params:
        stage=lambda wildcards: P.export_stage(wildcards.variant),
        hybrid=lambda wildcards: P.hybrid(wildcards.variant),
        base_spec=lambda wildcards: P.models[wildcards.model],
        data={
            "transfer": P.data_source("transfer"),
            "instruct": P.data_source("instruct"),
        },
    script:
        "../scripts/export.py"
