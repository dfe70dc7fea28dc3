"""The config checks JSON Schema cannot express, run at parse time so a bad config fails before any job.

Each failure is a ``ConfigError`` naming the key to change: a variant's own override
(``variants[v].transfer.seq_len``) when it has one, else the top-level key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_llama.config import ConfigError
from hybrid_llama.weights import known_architecture

from .long_context import check_long_context
from .paths import corpus_parts, path

if TYPE_CHECKING:  # views imports this module; the checks only read a Pipeline
    from .views import Pipeline

__all__ = ["check_config", "model_architecture"]


def model_architecture(p: Pipeline, model: str) -> dict:
    """num_hidden_layers / max_position_embeddings of a model, from its resolved config.json, a
    local directory, a random preset or the known sources; {} when unknown before download."""
    spec = p.models[model]
    candidates = [Path(path("weights", model=model))]  # resolved already (relative to the workdir)
    if spec["kind"] == "local":
        candidates.insert(0, Path(spec["path"]) / "config.json")
    for file in candidates:
        if file.is_file():
            try:
                return json.loads(file.read_text())
            except ValueError:
                pass
    return known_architecture(spec)


def check_config(p: Pipeline) -> None:
    """Raise ConfigError (naming the key) for what the schema cannot catch."""
    for model in p.models:
        n_layers = model_architecture(p, model).get("num_hidden_layers")
        for v in p.variants:
            _check_layers(f"variants[{v}].hybrid.layers", p.hybrid(v)["layers"], model, n_layers)
            _check_layers(f"variants[{v}].lora.layers", p.lora(v).get("layers"), model, n_layers)
        _check_layers("base_lora.layers", p.lora("base_lora").get("layers"), model, n_layers)

    for name in ("transfer", "instruct", "mmlu"):
        cfg = p.config["data"][name]
        if cfg["source"] == "local" and not p.local_data_path(cfg["local"]).exists():
            raise ConfigError(
                f"data.{name}.local",
                f"{p.local_data_path(cfg['local'])} does not exist (shared_data = {p.shared_data()})",
            )

    subjects = p.config["mmlu"]["subjects"]
    if p.data_kind("mmlu") == "local" and subjects:
        test_dir = p.local_data_path(p.config["data"]["mmlu"]["local"]) / "test"
        missing = [s for s in subjects if not (test_dir / f"{s}_test.csv").is_file()]
        if missing:
            raise ConfigError("mmlu.subjects", f"unknown subjects {missing} (no file in {test_dir})")

    for v in p.variants:
        _check_training(p, v)
        _check_sparse_cache(p, v)
        _check_softmax_heads(p, v)
        _check_evaluated_or_parent(p, v)

    zeroshot = p.config["zeroshot"]
    if zeroshot["source"] == "local":
        from hybrid_llama.tasks import LOCAL_FILES

        absent = [rel for t in zeroshot["tasks"] for rel in LOCAL_FILES[t] if not (p.shared_data() / rel).exists()]
        if absent:
            raise ConfigError("zeroshot.source", f"'local' but {absent} are not in shared_data ({p.shared_data()})")
    for i, v in enumerate(zeroshot["variants"] or []):
        if v not in p.variants:
            raise ConfigError(f"zeroshot.variants[{i}]", f"'{v}' is not a variant of this config ({list(p.variants)})")
    rec = p.config.get("recommended")
    for i, v in enumerate(p.config["throughput"].get("variants") or []):
        if (v == "recommended" and not rec) or (v != "recommended" and v not in p.variants):
            raise ConfigError(f"throughput.variants[{i}]",
                              f"'{v}' is not a variant of this config ({list(p.variants)})")
    check_long_context(p)


def _check_sparse_cache(p: Pipeline, v: str) -> None:
    h = p.hybrid(v)
    if (h.get("sparse_cache") or h.get("sinks")) and h["formulation"] != "lolcats":
        key = "sparse_cache" if h.get("sparse_cache") else "sinks"
        raise ConfigError(
            f"variants[{v}].hybrid.{key}",
            f"the sparse cache joins the shared normalizer of formulation 'lolcats'; variant '{v}' uses "
            f"'{h['formulation']}'",
        )
    if h.get("decay") is not None and h["formulation"] == "window":
        raise ConfigError(f"variants[{v}].hybrid.decay", "a window-only variant has no linear state to decay")


def _check_softmax_heads(p: Pipeline, v: str) -> None:
    h = p.hybrid(v)
    if isinstance(h.get("softmax_heads"), dict):
        _check_ranked_heads(p, v, h)
        return
    for i, (layer, head) in enumerate(h.get("softmax_heads") or []):
        key = f"variants[{v}].hybrid.softmax_heads[{i}]"
        if layer not in h["layers"]:
            raise ConfigError(key, f"layer {layer} is not one of variant '{v}''s hybrid layers {h['layers']}")
        if h["formulation"] == "window":
            raise ConfigError(key, "a window-only variant has no hybrid op to keep heads out of")
        for model in p.models:
            n_kv = model_architecture(p, model).get("num_key_value_heads")
            if n_kv is not None and head >= n_kv:
                raise ConfigError(key, f"KV head {head} does not exist in model '{model}' ({n_kv} KV heads)")


def _check_ranked_heads(p: Pipeline, v: str, h: dict) -> None:
    key = f"variants[{v}].hybrid.softmax_heads.top"
    if h["formulation"] == "window":
        raise ConfigError(key, "a window-only variant has no hybrid op to keep heads out of")
    length = p.config["retrieval_heads"]["context_len"]
    for model in p.models:
        arch = model_architecture(p, model)
        if arch.get("max_position_embeddings") is not None and length > arch["max_position_embeddings"]:
            raise ConfigError("retrieval_heads.context_len", f"{length} tokens is longer than model '{model}' has "
                                                             f"positions ({arch['max_position_embeddings']})")
        n_kv = arch.get("num_key_value_heads")
        if n_kv is not None and h["softmax_heads"]["top"] > n_kv * len(h["layers"]):
            raise ConfigError(key, f"{h['softmax_heads']['top']} heads asked, but model '{model}' has "
                                   f"{n_kv * len(h['layers'])} KV heads in the {len(h['layers'])} hybrid layers")


def _key(p: Pipeline, variant: str, section: str, key: str) -> str:
    """The config key a variant's setting comes from (its override, else the top-level one)."""
    own = p.variants[variant].get(section) or {}
    return f"variants[{variant}].{section}.{key}" if key in own else f"{section}.{key}"


