"""Evaluation: ``mmlu`` (lm-eval, MC and cloze), ``throughput`` (prefill/decode speed and memory),
``quality`` (perplexity, passkey, significance). Import the submodules directly; nothing heavy
(lm-eval, pandas) is imported here."""
