# LoRA finetune on instruction data: of each variant's transferred hybrid model, and of the base
# model (the base_lora control, independent of the variants).


rule lora:
    input:
        weights=lambda wildcards: weights(wildcards.model),
        instruct="resources/data/instruct/{model}.safetensors",
        layers="results/{model}/{variant}/transfer/hybrid_layers.safetensors",
    output:
        adapter="results/{model}/{variant}/lora/adapter_model.safetensors",
        adapter_config="results/{model}/{variant}/lora/adapter_config.json",
        metrics="results/{model}/{variant}/lora/metrics.json",
        loss="results/{model}/{variant}/lora/loss.csv",
    log:
        "logs/lora/{model}/{variant}.log",
    benchmark:
        "logs/benchmarks/lora/{model}/{variant}.tsv"
    wildcard_constraints:
        variant=_alternatives(VARIANTS),
    conda:
        "../../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        gpu=lambda wildcards: int(is_cuda(lora_cfg(wildcards.variant)["device"])),
    params:
        hybrid=lambda wildcards: hybrid_cfg(wildcards.variant),
        lora=lambda wildcards: lora_cfg(wildcards.variant),
    script:
        "../scripts/lora.py"


rule base_lora:
    input:
        weights=lambda wildcards: weights(wildcards.model),
        instruct="resources/data/instruct/{model}.safetensors",
    output:
        adapter="results/{model}/base_lora/lora/adapter_model.safetensors",
        adapter_config="results/{model}/base_lora/lora/adapter_config.json",
        metrics="results/{model}/base_lora/lora/metrics.json",
        loss="results/{model}/base_lora/lora/loss.csv",
    log:
        "logs/lora/{model}/base_lora.log",
    benchmark:
        "logs/benchmarks/lora/{model}/base_lora.tsv"
    conda:
        "../../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        gpu=int(is_cuda(lora_cfg("base_lora")["device"])),
    params:
        hybrid=None,
        lora=lora_cfg("base_lora"),
    script:
        "../scripts/lora.py"
