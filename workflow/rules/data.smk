# Data: the packed transfer corpora and book rows (one per model and per seq_len x num_tokens that a
# variant trains on) and the tokenized instruction data, per model (they depend on the tokenizer), and MMLU
# and the long-document books from Hugging Face when there is no local mirror. These steps
# download, so they run on the submitting host (localrules).


localrules:
    transfer_data,
    instruct_data,
    mmlu_download,
    books_download,


rule transfer_data:
    input:
        weights=weights,
        local=P.local_data_inputs("transfer"),
    output:
        tokens=path("transfer_corpus"),
        manifest=path("transfer_manifest"),
    log:
        log_of("transfer_data/{model}/L{seq_len}_N{num_tokens}"),
    benchmark:
        benchmark_of("transfer_data/{model}/L{seq_len}_N{num_tokens}")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/train.yaml"
    params:
        source=P.data_source("transfer"),
        settings=lambda wildcards: P.corpus_settings(
            wildcards.seq_len, wildcards.num_tokens
        ),
    script:
        "../scripts/transfer_data.py"


# Rows cut from the training books (every book of data.books not held out), for a variant whose
# transfer.corpus is books: one file per seq_len x num_tokens, read by transfer and distillation.
rule book_rows:
    input:
        weights=weights,
        books=P.training_book_files(),
    output:
        tokens=path("book_rows"),
        manifest=path("book_rows_manifest"),
    log:
        log_of("book_rows/{model}/L{seq_len}_N{num_tokens}"),
    benchmark:
        benchmark_of("book_rows/{model}/L{seq_len}_N{num_tokens}")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/train.yaml"
    params:
        books=P.books_source(),
        settings=lambda wildcards: P.book_rows_settings(
            wildcards.seq_len, wildcards.num_tokens
        ),
    script:
        "../scripts/book_rows.py"


# transfer.corpus (or lora.corpus) mixed: half the tokens packed documents, half book rows.
rule mixed_rows:
    input:
        unpack(
            lambda wildcards: P.mixed_inputs(
                wildcards.model, wildcards.seq_len, wildcards.num_tokens
            )
        ),
    output:
        tokens=path("mixed_rows"),
        manifest=path("mixed_rows_manifest"),
    log:
        log_of("mixed_rows/{model}/L{seq_len}_N{num_tokens}"),
    benchmark:
        benchmark_of("mixed_rows/{model}/L{seq_len}_N{num_tokens}")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/train.yaml"
    script:
        "../scripts/mixed_rows.py"


# lora.recall_rows: running text of the training books with facts set in it and asked for at the
# row's end (and with lora.recall_asks, inside it: facts "8Q2"), for a distillation that weighs the
# answers (one file per seq_len x rows x facts).
rule recall_rows:
    input:
        weights=weights,
        books=P.training_book_files(),
    output:
        tokens=path("recall_rows"),
        manifest=path("recall_rows_manifest"),
    log:
        log_of("recall_rows/{model}/L{seq_len}_R{rows}_F{facts}"),
    benchmark:
        benchmark_of("recall_rows/{model}/L{seq_len}_R{rows}_F{facts}")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/train.yaml"
    params:
        books=P.books_source(),
    script:
        "../scripts/recall_rows.py"


rule instruct_data:
    input:
        weights=weights,
        local=P.local_data_inputs("instruct"),
    output:
        tokens=path("instruct_data"),
        manifest=path("instruct_manifest"),
    log:
        log_of("instruct_data/{model}"),
    benchmark:
        benchmark_of("instruct_data/{model}")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/train.yaml"
    params:
        source=P.data_source("instruct"),
        settings=P.data_settings("instruct"),
    script:
        "../scripts/instruct_data.py"


rule mmlu_download:
    output:
        manifest=path("mmlu_manifest"),
    log:
        log_of("mmlu_download"),
    benchmark:
        benchmark_of("mmlu_download")
    conda:
        "../../envs/eval.yaml"
    params:
        id=config["data"]["mmlu"]["hf"],
    script:
        "../scripts/mmlu_download.py"


# Only the book jobs of a config whose books come from the Hub (data.books) ask for these files.
rule books_download:
    output:
        books=P.hub_book_files(),
        manifest=path("books_manifest"),
    log:
        log_of("books_download"),
    benchmark:
        benchmark_of("books_download")
    # It gates training, which waits for two free cores: run it before the evaluations.
    priority: 10
    conda:
        "../../envs/eval.yaml"
    params:
        source=P.books_hub_source(),
        books=P.hub_books(),
    script:
        "../scripts/books_download.py"
