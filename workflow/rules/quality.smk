# Quality vs context length: perplexity on held-out transfer-corpus text and passkey retrieval,
# one job per stage (base and base_lora once), then one table per variant holding every stage.


rule perplexity:
    input:
        unpack(stage_inputs),
        manifest="resources/data/transfer/{model}.json",
    output:
        "results/{model}/{variant}/quality/{device}/{stage}/perplexity.csv",
    log:
        "logs/perplexity/{model}/{variant}/{device}/{stage}.log",
    benchmark:
        "logs/benchmarks/perplexity/{model}/{variant}/{device}/{stage}.tsv"
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        source=data_source("transfer"),
        perplexity=section("quality", "perplexity"),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/perplexity.py"


rule passkey:
    input:
        unpack(stage_inputs),
    output:
        "results/{model}/{variant}/quality/{device}/{stage}/passkey.csv",
    log:
        "logs/passkey/{model}/{variant}/{device}/{stage}.log",
    benchmark:
        "logs/benchmarks/passkey/{model}/{variant}/{device}/{stage}.tsv"
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        passkey=section("quality", "passkey"),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/passkey.py"


rule quality_table:
    input:
        lambda wildcards: quality_stage_files(
            wildcards.model, wildcards.variant, wildcards.device, wildcards.kind
        ),
    output:
        "results/{model}/{variant}/quality/{device}/{kind}.csv",
    log:
        "logs/quality_table/{model}/{variant}/{device}/{kind}.log",
    benchmark:
        "logs/benchmarks/quality_table/{model}/{variant}/{device}/{kind}.tsv"
    wildcard_constraints:
        variant=_alternatives(VARIANTS),
        kind="perplexity|passkey",
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/concat_csv.py"


rule generations:
    input:
        unpack(stage_inputs),
    output:
        "results/{model}/{variant}/generations/{stage}.json",
    log:
        "logs/generations/{model}/{variant}/{stage}.log",
    benchmark:
        "logs/benchmarks/generations/{model}/{variant}/{stage}.tsv"
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=int(is_cuda(config["generations"]["device"])),
    params:
        hybrid=stage_hybrid,
        generations=section("generations"),
    script:
        "../scripts/generations.py"
