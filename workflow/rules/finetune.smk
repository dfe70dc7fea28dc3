# LoRA finetune of each variant's transferred hybrid model (on instruction data, or distilled from
# the base model on the variant's transfer corpus), and of the base model on instruction data (the
# base_lora control, independent of the variants). A variant derived from another ('from') with a
# 'lora' of its own starts from its parent's transfer (P.lora_inputs).


rule lora:
    input:
        unpack(lambda wildcards: P.lora_inputs(wildcards.model, wildcards.variant)),
        weights=weights,
        data=lambda wildcards: P.lora_data(wildcards.model, wildcards.variant),
    output:
        adapter=path("adapter"),
        adapter_config=path("adapter_config"),
        metrics=path("lora_metrics"),
        loss=path("lora_loss"),
    log:
        log_of("lora/{model}/{variant}"),
    benchmark:
        benchmark_of("lora/{model}/{variant}")
    wildcard_constraints:
        variant="|".join(VARIANTS),
    # Training gates most of the DAG: run it before the evaluations that could wait.
    priority: 10
    conda:
        "../../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        gpu=lambda wildcards: int(is_cuda(P.lora(wildcards.variant)["device"])),
    params:
        hybrid=lambda wildcards: P.hybrid(wildcards.variant),
        lora=lambda wildcards: P.lora_train(wildcards.variant),
    script:
        "../scripts/lora.py"


rule base_lora:
    input:
        weights=weights,
        data=path("instruct_data"),
    output:
        adapter=path("adapter", variant="base_lora"),
        adapter_config=path("adapter_config", variant="base_lora"),
        metrics=path("lora_metrics", variant="base_lora"),
        loss=path("lora_loss", variant="base_lora"),
    log:
        log_of("lora/{model}/base_lora"),
    benchmark:
        benchmark_of("lora/{model}/base_lora")
    # Training gates most of the DAG: run it before the evaluations that could wait.
    priority: 10
    conda:
        "../../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        gpu=int(is_cuda(P.lora("base_lora")["device"])),
    params:
        hybrid=None,
        lora=P.lora("base_lora"),
    script:
        "../scripts/lora.py"
