"""The exported model's card, filled from this run's result files.

``hybrid_llama.models.card.model_card`` renders the card; this module supplies what the workflow
measured: how the model was trained (the transfer and LoRA metrics JSONs) and how it did (held-out
NLL vs context against base, passkey retrieval, decode-cache size vs base), read with the report's
own readers (``Results``, ``nll_delta``, ``passkey_at``), so card and report print the same numbers.
A number that is not in a result file is written "not measured".
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from hybrid_llama.eval.tables import BEYOND_WINDOW
from hybrid_llama.models.card import NOT_MEASURED, model_card
from hybrid_llama.names import STAGE_LABELS
from hybrid_llama.report.formatting import byte_size, plus_minus
from hybrid_llama.report.results import Results, nll_delta, num, passkey_at, speed_table
from hybrid_llama.weights import base_model_facts

PathLike = str | os.PathLike


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _read(file: PathLike | None) -> dict | None:
    return json.loads(Path(file).read_text()) if file and Path(file).is_file() else None


def _source(spec: dict | None) -> str:
    """A data source spec as a reader recognizes it: the local file's name or the Hub dataset."""
    if not spec:
        return "not recorded"
    if spec.get("kind") == "local":
        return f"local file `{Path(spec['path']).name}`"
    return f"Hugging Face `{spec.get('path')}`" + (f" ({spec['name']})" if spec.get("name") else "")


def training_section(transfer: dict | None, lora: dict | None, data: dict[str, dict | None]) -> str | None:
    """Markdown of the transfer and LoRA runs the model was built from (their metrics JSONs);
    ``data``: the data source specs by name (transfer, instruct)."""
    parts = []
    if transfer:
        mse = (f"{transfer['mse_before_mean']:.4g} → {transfer['mse_after_mean']:.4g}"
               if "mse_after_mean" in transfer else NOT_MEASURED)
        row = [_source(data.get("transfer")), f"{transfer.get('train_tokens', 0):,}",
               f"{transfer.get('train_sequences', '?')} × {transfer.get('seq_len', '?')}", str(transfer.get("steps")),
               ", ".join(transfer.get("trainable") or []) or "?", mse]
        header = ["data", "tokens", "sequences × length", "steps", "trained", "attention MSE (mean over layers)"]
        parts.append("**Attention transfer** (each hybrid layer matches the frozen softmax layer's output):\n\n"
                     + _table(header, [row]))
    if lora:
        objective = lora.get("objective", "instruct")
        distill = objective == "distill"
        what = "KL to the base model's next-token distribution" if distill else "cross-entropy on responses"
        row = [_source(data.get("transfer" if distill else "instruct")), f"{lora.get('train_tokens', 0):,}",
               str(lora.get("num_train", "?")), str(lora.get("steps")),
               f"{num(lora.get('val_loss_before')):.4g} → {num(lora.get('val_loss_after')):.4g}"]
        header = ["data", "tokens", "rows", "steps", f"validation {lora.get('val_metric', 'loss')}"]
        parts.append(f"**LoRA** (`{objective}`: {what}):\n\n" + _table(header, [row]))
    return "\n\n".join(parts) or None


def _nll_rows(res: Results, model: str, variant: str, device: str, stage: str) -> list[list[str]]:
    own = res.quality_rows("perplexity", model, device, stage, variant)
    base = res.quality_rows("perplexity", model, device, "base", None)
    rows = []
    for length in sorted({int(r["context_len"]) for r in own}):
        d = nll_delta(own, base, length)
        mine = next(r["nll"] for r in own if int(r["context_len"]) == length)
        rows.append([str(length), f"{mine:.3f}", f"{d['nll_b']:.3f}" if d else NOT_MEASURED,
                     plus_minus(d["diff"], d["stderr"]) if d else NOT_MEASURED])
    return rows


def _passkey_text(p: dict | None) -> str:
    if p is None:
        return NOT_MEASURED
    return f"{p['accuracy']:.0%} ({p['found']}/{p['trials']}, 95 % CI {p['ci_low']:.0%}–{p['ci_high']:.0%})"


