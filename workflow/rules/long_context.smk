# Quality at long contexts, one job per stage like the other quality kinds (their tables come from
# quality_table): NLL vs context on the held-out books (data.books) and the multi-key needle in a
# haystack. Lengths from quality.long_context.from_len run only for the slots listed per kind under
# quality.long_context.slots (base and the recommended variant by default), see pipeline.long_context.
# Also the base model's retrieval heads, ranked once per model for the variants that keep the best
# ones exact (hybrid.softmax_heads: {top: N}).


rule book_nll:
    input:
        unpack(stage_inputs),
        books=P.book_files(),
    output:
        path("stage_quality", kind="books"),
    log:
        log_of("book_nll/{model}/{variant}/{device}/{stage}"),
    benchmark:
        benchmark_of("book_nll/{model}/{variant}/{device}/{stage}")
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        source=P.books_source(),
        books=lambda wildcards: P.quality_settings("books", wildcards.variant),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/book_nll.py"


rule niah:
    input:
        unpack(stage_inputs),
        books=(
            P.book_files()
            if "book" in config["quality"]["long_context"]["niah"]["haystacks"]
            else []
        ),
    output:
        path("stage_quality", kind="niah"),
    log:
        log_of("niah/{model}/{variant}/{device}/{stage}"),
    benchmark:
        benchmark_of("niah/{model}/{variant}/{device}/{stage}")
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    resources:
        gpu=gpu_of_device,
    params:
        hybrid=stage_hybrid,
        source=P.books_source(),
        niah=lambda wildcards: P.quality_settings("niah", wildcards.variant),
        dtype=config["quality"]["dtype"],
    script:
        "../scripts/niah.py"


rule retrieval_heads:
    input:
        weights=weights,
    output:
        path("retrieval_heads"),
    log:
        log_of("retrieval_heads/{model}"),
    benchmark:
        benchmark_of("retrieval_heads/{model}")
    # It gates the recommended variant's evaluations, the longest of the run.
    priority: 10
    conda:
        "../../envs/eval.yaml"
    threads: config["threads"]["eval"]
    params:
        ranking=P.section("retrieval_heads"),
    script:
        "../scripts/retrieval_heads.py"


rule plot_long_context:
    input:
        books=lambda wildcards: P.quality_tables(
            wildcards.model, wildcards.device, "books"
        ),
    output:
        books=report(
            path("plot_books_nll"),
            caption="../report/books_nll.rst",
            category="Quality",
            labels={"model": "{model}", "device": "{device}", "plot": "books NLL"},
        ),
        books_svg=svg(path("plot_books_nll")),
    log:
        log_of("plots/{model}/long_context_{device}"),
    benchmark:
        benchmark_of("plots/{model}/long_context_{device}")
    conda:
        "../../envs/report.yaml"
    params:
        windows={v: P.hybrid(v)["window"] for v in VARIANTS},
        heldout=config["data"]["books"]["heldout"],
    script:
        "../scripts/plot_long_context.py"