def _check_training(p: Pipeline, v: str) -> None:
    hybrid, t, lora = p.hybrid(v), p.transfer(v), p.lora(v)
    if p.trained(v, "transfer") and p.transfer_owner(v) == v:  # a derived variant's transfer is checked once
        parts = set(t["trainable"].split("+"))
        if hybrid["feature_map"] == "elu1" and parts == {"feature_map"}:
            raise ConfigError(
                _key(p, v, "transfer", "trainable"),
                f"'{t['trainable']}' selects nothing: variant '{v}' uses elu1, which has no parameters",
            )
        if hybrid["formulation"] == "window" and "qkvo" not in parts:
            raise ConfigError(
                _key(p, v, "transfer", "trainable"),
                f"'{t['trainable']}' trains nothing a window-only layer ('formulation: window') uses",
            )
        # Rows no longer than the window hold no key old enough for the linear part: its feature maps
        # and mixing factors get no gradient, which would surface only as an autograd error mid-job.
        if hybrid["formulation"] != "window" and t["seq_len"] <= hybrid["window"]:
            raise ConfigError(
                _key(p, v, "transfer", "seq_len"),
                f"rows of {t['seq_len']} tokens hold no key older than variant '{v}''s {hybrid['window']}-token "
                f"window, so its linear part would not train; use more than {hybrid['window']}",
            )
        for model in p.models:
            positions = model_architecture(p, model).get("max_position_embeddings")
            if positions is not None and t["seq_len"] > positions:
                raise ConfigError(
                    _key(p, v, "transfer", "seq_len"),
                    f"{t['seq_len']} tokens is longer than model '{model}' has positions ({positions})",
                )
        if 0 < t["max_position"] < t["seq_len"]:
            raise ConfigError(_key(p, v, "transfer", "max_position"),
                              f"{t['max_position']} is shorter than a training row (seq_len {t['seq_len']}); use 0 "
                              f"or at least {t['seq_len']}")
        if t["num_tokens"] is not None:
            need = {"transfer": (t["corpus"], t["eval_sequences"] + t["batch_size"])}
            if p.trained(v, "transfer_lora") and p.lora_corpus(v):
                need["LoRA (objective distill)"] = (p.lora_corpus(v), lora["eval_sequences"] + lora["batch_size"])
            for what, (corpus, n) in need.items():
                parts = corpus_parts(corpus, str(t["seq_len"]), str(t["num_tokens"]))
                rows = [int(wc["num_tokens"]) // t["seq_len"] for wc in parts.values()]
                if sum(rows) < n:  # (two halves with 2+ rows in all hold a row each)
                    raise ConfigError(
                        _key(p, v, "transfer", "num_tokens"),
                        f"{t['num_tokens']} tokens make {' + '.join(map(str, rows))} rows of seq_len {t['seq_len']} "
                        f"({corpus}); {what} of variant '{v}' needs at least {n} (eval_sequences + one batch)",
                    )
    for section, stage, settings in (("transfer", "transfer", t), ("lora", "transfer_lora", lora)):
        if p.trained(v, stage) and settings["max_position"]:
            for model in p.models:
                positions = model_architecture(p, model).get("max_position_embeddings")
                if positions is not None and settings["max_position"] > positions:
                    raise ConfigError(_key(p, v, section, "max_position"),
                                      f"{settings['max_position']} is beyond model '{model}''s {positions} positions")
    if p.trained(v, "transfer_lora") and lora["objective"] == "distill" and hybrid["formulation"] == "window":
        raise ConfigError(_key(p, v, "lora", "objective"), "a window-only variant has no hybrid layers to distill")
    if lora.get("corpus") and lora["objective"] != "distill":
        raise ConfigError(_key(p, v, "lora", "corpus"),
                          f"'{lora['corpus']}' chooses distillation rows, but variant '{v}' finetunes with "
                          f"objective '{lora['objective']}'")
    if lora["recall_rows"] and lora["objective"] != "distill":
        raise ConfigError(_key(p, v, "lora", "recall_rows"),
                          f"recall rows train a distilled stage, but variant '{v}' finetunes with objective "
                          f"'{lora['objective']}'")
    if p.trained(v, "transfer_lora") and lora["recall_rows"] and lora["recall_seq_len"]:
        for model in p.models:
            positions = model_architecture(p, model).get("max_position_embeddings")
            if positions is not None and lora["recall_seq_len"] > positions:
                raise ConfigError(_key(p, v, "lora", "recall_seq_len"),
                                  f"{lora['recall_seq_len']} tokens is longer than model '{model}' has positions "
                                  f"({positions})")
    if lora["recall_rows"] and lora["recall_seq_len"] not in (None, t["seq_len"]) and lora["batch_size"] > 1:
        raise ConfigError(_key(p, v, "lora", "recall_seq_len"),
                          f"recall rows of {lora['recall_seq_len']} tokens cannot share a batch of "
                          f"{lora['batch_size']} with rows of {t['seq_len']}: set lora.batch_size 1")
    if "base_lora" in p.stages and p.lora("base_lora").get("corpus"):
        raise ConfigError("base_lora.corpus", "the base + LoRA control finetunes on instruction data")
    if "base_lora" in p.stages and p.lora("base_lora")["recall_rows"]:
        raise ConfigError("base_lora.recall_rows", "the base + LoRA control finetunes on instruction data")
    if "base_lora" in p.stages and p.lora("base_lora")["objective"] != "instruct":
        raise ConfigError("base_lora.objective", "the base + LoRA control finetunes on instruction data ('instruct')")


def _check_layers(key: str, layers: list[int] | None, model: str, n_layers: int | None) -> None:
    if layers is None or n_layers is None:
        return
    bad = [i for i in layers if i >= n_layers]
    if bad:
        raise ConfigError(
            key,
            f"layer index {bad[0]} is beyond model '{model}', which has {n_layers} layers "
            f"(valid: 0..{n_layers - 1})",
        )


def _check_evaluated_or_parent(p: Pipeline, variant: str) -> None:
    """A variant with ``stages: []`` runs only for the variants derived from it; with none, it
    would run nothing at all, which is a config mistake rather than a choice."""
    if p.variant_stages(variant) or p.derived_from(variant):
        return
    raise ConfigError(f"variants[{variant}].stages",
                      "[] evaluates nothing and no variant derives from it ('from'), so nothing would run")