def _passkey_rows(res: Results, model: str, variant: str, device: str, stage: str) -> list[list[str]]:
    own = res.quality_rows("passkey", model, device, stage, variant)
    base = res.quality_rows("passkey", model, device, "base", None)
    return [[str(length), _passkey_text(passkey_at(own, length)), _passkey_text(passkey_at(base, length)),
             _passkey_text(passkey_at(own, length, beyond=BEYOND_WINDOW))]
            for length in sorted({int(r["context_len"]) for r in own})]


def _cache_rows(res: Results, model: str, variant: str, device: str) -> list[list[str]]:
    """Decode-cache bytes after a prefill of each length, this variant's layout vs base."""
    rows = res.throughput.get((model, device)) or []
    table = speed_table(rows)
    base = table.get(("base", "prefill"), {})
    labels = sorted({r["variant"] for r in rows if r["slot"] == variant})
    out = []
    for length in sorted(base):
        mine = [num(table[(label, "prefill")][length]["cache_bytes"]) for label in labels
                if length in table.get((label, "prefill"), {})]
        mine = next((x for x in mine if not math.isnan(x)), math.nan)
        ref = num(base[length]["cache_bytes"])
        if math.isnan(mine) or math.isnan(ref):
            continue
        out.append([str(length), byte_size(mine), byte_size(ref), f"{mine / ref:.2f}×"])
    return out


def results_section(files: list[PathLike], *, model: str, variant: str, stage: str) -> str | None:
    """Markdown of this run's measurements of (model, variant, stage) from its quality tables and
    throughput CSVs, per device; None when there is none."""
    res = Results.load([Path(f) for f in files if Path(f).is_file()])
    devices = sorted({k[2] for k in (*res.perplexity, *res.passkey) if k[:2] == (model, variant)}
                     | {d for m, d in res.throughput if m == model})
    parts = []
    for device in devices:
        nll = _nll_rows(res, model, variant, device, stage)
        passkey = _passkey_rows(res, model, variant, device, stage)
        cache = _cache_rows(res, model, variant, device)
        block = [f"### On `{device}` ({STAGE_LABELS.get(stage, stage)})"]
        block.append("Held-out NLL per token (nats) at each context length; the difference to base "
                     "± its paired standard error over the scored windows:\n\n"
                     + (_table(["context", "this model", "base", "difference"], nll) if nll else NOT_MEASURED))
        block.append(f"Passkey retrieval (teacher-forced trials; the last column counts only needles more than "
                     f"{BEYOND_WINDOW} tokens before the question):\n\n"
                     + (_table(["context", "this model", "base", f"this model, > {BEYOND_WINDOW} tokens back"],
                               passkey) if passkey else NOT_MEASURED))
        block.append("Decode cache after a prefill (hybrid layers keep a fixed-size state):\n\n"
                     + (_table(["tokens", "this model", "base (KV cache)", "ratio"], cache) if cache
                        else NOT_MEASURED))
        parts.append("\n\n".join(block))
    return "\n\n".join(parts) or None


def pipeline_model_card(
    *,
    model: str,
    variant: str,
    stage: str,
    hybrid: dict[str, Any],
    base_spec: dict[str, Any],
    num_layers: int | None,
    transfer_metrics: PathLike | None,
    lora_metrics: PathLike | None,
    data: dict[str, dict | None],
    results: list[PathLike],
    path: str,
) -> str:
    """README.md of the workflow's export of ``variant`` at ``stage`` (see module doc)."""
    base_id, license, base_text = base_model_facts(base_spec)
    return model_card(
        hybrid,
        name=f"{model} / {variant}: hybrid attention, {STAGE_LABELS.get(stage, stage)}",
        base_model=base_text,
        base_model_id=base_id,
        license=license,
        num_layers=num_layers,
        training=training_section(_read(transfer_metrics), _read(lora_metrics), data),
        results=results_section(results, model=model, variant=variant, stage=stage),
        path=path,
    )
