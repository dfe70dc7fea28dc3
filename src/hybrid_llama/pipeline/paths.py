"""Where every artifact of the workflow lives: one table of path templates and its wildcards.

Rules take their inputs and outputs from ``PATHS`` and the report finds files with
``parse_result_path``, so renaming an artifact is a one-line change. ``{variant}`` is the result
*slot*: a variant's name, or a shared stage's name (base, base_lora) for results that do not depend
on a variant. The stage names and MMLU formats come from ``hybrid_llama.names``.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybrid_llama.names import (
    CORPUS_PARTS,
    MMLU_FORMATS,
    RECALL_SHAPE_PATTERN,
    SHARED_STAGES,
    STAGE_LABELS,
    STAGES,
    VARIANT_STAGES,
)

__all__ = [
    "MMLU_FORMATS",
    "ROW_FILES",
    "PATHS",
    "LONG_CONTEXT_KINDS",
    "QUALITY_KINDS",
    "SHARED_STAGES",
    "STAGES",
    "STAGE_ARTIFACTS",
    "STAGE_LABELS",
    "VARIANT_STAGES",
    "WILDCARD_PATTERNS",
    "corpus_parts",
    "is_cuda",
    "parse_result_path",
    "path",
    "shared_data_dir",
]

# The files a stage's model is built from, besides the base weights.
STAGE_ARTIFACTS = {
    "base": (),
    "converted": (),
    "transfer": ("hybrid_layers",),
    "transfer_lora": ("hybrid_layers", "adapter"),
    "base_lora": ("adapter",),
}
QUALITY_KINDS = ("perplexity", "passkey", "components", "books", "niah")
# The kinds whose long lengths run only for some slots (quality.long_context), and where each kind's
# settings live in the config.
LONG_CONTEXT_KINDS = ("books", "passkey", "niah")

# Every artifact of the workflow. {variant} is the result slot: a variant's name, or a shared
# stage's name (base, base_lora) for results that do not depend on a variant.
PATHS: dict[str, str] = {
    "weights": "resources/weights/{model}/config.json",
    "weight_hashes": "resources/weights/{model}/hashes.json",
    # One packed corpus per (seq_len, num_tokens) that a variant trains on; num_tokens "all" = no cap.
    "transfer_corpus": "resources/data/transfer/{model}/L{seq_len}_N{num_tokens}.safetensors",
    "transfer_manifest": "resources/data/transfer/{model}/L{seq_len}_N{num_tokens}.json",
    # Rows cut from the training books (transfer.corpus: books), one file per (seq_len, num_tokens).
    "book_rows": "resources/data/book_rows/{model}/L{seq_len}_N{num_tokens}.safetensors",
    "book_rows_manifest": "resources/data/book_rows/{model}/L{seq_len}_N{num_tokens}.json",
    # transfer.corpus mixed: half the tokens from each of the two files above, rows interleaved
    "mixed_rows": "resources/data/mixed_rows/{model}/L{seq_len}_N{num_tokens}.safetensors",
    "mixed_rows_manifest": "resources/data/mixed_rows/{model}/L{seq_len}_N{num_tokens}.json",
    # lora.recall_rows: facts set in training-book text and asked for at the row's end
    "recall_rows": "resources/data/recall_rows/{model}/L{seq_len}_R{rows}_F{facts}.safetensors",
    "recall_rows_manifest": "resources/data/recall_rows/{model}/L{seq_len}_R{rows}_F{facts}.json",
    "instruct_data": "resources/data/instruct/{model}.safetensors",
    "instruct_manifest": "resources/data/instruct/{model}.json",
    "mmlu_manifest": "resources/data/mmlu/manifest.json",
    # The books taken from the Hub (data.books), laid out like the mirror's directory.
    "book": "resources/data/books/{book}.txt",
    "books_manifest": "resources/data/books/manifest.json",
    "hybrid_layers": "results/{model}/{variant}/transfer/hybrid_layers.safetensors",
    "transfer_metrics": "results/{model}/{variant}/transfer/metrics.json",
    "transfer_loss": "results/{model}/{variant}/transfer/loss.csv",
    "teacher_states": "results/{model}/{variant}/transfer/teacher_states.safetensors",
    "adapter": "results/{model}/{variant}/lora/adapter_model.safetensors",
    "adapter_config": "results/{model}/{variant}/lora/adapter_config.json",
    "lora_metrics": "results/{model}/{variant}/lora/metrics.json",
    "lora_loss": "results/{model}/{variant}/lora/loss.csv",
    "mmlu": "results/{model}/{variant}/mmlu/{device}/{stage}/{fmt}_{shots}shot.json",
    # The zero-shot suite (lm-eval tasks of hybrid_llama.tasks) of one stage, every example's scores kept.
    "zeroshot": "results/{model}/{variant}/zeroshot/{device}/{stage}.json",
    "stage_quality": "results/{model}/{variant}/quality/{device}/{stage}/{kind}.csv",
    "quality": "results/{model}/{variant}/quality/{device}/{kind}.csv",
    "generations": "results/{model}/{variant}/generations/{stage}.json",
    # The final stage of a trained variant as a model directory (model type hybrid_llama: loads with
    # `import hybrid_llama` + AutoModelForCausalLM) and its model card.
    "export": "results/{model}/{variant}/model",
    "model_card": "results/{model}/{variant}/model/README.md",
    "throughput": "results/{model}/throughput/{device}.csv",
    # The base model's KV heads ranked by their attention on a passkey (softmax_heads: {top: N}).
    "retrieval_heads": "results/{model}/retrieval_heads.json",
    # One folder per model (and variant): names joined by '_' could not be split back apart.
    "plot_mmlu": "results/plots/{model}/mmlu_{fmt}.png",
    "plot_throughput": "results/plots/{model}/throughput_{device}.png",
    "plot_memory": "results/plots/{model}/memory_{device}.png",
    # Quality plots put every variant on one axis: one figure per (model, device).
    "plot_nll": "results/plots/{model}/nll_{device}.png",
    "plot_passkey": "results/plots/{model}/passkey_{device}.png",
    "plot_components": "results/plots/{model}/components_{device}.png",
    "plot_books_nll": "results/plots/{model}/books_nll_{device}.png",
    "plot_transfer_loss": "results/plots/{model}/{variant}/transfer_loss.png",
    "plot_lora_loss": "results/plots/{model}/{variant}/lora_loss.png",
    "report": "results/report.html",
    "log": "logs/{job}.log",
    "benchmark": "logs/benchmarks/{job}.tsv",
    "checkpoints": "resources/checkpoints/{kind}/{model}/{variant}/{key}",
}

# The row file of each corpus (its manifest: the same name with "_manifest").
ROW_FILES = {"documents": "transfer_corpus", "books": "book_rows", "mixed": "mixed_rows"}


def corpus_parts(corpus: str, seq_len: str, num_tokens: str) -> dict[str, dict[str, str]]:
    """The row files a corpus is made of, as ``{part: wildcards}``: its documents or its books, or for
    'mixed' half the tokens from each (the documents the first half; "all" = every row of both)."""
    parts = CORPUS_PARTS[corpus]
    if len(parts) == 1 or num_tokens == "all":
        return {part: {"seq_len": seq_len, "num_tokens": num_tokens} for part in parts}
    half = int(num_tokens) // 2
    return {part: {"seq_len": seq_len, "num_tokens": str(n)} for part, n in zip(parts, (half, int(num_tokens) - half))}


# What each wildcard may look like (names come from the config, checked against this pattern by the
# schema). Results are matched most specific first, so e.g. a plot is never read as a stage file.
WILDCARD_PATTERNS = {
    "model": r"[A-Za-z0-9][A-Za-z0-9_-]*",
    "variant": r"[A-Za-z0-9][A-Za-z0-9_-]*",
    "stage": "|".join(STAGES),
    "device": r"cpu|cuda(?::\d+)?(?:-[A-Za-z0-9_]+)?",
    "fmt": "|".join(MMLU_FORMATS),
    "shots": r"\d+",
    "kind": r"[a-z_]+",
    "seq_len": r"\d+",
    "num_tokens": r"\d+|all",
    "rows": r"\d+",
    "facts": RECALL_SHAPE_PATTERN,  # RecallShape.name
    "book": r"[A-Za-z0-9][A-Za-z0-9_.-]*",  # a file stem, as data.books names it
    "job": r"[A-Za-z0-9_./:-]+",  # a log's rule/wildcards path
    "key": r"[0-9a-f]+",
}


def path(name: str, **wildcards: Any) -> str:
    """The path of artifact ``name`` with its wildcards filled in (any left out stay as ``{x}``)."""
    template = PATHS[name]
    return re.sub(r"\{(\w+)\}", lambda m: str(wildcards.get(m.group(1), m.group(0))), template)


@functools.cache
def _path_regex(name: str) -> re.Pattern:
    parts = re.split(r"(\{\w+\})", PATHS[name])
    regex = "".join(
        f"(?P<{p[1:-1]}>{WILDCARD_PATTERNS.get(p[1:-1], '[^/]+')})" if p.startswith("{") else re.escape(p)
        for p in parts
    )
    return re.compile(regex + "$")


def parse_result_path(file: str | os.PathLike, names: Iterable[str] | None = None) -> tuple[str, dict[str, str]]:
    """(artifact name, wildcards) of a workflow file, matched against ``PATHS`` (relative or absolute
    paths; the template must match the path's end). Raises ValueError for a file no template matches."""
    text = Path(file).as_posix()
    for name in names or PATHS:
        m = _path_regex(name).search(text)
        if m and (m.start() == 0 or text[m.start() - 1] == "/"):
            return name, m.groupdict()
    raise ValueError(f"{file}: not a workflow artifact (no template in hybrid_llama.pipeline.PATHS matches)")


def is_cuda(device: str) -> bool:
    """Whether a config/wildcard device (a cluster label allowed: 'cuda:1-a100') needs a GPU."""
    return str(device).startswith("cuda")


def shared_data_dir(setting: str = "auto", repo: str | os.PathLike | None = None) -> Path:
    """The offline data mirror: ``setting`` unless 'auto', else $HYBRID_LLAMA_SHARED_DATA, else
    ``shared/data`` beside the repository (``repo``, default this checkout)."""
    if setting != "auto":
        return Path(setting)
    env = os.environ.get("HYBRID_LLAMA_SHARED_DATA")
    if env:
        return Path(env)
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parents[3]  # src/hybrid_llama/pipeline/
    return repo.resolve().parent / "shared" / "data"
