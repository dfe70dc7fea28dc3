"""Evaluation: ``mmlu`` (lm-eval, MC and cloze), ``throughput`` (prefill/decode speed and memory),
``perplexity`` (NLL vs context on ``heldout`` text), ``passkey`` (retrieval vs context and depth),
``components`` (the window's share of each hybrid layer), and ``tables`` (their CSVs and the paired
statistics the report reads off them). Import the submodules directly; nothing heavy (lm-eval,
pandas) is imported here."""
