# Data: the packed transfer corpus and the tokenized instruction data, per model (they depend on
# the tokenizer), and MMLU from Hugging Face when there is no local mirror. These steps download,
# so they run on the submitting host (localrules).


localrules:
    transfer_data,
    instruct_data,
    mmlu_download,


rule transfer_data:
    input:
        weights=lambda wildcards: weights(wildcards.model),
        local=local_data_inputs("transfer"),
    output:
        tokens="resources/data/transfer/{model}.safetensors",
        manifest="resources/data/transfer/{model}.json",
    log:
        "logs/transfer_data/{model}.log",
    benchmark:
        "logs/benchmarks/transfer_data/{model}.tsv"
    conda:
        "../../envs/train.yaml"
    params:
        source=data_source("transfer"),
        settings=data_settings("transfer"),
    script:
        "../scripts/transfer_data.py"


rule instruct_data:
    input:
        weights=lambda wildcards: weights(wildcards.model),
        local=local_data_inputs("instruct"),
    output:
        tokens="resources/data/instruct/{model}.safetensors",
        manifest="resources/data/instruct/{model}.json",
    log:
        "logs/instruct_data/{model}.log",
    benchmark:
        "logs/benchmarks/instruct_data/{model}.tsv"
    conda:
        "../../envs/train.yaml"
    params:
        source=data_source("instruct"),
        settings=data_settings("instruct"),
    script:
        "../scripts/instruct_data.py"


rule mmlu_download:
    output:
        manifest="resources/data/mmlu/manifest.json",
    log:
        "logs/mmlu_download.log",
    benchmark:
        "logs/benchmarks/mmlu_download.tsv"
    conda:
        "../../envs/eval.yaml"
    params:
        id=config["data"]["mmlu"]["hf"],
    script:
        "../scripts/mmlu_download.py"
