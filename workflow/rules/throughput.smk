# Throughput and memory vs prompt length: the base model (SDPA) against every trained variant's
# hybrid layout with each backend that implements it. Speed does not depend on trained weights, so
# this needs only the base weights and the variants' hybrid settings.


rule throughput:
    input:
        # the ranked heads of the timed variants that keep some exact (softmax_heads: {top: N})
        unpack(
            lambda wildcards: P.heads_ranking(wildcards.model, P.throughput_variants())
        ),
        weights=weights,
    output:
        path("throughput"),
    log:
        log_of("throughput/{model}/{device}"),
    benchmark:
        benchmark_of("throughput/{model}/{device}")
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["throughput"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrids={v: P.hybrid(v) for v in P.throughput_variants()},
        throughput=P.section("throughput"),
        # the variants timed at the long lengths, 'recommended' resolved
        long=long_context.throughput_long(P),
    script:
        "../scripts/throughput.py"
