"""The shared vocabulary of stages and MMLU formats: plain names, importable by every layer.

The workflow (``hybrid_llama.pipeline``), the evaluations and the report all speak of the same
stages; they import the names from here so that no library layer has to import the workflow.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
RECALL_KEYS = ("recall_rows", "recall_facts", "recall_asks", "recall_same_attribute", "recall_subjects",
               "recall_seq_len", "answer_weight", "answer_target")
# The row files each training corpus is made of: a mixed corpus takes half its tokens from each.
CORPUS_PARTS = {"documents": ("documents",), "books": ("books",), "mixed": ("documents", "books")}
# A recall-rows file's facts wildcard (RecallShape.name): facts, Q and the places asked, S for one
# attribute, W for things named by a word.
RECALL_SHAPE_PATTERN = r"\d+(?:Q\d+)?S?W?"


@dataclass(frozen=True)
class RecallShape:
    """What each recall row holds (hybrid_llama.recall_rows): ``facts`` facts, asked for in ``asks``
    places, all stating one attribute (``same_attribute``) or each its own, about people
    (``subjects`` "names") or things named by a common word ("words"). ``name`` is the file's facts
    wildcard: "8" for 8 facts about people, of their own attributes, asked at the end (so the files
    made before the later keys keep their names), "8Q2" asked in 2 places, "8S" or "8Q2S" with one
    attribute shared, a trailing "W" for things."""

    facts: int
    asks: int = 1
    same_attribute: bool = False
    subjects: str = "names"

    @property
    def name(self) -> str:
        return (f"{self.facts}{f'Q{self.asks}' if self.asks != 1 else ''}{'S' if self.same_attribute else ''}"
                f"{'W' if self.subjects == 'words' else ''}")

    @classmethod
    def parse(cls, name: str) -> RecallShape:
        m = re.fullmatch(r"(\d+)(?:Q(\d+))?(S)?(W)?", str(name))
        if m is None:
            raise ValueError(f"{name!r} is not a recall-rows shape (facts, then Q<asks>, then S, then W)")
        return cls(int(m.group(1)), int(m.group(2) or 1), bool(m.group(3)), "words" if m.group(4) else "names")

    @classmethod
    def of(cls, lora: Mapping[str, Any]) -> RecallShape:
        """The shape a ``lora`` section asks for (the later keys may be absent: the fields' defaults)."""
        return cls(int(lora["recall_facts"]), int(lora.get("recall_asks", cls.asks)),
                   bool(lora.get("recall_same_attribute", cls.same_attribute)),
                   str(lora.get("recall_subjects", cls.subjects)))
