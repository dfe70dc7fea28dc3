"""One recall-row step of a distillation, its layers' recompute keeping the attention outputs or not.

    python benchmarks/bench_distill_step.py                                    # 2 rounds
    python benchmarks/bench_distill_step.py --repeats 1 --run ../run.X         # another checkout's run

Builds the LoRA model of the recommended variant's distilled parent (``from:`` in
``config/config.yaml``: its hybrid settings, LoRA and recall rows) on the files a finished default
run left (``resources/weights``, the transfer's ``hybrid_layers.safetensors``, the packed corpus and
the recall rows), and times one training step of a recall row (8192 tokens, longer than a KL chunk,
so its decoder layers are recomputed in the backward) in two ways, alternating, in one process:

- ``recompute``: every op of a layer runs again in the backward, as before 963b042;
- ``kept``: the softmax layers' attention outputs are kept from the forward
  (``lora_objectives.KEEP_ATTENTION_OUTPUTS``), as the objective runs now.

Each step starts from the same seed, so the two must give the same loss and gradients; the script
prints the teacher's forward, the student's forward and the backward in seconds, and the gradients'
norm as a check. ``--rows corpus`` times a corpus row (2048 tokens, one chunk: nothing recomputed,
both ways the same).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
import yaml
from snakemake.utils import validate
from torch.utils.checkpoint import noop_context_fn

import hybrid_llama.train.lora_objectives as objectives
from hybrid_llama.config import SCHEMA_PATH
from hybrid_llama.pipeline import Pipeline, path
from hybrid_llama.runtime import keep_freed_memory
from hybrid_llama.stages import as_hybrid_config, load_base
from hybrid_llama.train.compute import autocast
from hybrid_llama.train.finetune import _lora_model
from hybrid_llama.train.settings import LoraSettings

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def recompute_everything():
    """The recompute as it ran before: every op of the layers again, the attention included."""
    kept = objectives.KEEP_ATTENTION_OUTPUTS
    objectives.KEEP_ATTENTION_OUTPUTS = noop_context_fn
    try:
        yield
    finally:
        objectives.KEEP_ATTENTION_OUTPUTS = kept


def timed_step(obj, model, batch: dict, seed: int) -> dict[str, float]:
    torch.manual_seed(seed)  # the LoRA dropout masks
    model.zero_grad(set_to_none=True)
    batch = dict(batch)
    out = {}
    with autocast(obj.device, obj.amp):
        t = time.perf_counter()
        batch["teacher_states"] = obj._teacher_states(batch["input_ids"])
        out["teacher_s"] = time.perf_counter() - t
        t = time.perf_counter()
        total, count = obj.loss_sum(batch)
        out["forward_s"] = time.perf_counter() - t
    t = time.perf_counter()
    (total / count).backward()
    out["backward_s"] = time.perf_counter() - t
    out["loss"] = float(total.detach() / count)
    out["grad_norm"] = float(torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters()
                                            if p.grad is not None)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="recall", help="which rows to time: recall, corpus or both")
    ap.add_argument("--repeats", type=int, default=2, help="rounds; each times both ways")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--variant", default=None, help="a distilled variant (default: the recommended one's parent)")
    ap.add_argument("--run", default=str(REPO), help="the checkout whose default run left the files")
    args = ap.parse_args()
    keep_freed_memory()  # as every job does first
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    cfg = yaml.safe_load((run / "config/config.yaml").read_text())
    validate(cfg, str(SCHEMA_PATH))  # fills in the schema's defaults
    pipeline = Pipeline(cfg, run)
    # by default whose distillation the recommended variant keeps
    variant = args.variant or pipeline.lora_owner(pipeline.recommended())
    hybrid, lora = pipeline.hybrid(variant), pipeline.lora_train(variant)
    settings = LoraSettings.from_dict(lora)
    if settings.objective != "distill":
        raise SystemExit(f"{variant}'s LoRA stage is not distilled (lora.objective {settings.objective})")
    files = {
        "weights": run / Path(path("weights", model=args.model)).parent,
        "layers": run / path("hybrid_layers", model=args.model, variant=pipeline.transfer_owner(variant)),
        "corpus": run / pipeline.training_rows(args.model, variant),
    }
    if recall := pipeline.recall_wildcards(variant):
        files["recall"] = run / path("recall_rows", model=args.model, **recall)
    missing = [str(f) for f in files.values() if not f.exists()]
    if missing:
        raise SystemExit(f"run the default DAG first; missing: {', '.join(missing)}")
    cpu = torch.device("cpu")
    torch.manual_seed(0)  # the LoRA initialisation
    model, _, _ = _lora_model(files["weights"], settings.adapter, as_hybrid_config(hybrid), files["layers"], None, cpu)
    teacher, _ = load_base(files["weights"], dtype=None, device=cpu)
    obj = objectives.DistillObjective(model, files["corpus"], teacher.requires_grad_(False),
                                      eval_sequences=settings.eval_sequences, teacher_states=None, batch_size=1,
                                      device=cpu, amp=bool(settings.autocast), recall_rows=files.get("recall"),
                                      answer_weight=settings.answer_weight, answer_target=settings.answer_target)
    rows = {"corpus": 0, "recall": len(obj.rows["train"])}  # the first row of each kind
    print(f"{variant}: hybrid layers {hybrid['layers']}, {args.threads} threads")
    for name in [r for r in args.rows.split(",") if r in rows and (r != "recall" or "recall" in files)]:
        batch = obj.batch("train", [rows[name]])
        batch.pop("teacher_states", None)
        for r in range(args.repeats):
            for way in ("recompute", "kept"):
                with recompute_everything() if way == "recompute" else contextlib.nullcontext():
                    got = timed_step(obj, model, batch, seed=r)
                print(f"{name} row ({batch['input_ids'].shape[1]} tokens), round {r}, {way:9s}: "
                      + ", ".join(f"{k} {v:.6g}" if k in ("loss", "grad_norm") else f"{k} {v:.1f}"
                                  for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
