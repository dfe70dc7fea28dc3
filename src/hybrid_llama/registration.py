"""Register the ``hybrid_llama`` model type with transformers' Auto classes.

``import hybrid_llama`` calls :func:`register`, so ``AutoConfig`` / ``AutoModelForCausalLM`` load a
saved hybrid (``save_hybrid``, the workflow's export) as ``HybridLlamaForCausalLM`` in any process
that imported the package; lm-eval's ``--model hf`` included (``python -m hybrid_llama.lm_eval``).
Where torch or transformers is not installed there is nothing to register with and it does
nothing. Registering imports both (about 3.5 s on the project's 2-core CPU); a process that needs
only ``hybrid_llama.pipeline`` may skip it with ``HYBRID_LLAMA_REGISTER=0`` set while it imports
the package: the Snakefile does so at parse time (workflow/rules/common.smk), where it would
otherwise cost every ``snakemake`` call, and every job on a cluster, those seconds.
"""

from __future__ import annotations

import importlib.util
import os

SKIP_ENV = "HYBRID_LLAMA_REGISTER"  # "0": skip (see the module doc)


def register() -> bool:
    """Register ``HybridLlamaConfig`` and ``HybridLlamaForCausalLM`` (idempotent); False when torch
    or transformers is unavailable, or ``HYBRID_LLAMA_REGISTER=0``."""
    if os.environ.get(SKIP_ENV) == "0":
        return False
    if any(importlib.util.find_spec(name) is None for name in ("torch", "transformers")):
        return False
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_llama.models.configuration import MODEL_TYPE, HybridLlamaConfig
    from hybrid_llama.models.modeling import HybridLlamaForCausalLM

    AutoConfig.register(MODEL_TYPE, HybridLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(HybridLlamaConfig, HybridLlamaForCausalLM, exist_ok=True)
    return True
