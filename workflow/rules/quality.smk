# Quality vs context length: perplexity on held-out transfer-corpus text and passkey retrieval,
# one job per stage (base and base_lora once), and the component diagnostic of every hybrid stage
# (how the output's normalizer splits between the window and the linear part); then one table per
# variant and kind holding every stage.


rule perplexity:
    input:
        unpack(stage_inputs),
        # the corpora training used: their documents never count as held out
        manifests=lambda wildcards: P.corpus_files(
            wildcards.model, name="transfer_manifest"
        ),
    output:
        path("stage_quality", kind="perplexity"),
    log:
        log_of("perplexity/{model}/{variant}/{device}/{stage}"),
    benchmark:
        benchmark_of("perplexity/{model}/{variant}/{device}/{stage}")
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        source=P.data_source("transfer"),
        perplexity=P.section("quality", "perplexity"),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/perplexity.py"


rule passkey:
    input:
        unpack(stage_inputs),
    output:
        path("stage_quality", kind="passkey"),
    log:
        log_of("passkey/{model}/{variant}/{device}/{stage}"),
    benchmark:
        benchmark_of("passkey/{model}/{variant}/{device}/{stage}")
    # The longest evaluations: started first, so none is left alone at the end of the run.
    priority: 5
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        # the long lengths only for the slots of quality.long_context.slots.passkey
        passkey=lambda wildcards: P.quality_settings("passkey", wildcards.variant),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/passkey.py"


rule components:
    input:
        unpack(stage_inputs),
        manifests=lambda wildcards: P.corpus_files(
            wildcards.model, name="transfer_manifest"
        ),
    output:
        path("stage_quality", kind="components"),
    log:
        log_of("components/{model}/{variant}/{device}/{stage}"),
    benchmark:
        benchmark_of("components/{model}/{variant}/{device}/{stage}")
    wildcard_constraints:
        variant="|".join(VARIANTS),
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        source=P.data_source("transfer"),
        components=P.section("quality", "components"),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/components.py"


rule quality_table:
    input:
        lambda wildcards: P.stage_quality_files(
            wildcards.model, wildcards.variant, wildcards.device, wildcards.kind
        ),
    output:
        path("quality"),
    log:
        log_of("quality_table/{model}/{variant}/{device}/{kind}"),
    benchmark:
        benchmark_of("quality_table/{model}/{variant}/{device}/{kind}")
    wildcard_constraints:
        variant="|".join(VARIANTS),
        kind="perplexity|passkey|components|books|niah",
    conda:
        "../../envs/report.yaml"
    script:
        "../scripts/concat_csv.py"


rule generations:
    input:
        unpack(stage_inputs),
    output:
        path("generations"),
    log:
        log_of("generations/{model}/{variant}/{stage}"),
    benchmark:
        benchmark_of("generations/{model}/{variant}/{stage}")
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=int(is_cuda(config["generations"]["device"])),
    params:
        hybrid=stage_hybrid,
        generations=P.section("generations"),
    script:
        "../scripts/generations.py"
