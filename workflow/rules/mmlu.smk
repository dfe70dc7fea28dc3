# MMLU through lm-eval: one job per model x slot x device x stage x format x shots, so adding a
# shots value adds only those jobs. Base and base_lora are evaluated once, not per variant.


rule mmlu:
    input:
        unpack(mmlu_inputs),
    output:
        path("mmlu"),
    log:
        log_of("mmlu/{model}/{variant}/{device}/{stage}/{fmt}_{shots}shot"),
    benchmark:
        benchmark_of("mmlu/{model}/{variant}/{device}/{stage}/{fmt}_{shots}shot")
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        mmlu=P.mmlu_settings(),
    script:
        "../scripts/mmlu.py"
