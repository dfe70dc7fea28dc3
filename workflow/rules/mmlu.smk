# MMLU through lm-eval: one job per model x slot x device x stage x format x shots, so adding a
# shots value adds only those jobs. Base and base_lora are evaluated once, not per variant.


rule mmlu:
    input:
        unpack(mmlu_inputs),
    output:
        "results/{model}/{variant}/mmlu/{device}/{stage}/{fmt}_{shots}shot.json",
    log:
        "logs/mmlu/{model}/{variant}/{device}/{stage}/{fmt}_{shots}shot.log",
    benchmark:
        "logs/benchmarks/mmlu/{model}/{variant}/{device}/{stage}/{fmt}_{shots}shot.tsv"
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        mmlu=mmlu_settings(),
    script:
        "../scripts/mmlu.py"
