"""hybrid-llama: linearize a pretrained Llama with hybrid (sliding-window softmax + linear) attention."""

__version__ = "0.1.0"
