"""Register the ``hybrid_llama`` model type with transformers' Auto classes.

``import hybrid_llama`` calls :func:`register`, so ``AutoConfig`` / ``AutoModelForCausalLM`` load a
saved hybrid (``save_hybrid``, the workflow's export) as ``HybridLlamaForCausalLM`` in any process
that imported the package; lm-eval's ``--model hf`` included (``python -m hybrid_llama.lm_eval``).
Where torch or transformers is not installed (the Snakefile parses with only the pipeline's
dependencies) there is nothing to register with and it does nothing.
"""

from __future__ import annotations

import importlib.util


def register() -> bool:
    """Register ``HybridLlamaConfig`` and ``HybridLlamaForCausalLM`` (idempotent); False when torch
    or transformers is unavailable."""
    if any(importlib.util.find_spec(name) is None for name in ("torch", "transformers")):
        return False
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_llama.models.configuration import MODEL_TYPE, HybridLlamaConfig
    from hybrid_llama.models.modeling import HybridLlamaForCausalLM

    AutoConfig.register(MODEL_TYPE, HybridLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(HybridLlamaConfig, HybridLlamaForCausalLM, exist_ok=True)
    return True
