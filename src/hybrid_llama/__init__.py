"""hybrid-llama: linearize a pretrained Llama with hybrid (sliding-window softmax + linear) attention.

Importing the package registers the ``hybrid_llama`` model type with transformers' Auto classes
(``hybrid_llama.registration``), so ``AutoModelForCausalLM.from_pretrained`` loads saved hybrids.
"""

from hybrid_llama.registration import register as _register

__version__ = "0.1.0"

_register()
