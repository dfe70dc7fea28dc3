"""The shared vocabulary of stages and MMLU formats: plain names, importable by every layer.

The workflow (``hybrid_llama.pipeline``), the evaluations and the report all speak of the same
stages; they import the names from here so that no library layer has to import the workflow.
"""

from __future__ import annotations

STAGES = ("base", "converted", "transfer", "transfer_lora", "base_lora")
# Shared stages (the base model and the base + LoRA control) do not depend on a variant.
SHARED_STAGES = ("base", "base_lora")
VARIANT_STAGES = ("converted", "transfer", "transfer_lora")
STAGE_LABELS = {
    "base": "base",
    "converted": "hybrid as converted (no training)",
    "transfer": "hybrid after transfer",
    "transfer_lora": "hybrid after transfer + LoRA",
    "base_lora": "base + LoRA (control)",
}
MMLU_FORMATS = ("mc", "cloze")
# The transfer section's keys that choose the training rows (a file of their own, built before
# training) rather than how training runs.
CORPUS_KEYS = ("seq_len", "num_tokens", "corpus")
# The lora keys of recall rows (hybrid_llama.recall_rows); a stage without recall rows is run without them.
RECALL_KEYS = ("recall_rows", "recall_facts", "recall_asks", "recall_seq_len", "answer_weight", "answer_target")
# The row files each training corpus is made of: a mixed corpus takes half its tokens from each.
CORPUS_PARTS = {"documents": ("documents",), "books": ("books",), "mixed": ("documents", "books")}


def recall_shape(facts: int, asks: int = 1) -> str:
    """A recall-rows file's facts wildcard: "8" for 8 facts asked at the row's end (the files made
    before ``lora.recall_asks`` keep their names), "8Q2" for 8 facts asked in 2 places."""
    return str(int(facts)) if int(asks) == 1 else f"{int(facts)}Q{int(asks)}"


def parse_recall_shape(shape: str) -> tuple[int, int]:
    """(facts, asks) of a ``recall_shape`` name."""
    facts, _, asks = str(shape).partition("Q")
    return int(facts), int(asks or 1)
