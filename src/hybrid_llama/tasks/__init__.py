"""The zero-shot suite as lm-eval tasks: the YAMLs in this folder and their data functions (``utils``).

Each task reproduces lm-eval's built-in task of the same data (prompts, choices, targets, metrics)
and reads the offline mirror when its files are there, else the Hub (``utils``). lm-eval finds them
through ``task_manager()`` (or ``--include_path`` of this folder, which ``python -m
hybrid_llama.lm_eval`` adds by itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent

# Our task name of each suite task (the keys are the built-in tasks they reproduce).
TASK_NAMES = {
    "piqa": "hybrid_piqa",
    "arc_easy": "hybrid_arc_easy",
    "arc_challenge": "hybrid_arc_challenge",
    "hellaswag": "hybrid_hellaswag",
    "winogrande": "hybrid_winogrande",
    "lambada_openai": "hybrid_lambada_openai",
    "mmlu": "hybrid_mmlu",  # a group of the 57 subjects, 5-shot
}

# Where each task's data sits in the mirror (docs: shared/data/README.md) and on the Hub.
LOCAL_FILES = {
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "arc_easy": ("arc/ARC-Easy-Test.jsonl",),
    "arc_challenge": ("arc/ARC-Challenge-Test.jsonl",),
    "hellaswag": ("hellaswag/hellaswag_val.jsonl",),
    "winogrande": ("winogrande/dev.jsonl", "winogrande/dev-labels.lst"),
    "lambada_openai": ("lambada_openai/lambada_test.jsonl",),
    "mmlu": ("mmlu/test", "mmlu/dev"),
}
HUB = {  # (path, name) of the built-in tasks' datasets
    "piqa": ("baber/piqa", None),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge"),
    "hellaswag": ("Rowan/hellaswag", None),
    "winogrande": ("allenai/winogrande", "winogrande_xl"),
    "lambada_openai": ("EleutherAI/lambada_openai", "default"),
    "mmlu": ("cais/mmlu", None),  # name: the subject
}


def task_manager(source: str = "auto", shared_data: str = "auto", include_defaults: bool = False) -> Any:
    """An lm-eval TaskManager that knows the suite's tasks; ``source`` ('auto' | 'local' | 'hf') and
    ``shared_data`` (the mirror, 'auto' as in the config) reach every task's data loader."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults,
                       metadata={"source": source, "shared_data": str(shared_data)})
