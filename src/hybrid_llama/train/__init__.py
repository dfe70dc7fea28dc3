"""Training stages: attention transfer (``transfer.run_transfer``), LoRA (``finetune.run_finetune``),
and the shared loop, checkpoint and logging pieces (``common``)."""
