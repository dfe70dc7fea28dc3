# Throughput and memory vs prompt length: the base model (SDPA) against every variant's hybrid
# layout with each backend. Speed does not depend on trained weights, so this needs only the
# base weights and the variants' hybrid settings.


rule throughput:
    input:
        weights=lambda wildcards: weights(wildcards.model),
    output:
        "results/{model}/throughput/{device}.csv",
    log:
        "logs/throughput/{model}/{device}.log",
    benchmark:
        "logs/benchmarks/throughput/{model}/{device}.tsv"
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["throughput"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrids={v: hybrid_cfg(v) for v in VARIANTS},
        throughput=section("throughput"),
    script:
        "../scripts/throughput.py"
