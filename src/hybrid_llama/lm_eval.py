"""lm-eval's own command line, in a process where the ``hybrid_llama`` model type is registered.

    python -m hybrid_llama.lm_eval --model hf --model_args pretrained=results/<model>/<variant>/model \\
        --tasks <task> [any other lm-eval argument]

Every argument goes to lm-eval's CLI (``lm_eval.__main__.cli_evaluate``) unchanged. The only
difference from ``lm-eval ...`` is that this package is imported first, so lm-eval's
``AutoModelForCausalLM.from_pretrained`` builds ``HybridLlamaForCausalLM`` from an exported hybrid
(flash-linear-attention's evals/harness.py does the same for its models). lm-eval logs that the model
type is not one of transformers' causal LMs and uses the causal backend, which is right; pass
``backend=causal`` in ``--model_args`` to skip that warning.
"""

from __future__ import annotations

import sys

import hybrid_llama  # noqa: F401  (the import registers the model type; kept explicit on purpose)


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's CLI on ``argv`` (default: this process's arguments)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
