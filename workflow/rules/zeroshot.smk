# The zero-shot suite through lm-eval (hybrid_llama.eval.zeroshot): one job per model x slot x device
# x stage, for base and the variants zeroshot.variants names (their final stage). Every job scores the
# same seeded sample, so the report pairs each variant's examples with base's.


rule zeroshot:
    input:
        unpack(stage_inputs),
    output:
        path("zeroshot"),
    log:
        log_of("zeroshot/{model}/{variant}/{device}/{stage}"),
    benchmark:
        benchmark_of("zeroshot/{model}/{variant}/{device}/{stage}")
    # The longest evaluations: started first, so none is left alone at the end of the run.
    priority: 5
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        zeroshot=P.zeroshot_settings(),
    script:
        "../scripts/zeroshot.py"
