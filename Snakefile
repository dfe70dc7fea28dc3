# hybrid-llama: linearize a pretrained Llama (sliding-window softmax + linear attention), train it by
# attention transfer and LoRA, and evaluate every stage. The library lives in src/hybrid_llama;
# the rules in workflow/rules; see docs/workflow.md.
#   snakemake --cores all results/report.html


from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


validate(config, "config/schema.yaml")


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/weights.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/transfer.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/mmlu.smk"
include: "workflow/rules/zeroshot.smk"
include: "workflow/rules/quality.smk"
include: "workflow/rules/long_context.smk"
include: "workflow/rules/throughput.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        "results/report.html",
