"""Training stages: attention transfer (``transfer.run_transfer``) and LoRA (``finetune.run_finetune``).

Both run the one loop of ``trainer.fit``; a stage differs by its objective (``transfer.AttentionTransfer``,
``lora_objectives.InstructObjective`` / ``DistillObjective``) and its typed settings (``settings``).
The loop's parts: ``optim`` (AdamW, lr schedule, clipping), ``checkpoint`` (save/resume),
``reporting`` (loss CSV, progress bar), ``compute`` (device, autocast, seeds), ``errors``.
"""
