"""lm-eval's own command line, in a process where the ``hybrid_llama`` model type is registered.

    python -m hybrid_llama.lm_eval --model hf --model_args pretrained=results/<model>/<variant>/model \\
        --tasks <task> [any other lm-eval argument]

Every argument goes to lm-eval's CLI (``lm_eval.__main__.cli_evaluate``) unchanged, with two
additions. This package is imported first, so lm-eval's ``AutoModelForCausalLM.from_pretrained``
builds ``HybridLlamaForCausalLM`` from an exported hybrid (flash-linear-attention's
evals/harness.py does the same for its models). And the zero-shot suite's task folder
(``hybrid_llama.tasks``: ``hybrid_piqa``, ``hybrid_arc_easy``, ``hybrid_arc_challenge``,
``hybrid_hellaswag``, ``hybrid_winogrande``, ``hybrid_lambada_openai``, ``hybrid_mmlu``) is added to
``--include_path`` unless one is given, so ``--tasks`` finds them beside lm-eval's own; they read the offline mirror
when it is there (``--metadata '{"source": "hf"}'`` forces the Hub). lm-eval logs that the model
type is not one of transformers' causal LMs and uses the causal backend, which is right; pass
``backend=causal`` in ``--model_args`` to skip that warning.
"""

from __future__ import annotations

import sys

import hybrid_llama  # noqa: F401  (the import registers the model type; kept explicit on purpose)


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on ``argv`` (default: this process's arguments)."""
    from lm_eval.__main__ import cli_evaluate

    from hybrid_llama.tasks import TASKS_DIR

    args = list(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0], *with_include_path(args, str(TASKS_DIR))]
    cli_evaluate()


def with_include_path(args: list[str], folder: str) -> list[str]:
    """``args`` with ``--include_path folder`` appended, unless they give an include path of their own
    (lm-eval takes one folder; put the suite's tasks there yourself then) or ask only for help."""
    if not args or any(a in ("-h", "--help") or a.startswith("--include_path") for a in args):
        return args
    return [*args, "--include_path", folder]


if __name__ == "__main__":
    main()
