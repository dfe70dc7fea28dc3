# Attention transfer: train each variant's hybrid layers to reproduce the frozen teacher's
# attention outputs. Reruns when the variant's hybrid settings or transfer settings change.


rule transfer:
    input:
        weights=lambda wildcards: weights(wildcards.model),
        tokens="resources/data/transfer/{model}.safetensors",
    output:
        layers="results/{model}/{variant}/transfer/hybrid_layers.safetensors",
        metrics="results/{model}/{variant}/transfer/metrics.json",
        loss="results/{model}/{variant}/transfer/loss.csv",
    log:
        "logs/transfer/{model}/{variant}.log",
    benchmark:
        "logs/benchmarks/transfer/{model}/{variant}.tsv"
    wildcard_constraints:
        variant=_alternatives(VARIANTS),
    conda:
        "../../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        gpu=lambda wildcards: int(is_cuda(transfer_cfg(wildcards.variant)["device"])),
    params:
        hybrid=lambda wildcards: hybrid_cfg(wildcards.variant),
        train=lambda wildcards: transfer_cfg(wildcards.variant),
    script:
        "../scripts/transfer.py"
