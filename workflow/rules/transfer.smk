# Attention transfer: train each variant's hybrid layers to reproduce the frozen teacher's
# attention outputs. Reruns when the variant's hybrid settings or transfer settings change.


rule transfer:
    input:
        # the ranked heads it keeps exact, when softmax_heads is {top: N}
        unpack(lambda wildcards: P.heads_ranking(wildcards.model, [wildcards.variant])),
        weights=weights,
        tokens=lambda wildcards: P.training_rows(wildcards.model, wildcards.variant),
    output:
        layers=path("hybrid_layers"),
        metrics=path("transfer_metrics"),
        loss=path("transfer_loss"),
        # the teacher's final hidden states for a distilled LoRA stage (no rows unless transfer.teacher_states)
        teacher_states=path("teacher_states"),
    log:
        log_of("transfer/{model}/{variant}"),
    benchmark:
        benchmark_of("transfer/{model}/{variant}")
    wildcard_constraints:
        variant="|".join(VARIANTS),
    # Training gates most of the DAG: run it before the evaluations that could wait.
    priority: 10
    conda:
        "../../envs/train.yaml"
    threads: config["threads"]["train"]
    resources:
        gpu=lambda wildcards: int(is_cuda(P.transfer(wildcards.variant)["device"])),
    params:
        hybrid=lambda wildcards: P.hybrid(wildcards.variant),
        train=lambda wildcards: P.transfer_train(wildcards.variant),
    script:
        "../scripts/transfer.py"
