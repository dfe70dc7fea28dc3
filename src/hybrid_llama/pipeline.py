"""The workflow's vocabulary: stages, result slots, artifact paths and config resolution.

Everything the Snakemake rules, the workflow scripts and the report need to agree on lives here,
importable without torch (the Snakefile imports it at parse time):

- ``STAGES`` and ``SHARED_STAGES``: the models a run evaluates. Shared stages (the base model and
  the base + LoRA control) do not depend on a variant; their results live under a *slot* of the
  same name (``results/{model}/base/...``), variant stages under the variant's name.
- ``PATHS``: one table of path templates. Rules take their inputs and outputs from it and the
  report finds files with ``parse_result_path``, so renaming an artifact is a one-line change.
- ``Pipeline``: a validated config (``config/schema.yaml`` fills the defaults) with the per-rule
  views of it (each rule's params hold only the keys it uses, so Snakemake reruns exactly what a
  change affects), the semantic checks JSON Schema cannot express, and the target lists.
- ``schema_defaults``: the defaults of a schema section; the training code takes its defaults from
  here, so the workflow, the library and the CLIs train the same recipe.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybrid_llama.config import (  # noqa: F401
    SCHEMA_PATH,
    ConfigError,
    canonical,
    deep_merge,
    hybrid_defaults,
    load_schema,
    schema_defaults,
    settings_key,
)
from hybrid_llama.names import MMLU_FORMATS, SHARED_STAGES, STAGE_LABELS, STAGES, VARIANT_STAGES  # noqa: F401

# Hybrid keys a derived variant may change: they leave the trained weights valid.
EVAL_ONLY_HYBRID = ("sparse_cache", "sinks", "cache_score", "backend")

# The files a stage's model is built from, besides the base weights.
STAGE_ARTIFACTS = {
    "base": (),
    "converted": (),
    "transfer": ("hybrid_layers",),
    "transfer_lora": ("hybrid_layers", "adapter"),
    "base_lora": ("adapter",),
}
QUALITY_KINDS = ("perplexity", "passkey", "components")

# Every artifact of the workflow. {variant} is the result slot: a variant's name, or a shared
# stage's name (base, base_lora) for results that do not depend on a variant.
PATHS: dict[str, str] = {
    "weights": "resources/weights/{model}/config.json",
    "weight_hashes": "resources/weights/{model}/hashes.json",
    # One packed corpus per (seq_len, num_tokens) that a variant trains on; num_tokens "all" = no cap.
    "transfer_corpus": "resources/data/transfer/{model}/L{seq_len}_N{num_tokens}.safetensors",
    "transfer_manifest": "resources/data/transfer/{model}/L{seq_len}_N{num_tokens}.json",
    "instruct_data": "resources/data/instruct/{model}.safetensors",
    "instruct_manifest": "resources/data/instruct/{model}.json",
    "mmlu_manifest": "resources/data/mmlu/manifest.json",
    "hybrid_layers": "results/{model}/{variant}/transfer/hybrid_layers.safetensors",
    "transfer_metrics": "results/{model}/{variant}/transfer/metrics.json",
    "transfer_loss": "results/{model}/{variant}/transfer/loss.csv",
    "teacher_states": "results/{model}/{variant}/transfer/teacher_states.safetensors",
    "adapter": "results/{model}/{variant}/lora/adapter_model.safetensors",
    "adapter_config": "results/{model}/{variant}/lora/adapter_config.json",
    "lora_metrics": "results/{model}/{variant}/lora/metrics.json",
    "lora_loss": "results/{model}/{variant}/lora/loss.csv",
    "mmlu": "results/{model}/{variant}/mmlu/{device}/{stage}/{fmt}_{shots}shot.json",
    "stage_quality": "results/{model}/{variant}/quality/{device}/{stage}/{kind}.csv",
    "quality": "results/{model}/{variant}/quality/{device}/{kind}.csv",
    "generations": "results/{model}/{variant}/generations/{stage}.json",
    "throughput": "results/{model}/throughput/{device}.csv",
    # One folder per model (and variant): names joined by '_' could not be split back apart.
    "plot_mmlu": "results/plots/{model}/mmlu_{fmt}.png",
    "plot_throughput": "results/plots/{model}/throughput_{device}.png",
    "plot_memory": "results/plots/{model}/memory_{device}.png",
    # Quality plots put every variant on one axis: one figure per (model, device).
    "plot_nll": "results/plots/{model}/nll_{device}.png",
    "plot_passkey": "results/plots/{model}/passkey_{device}.png",
    "plot_components": "results/plots/{model}/components_{device}.png",
    "plot_transfer_loss": "results/plots/{model}/{variant}/transfer_loss.png",
    "plot_lora_loss": "results/plots/{model}/{variant}/lora_loss.png",
    "report": "results/report.html",
    "log": "logs/{job}.log",
    "benchmark": "logs/benchmarks/{job}.tsv",
    "checkpoints": "resources/checkpoints/{kind}/{model}/{variant}/{key}",
}

# What each wildcard may look like (names come from the config, checked against this pattern by the
# schema). Results are matched most specific first, so e.g. a plot is never read as a stage file.
WILDCARD_PATTERNS = {
    "model": r"[A-Za-z0-9][A-Za-z0-9_-]*",
    "variant": r"[A-Za-z0-9][A-Za-z0-9_-]*",
    "stage": "|".join(STAGES),
    "device": r"cpu|cuda(?::\d+)?(?:-[A-Za-z0-9_]+)?",
    "fmt": "|".join(MMLU_FORMATS),
    "shots": r"\d+",
    "kind": r"[a-z_]+",
    "seq_len": r"\d+",
    "num_tokens": r"\d+|all",
    "job": r"[A-Za-z0-9_./:-]+",  # a log's rule/wildcards path
    "key": r"[0-9a-f]+",
}


def path(name: str, **wildcards: Any) -> str:
    """The path of artifact ``name`` with its wildcards filled in (any left out stay as ``{x}``)."""
    template = PATHS[name]
    return re.sub(r"\{(\w+)\}", lambda m: str(wildcards.get(m.group(1), m.group(0))), template)


@functools.cache
def _path_regex(name: str) -> re.Pattern:
    parts = re.split(r"(\{\w+\})", PATHS[name])
    regex = "".join(
        f"(?P<{p[1:-1]}>{WILDCARD_PATTERNS.get(p[1:-1], '[^/]+')})" if p.startswith("{") else re.escape(p)
        for p in parts
    )
    return re.compile(regex + "$")


def parse_result_path(file: str | os.PathLike, names: Iterable[str] | None = None) -> tuple[str, dict[str, str]]:
    """(artifact name, wildcards) of a workflow file, matched against ``PATHS`` (relative or absolute
    paths; the template must match the path's end). Raises ValueError for a file no template matches."""
    text = Path(file).as_posix()
    for name in names or PATHS:
        m = _path_regex(name).search(text)
        if m and (m.start() == 0 or text[m.start() - 1] == "/"):
            return name, m.groupdict()
    raise ValueError(f"{file}: not a workflow artifact (no template in hybrid_llama.pipeline.PATHS matches)")


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def torch_device(device: str) -> str:
    """The torch device of a config/wildcard device: the part before a cluster label ('cuda:1-a100')."""
    return str(device).split("-", 1)[0]


def shared_data_dir(setting: str = "auto", repo: str | os.PathLike | None = None) -> Path:
    """The offline data mirror: ``setting`` unless 'auto', else $HYBRID_LLAMA_SHARED_DATA, else
    ``shared/data`` beside the repository (``repo``, default this checkout)."""
    if setting != "auto":
        return Path(setting)
    env = os.environ.get("HYBRID_LLAMA_SHARED_DATA")
    if env:
        return Path(env)
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parents[2]
    return repo.resolve().parent / "shared" / "data"


# ----------------------------------------------------------------------------------------- pipeline


class Pipeline:
    """A config validated against the schema (defaults filled), with its views, checks and targets."""

    def __init__(self, config: dict, repo: str | os.PathLike) -> None:
        self.config = config
        self.repo = Path(repo)
        self.models = self._by_name("models")
        self.own = self._by_name("variants")  # each variant's entry as written
        self.variants = {v: self._resolved(v, ()) for v in self.own}
        self.devices = list(config["devices"])
        self.stages = [s for s in STAGES if s in config["stages"]]

    def _by_name(self, section: str) -> dict[str, dict]:
        """{name: entry without 'name'} of a named list (models, variants); duplicate names fail."""
        out: dict[str, dict] = {}
        for i, entry in enumerate(self.config[section]):
            name = entry["name"]
            if name in out:
                raise ConfigError(f"{section}[{i}].name", f"duplicate name '{name}'")
            out[name] = {k: v for k, v in entry.items() if k != "name"}
        return out

    # ---- derived variants: 'from: parent' reuses the parent's trained artifacts

    def _resolved(self, v: str, chain: tuple[str, ...]) -> dict:
        """A variant's settings with its parent's filled in ('from'), checked: it may change only the
        hybrid keys that leave the trained weights valid (EVAL_ONLY_HYBRID)."""
        own = self.own[v]
        parent = own.get("from")
        if parent is None:
            return own
        key = f"variants[{v}].from"
        if parent not in self.own:
            raise ConfigError(key, f"no variant named '{parent}' to derive from (variants: {sorted(self.own)})")
        if parent in chain + (v,):
            raise ConfigError(key, f"derivation cycle {' -> '.join(chain + (v, parent))}")
        base = self._resolved(parent, chain + (v,))
        for k, value in (own.get("hybrid") or {}).items():
            if k not in EVAL_ONLY_HYBRID and value != base["hybrid"].get(k):
                raise ConfigError(
                    f"variants[{v}].hybrid.{k}",
                    f"a variant derived from '{parent}' reuses its trained layers, so it may change only "
                    f"{', '.join(EVAL_ONLY_HYBRID)}",
                )
        merged = deep_merge({k: x for k, x in base.items() if k not in ("description",)}, own)
        merged["hybrid"] = {**base["hybrid"], **(own.get("hybrid") or {})}
        return merged

    def parent(self, variant: str) -> str | None:
        return self.own[variant].get("from")

    def transfer_owner(self, variant: str) -> str:
        """The variant whose transfer artifacts this variant's models use: its own, unless it derives
        from a parent and sets no 'transfer' of its own."""
        parent = self.parent(variant)
        if parent is None or "transfer" in self.own[variant]:
            return variant
        return self.transfer_owner(parent)

    def lora_owner(self, variant: str) -> str:
        """The variant whose LoRA adapter this variant's transfer_lora stage uses: its own when it
        trains its own transfer or sets a 'lora' of its own, else its parent's."""
        parent = self.parent(variant)
        if parent is None or "lora" in self.own[variant] or self.transfer_owner(variant) == variant:
            return variant
        return self.lora_owner(parent)

    # ---- data

    def shared_data(self) -> Path:
        return shared_data_dir(self.config.get("shared_data", "auto"), self.repo)

    def local_data_path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.shared_data() / p

    def data_kind(self, name: str) -> str:
        """'local' or 'hf' for data set ``name`` (transfer | instruct | mmlu), resolving 'auto'."""
        cfg = self.config["data"][name]
        if cfg["source"] != "auto":
            return cfg["source"]
        return "local" if self.local_data_path(cfg["local"]).exists() else "hf"

    def data_source(self, name: str) -> dict:
        """The ``hybrid_llama.data`` source spec of data set ``name`` (transfer | instruct)."""
        cfg = self.config["data"][name]
        if self.data_kind(name) == "local":
            spec = {"kind": "local", "path": str(self.local_data_path(cfg["local"]))}
        else:
            spec = {"kind": "hf", **cfg["hf"]}
        if name == "transfer":
            spec["text_column"] = cfg["text_column"]
        return canonical(spec)

    def data_settings(self, name: str) -> dict:
        """The prepare_* keyword arguments of data set ``name`` (everything but where it comes from;
        for the transfer corpus also without seq_len/num_tokens, which each variant sets)."""
        skip = {"source", "local", "hf", "text_column"}
        out = {k: v for k, v in self.config["data"][name].items() if k not in skip}
        if name == "transfer":
            out["split"] = "train" if out["heldout_fraction"] > 0 else "all"
        return canonical(out)

    def local_data_inputs(self, name: str) -> list[str]:
        """The local file of a data set, as an input (so a changed file reruns its rule)."""
        if self.data_kind(name) != "local":
            return []
        p = self.local_data_path(self.config["data"][name]["local"])
        return [str(p)] if p.is_file() else []

    def mmlu_data(self) -> dict:
        if self.data_kind("mmlu") == "local":
            return {"kind": "local", "path": str(self.local_data_path(self.config["data"]["mmlu"]["local"]))}
        # Downloaded once by the local rule mmlu_download into the same layout as the mirror.
        return {"kind": "local", "path": str(Path(PATHS["mmlu_manifest"]).parent)}

    def mmlu_settings(self) -> dict:
        """MMLU params shared by every MMLU job; shots and format are wildcards, not params."""
        keep = ("limit", "subjects", "batch_size", "dtype")
        return canonical({"data": self.mmlu_data(), **{k: self.config["mmlu"][k] for k in keep}})

    # ---- per-variant settings

    def hybrid(self, variant: str) -> dict:
        h = dict(self.variants[variant]["hybrid"])
        if not (h.get("sparse_cache") or h.get("sinks")):
            # The cache off: the settings (and every param and file that holds them) stay as they
            # were before the sparse cache existed, so no job reruns for it.
            for key in ("sparse_cache", "sinks", "cache_score"):
                h.pop(key, None)
        return canonical(h)

    def transfer(self, variant: str) -> dict:
        """The variant's transfer section: top-level defaults with its overrides."""
        return canonical(deep_merge(self.config["transfer"], self.variants[variant].get("transfer")))

    def transfer_train(self, variant: str) -> dict:
        """What ``run_transfer`` gets: the transfer section without the corpus keys (the corpus is
        its input file)."""
        return {k: v for k, v in self.transfer(variant).items() if k not in ("seq_len", "num_tokens")}

    def corpus(self, variant: str) -> dict[str, str]:
        """The wildcards of the variant's transfer corpus: ``{seq_len, num_tokens}``."""
        t = self.transfer(variant)
        return {"seq_len": str(t["seq_len"]), "num_tokens": "all" if t["num_tokens"] is None else str(t["num_tokens"])}

    def corpus_settings(self, seq_len: str, num_tokens: str) -> dict:
        """``prepare_transfer_corpus`` settings of the corpus with these wildcards."""
        return {**self.data_settings("transfer"), "seq_len": int(seq_len),
                "num_tokens": None if num_tokens == "all" else int(num_tokens)}

    def lora(self, variant: str) -> dict:
        """LoRA settings of a variant; 'base_lora' gives the control's settings."""
        if variant == "base_lora":
            return canonical(deep_merge(self.config["lora"], self.config["base_lora"]))
        return canonical(deep_merge(self.config["lora"], self.variants[variant].get("lora")))

    def variant_stages(self, variant: str) -> list[str]:
        """The stages evaluated for a variant: its own 'stages', else the top-level variant stages."""
        own = self.variants[variant].get("stages")
        wanted = own if own is not None else [s for s in self.stages if s in VARIANT_STAGES]
        return [s for s in VARIANT_STAGES if s in wanted]

    def trained(self, variant: str, stage: str) -> bool:
        """Whether the variant's models at ``stage`` are needed (evaluated, or built upon)."""
        return stage in self.variant_stages(variant) or (
            stage == "transfer" and "transfer_lora" in self.variant_stages(variant))

    def component_stages(self, variant: str) -> list[str]:
        """The component diagnostic's stages: the evaluated ones plus 'transfer' whenever it trains.
        The window/linear share right after transfer is what attention transfer learned, and costs
        one short forward where the other evaluations of that stage may be cut for time."""
        own_transfer = self.transfer_owner(variant) == variant  # a derived variant's transfer is its parent's
        return [s for s in VARIANT_STAGES
                if s in self.variant_stages(variant) or (own_transfer and self.trained(variant, s))]

    def section(self, *keys: str) -> Any:
        """A canonical copy of config[keys[0]][keys[1]]..., for a rule's params."""
        node = self.config
        for key in keys:
            node = node[key]
        return canonical(node)

    def _key(self, variant: str, section: str, key: str) -> str:
        """The config key a variant's setting comes from (its override, else the top-level one)."""
        own = self.variants[variant].get(section) or {}
        return f"variants[{variant}].{section}.{key}" if key in own else f"{section}.{key}"

    # ---- checks the schema cannot express (run at parse time, before any job)

    def model_architecture(self, model: str) -> dict:
        """num_hidden_layers / max_position_embeddings of a model, from its resolved config.json, a
        local directory, a random preset or the known sources; {} when unknown before download."""
        from hybrid_llama.weights import known_architecture

        spec = self.models[model]
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

    def check(self) -> None:
        """Raise ConfigError (naming the key) for what the schema cannot catch."""
        for model in self.models:
            n_layers = self.model_architecture(model).get("num_hidden_layers")
            for v in self.variants:
                self._check_layers(f"variants[{v}].hybrid.layers", self.hybrid(v)["layers"], model, n_layers)
                self._check_layers(f"variants[{v}].lora.layers", self.lora(v).get("layers"), model, n_layers)
            self._check_layers("base_lora.layers", self.lora("base_lora").get("layers"), model, n_layers)

        for name in ("transfer", "instruct", "mmlu"):
            cfg = self.config["data"][name]
            if cfg["source"] == "local" and not self.local_data_path(cfg["local"]).exists():
                raise ConfigError(
                    f"data.{name}.local",
                    f"{self.local_data_path(cfg['local'])} does not exist (shared_data = {self.shared_data()})",
                )

        subjects = self.config["mmlu"]["subjects"]
        if self.data_kind("mmlu") == "local" and subjects:
            test_dir = self.local_data_path(self.config["data"]["mmlu"]["local"]) / "test"
            missing = [s for s in subjects if not (test_dir / f"{s}_test.csv").is_file()]
            if missing:
                raise ConfigError("mmlu.subjects", f"unknown subjects {missing} (no file in {test_dir})")

        for v in self.variants:
            self._check_training(v)
            self._check_sparse_cache(v)

    def _check_sparse_cache(self, v: str) -> None:
        h = self.hybrid(v)
        if (h.get("sparse_cache") or h.get("sinks")) and h["formulation"] != "lolcats":
            key = "sparse_cache" if h.get("sparse_cache") else "sinks"
            raise ConfigError(
                f"variants[{v}].hybrid.{key}",
                f"the sparse cache joins the shared normalizer of formulation 'lolcats'; variant '{v}' uses "
                f"'{h['formulation']}'",
            )

    def _check_training(self, v: str) -> None:
        hybrid, t, lora = self.hybrid(v), self.transfer(v), self.lora(v)
        if self.trained(v, "transfer") and self.transfer_owner(v) == v:
            parts = set(t["trainable"].split("+"))
            if hybrid["feature_map"] == "elu1" and parts == {"feature_map"}:
                raise ConfigError(
                    self._key(v, "transfer", "trainable"),
                    f"'{t['trainable']}' selects nothing: variant '{v}' uses elu1, which has no parameters",
                )
            if hybrid["formulation"] == "window" and "qkvo" not in parts:
                raise ConfigError(
                    self._key(v, "transfer", "trainable"),
                    f"'{t['trainable']}' trains nothing a window-only layer ('formulation: window') uses",
                )
            for model in self.models:
                positions = self.model_architecture(model).get("max_position_embeddings")
                if positions is not None and t["seq_len"] > positions:
                    raise ConfigError(
                        self._key(v, "transfer", "seq_len"),
                        f"{t['seq_len']} tokens is longer than model '{model}' has positions ({positions})",
                    )
            if t["num_tokens"] is not None:
                rows = t["num_tokens"] // t["seq_len"]
                need = {"transfer": t["eval_sequences"] + t["batch_size"]}
                if self.trained(v, "transfer_lora") and lora["objective"] == "distill":
                    need["LoRA (objective distill)"] = lora["eval_sequences"] + lora["batch_size"]
                for what, n in need.items():
                    if rows < n:
                        raise ConfigError(
                            self._key(v, "transfer", "num_tokens"),
                            f"{t['num_tokens']} tokens make {rows} rows of seq_len {t['seq_len']}; {what} of variant "
                            f"'{v}' needs at least {n} (eval_sequences + one batch)",
                        )
        if self.trained(v, "transfer_lora") and lora["objective"] == "distill" and hybrid["formulation"] == "window":
            raise ConfigError(
                self._key(v, "lora", "objective"), "a window-only variant has no hybrid layers to distill"
            )
        if "base_lora" in self.stages and self.lora("base_lora")["objective"] != "instruct":
            raise ConfigError(
                "base_lora.objective", "the base + LoRA control finetunes on instruction data ('instruct')"
            )

    @staticmethod
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

    # ---- stages, slots and the files a stage's model is built from

    def eval_slots(self) -> list[tuple[str, str]]:
        """(slot, stage) pairs to evaluate: shared stages once, variant stages per variant."""
        pairs = [(s, s) for s in self.stages if s in SHARED_STAGES]
        return pairs + [(v, s) for v in self.variants for s in self.variant_stages(v)]

    def stage_inputs(self, model: str, slot: str, stage: str) -> dict[str, str]:
        """The files a stage's model is built from: weights (+ transfer layers) (+ LoRA adapter)."""
        if (slot in SHARED_STAGES) != (stage in SHARED_STAGES) or (slot in SHARED_STAGES and slot != stage):
            raise ValueError(f"stage '{stage}' is not evaluated under '{slot}'")
        files = {"weights": path("weights", model=model)}
        owners = {"hybrid_layers": ("layers", self.transfer_owner), "adapter": ("adapter", self.lora_owner)}
        for artifact in STAGE_ARTIFACTS[stage]:
            name, owner = owners[artifact]
            files[name] = path(artifact, model=model, variant=slot if slot in SHARED_STAGES else owner(slot))
        return files

    def stage_hybrid(self, slot: str, stage: str) -> dict | None:
        """The hybrid settings of a stage's model (None for the plain model)."""
        return self.hybrid(slot) if stage in VARIANT_STAGES else None

    def lora_slots(self) -> list[str]:
        """The LoRA jobs: one per variant that owns an adapter some evaluated stage needs."""
        slots = list(dict.fromkeys(self.lora_owner(v) for v in self.variants if self.trained(v, "transfer_lora")))
        return slots + (["base_lora"] if "base_lora" in self.stages else [])

    def transfer_slots(self) -> list[str]:
        """The transfer jobs: one per variant that owns layers some evaluated stage needs."""
        return list(dict.fromkeys(self.transfer_owner(v) for v in self.variants if self.trained(v, "transfer")))

    def throughput_variants(self) -> list[str]:
        """The variants whose speed is measured: the trained ones and those derived from them (an
        untrained control only shows quality), or every variant when none trains."""
        return [v for v in self.variants if self.trained(v, "transfer")] or list(self.variants)

    def corpus_files(
        self, model: str, variants: Iterable[str] | None = None, name: str = "transfer_corpus"
    ) -> list[str]:
        """The transfer corpora of the trained variants (one per distinct seq_len/num_tokens); when no
        variant trains, the top-level transfer section's corpus (perplexity reads its held-out split)."""
        variants = self.transfer_slots() if variants is None else [self.transfer_owner(v) for v in variants]
        corpora = [self.corpus(v) for v in variants] or [self._default_corpus()]
        unique = list(dict.fromkeys(tuple(sorted(c.items())) for c in corpora))
        return [path(name, model=model, **dict(c)) for c in unique]

    def _default_corpus(self) -> dict[str, str]:
        t = self.config["transfer"]
        return {"seq_len": str(t["seq_len"]), "num_tokens": "all" if t["num_tokens"] is None else str(t["num_tokens"])}

    def lora_data(self, model: str, variant: str) -> str:
        """The LoRA stage's data: instruction data, or the variant's transfer corpus (objective distill)."""
        if variant != "base_lora" and self.lora(variant)["objective"] == "distill":
            return path("transfer_corpus", model=model, **self.corpus(variant))
        return path("instruct_data", model=model)

    def lora_inputs(self, model: str, variant: str) -> dict[str, str]:
        """The transfer artifacts a variant's LoRA stage starts from (its transfer owner's)."""
        owner = self.transfer_owner(variant)
        return {a: path(f, model=model, variant=owner) for a, f in (("layers", "hybrid_layers"),
                                                                    ("teacher_states", "teacher_states"))}

    # ---- targets

    def mmlu_files(self, model: str, fmt: str | None = None) -> list[str]:
        fmts = [fmt] if fmt else self.config["mmlu"]["formats"]
        return [
            path("mmlu", model=model, variant=slot, device=d, stage=stage, fmt=f, shots=shots)
            for d in self.devices
            for slot, stage in self.eval_slots()
            for f in fmts
            for shots in self.config["mmlu"]["shots"]
        ]

    def stage_quality_files(self, model: str, variant: str, device: str, kind: str) -> list[str]:
        """Per-stage quality CSVs that make up one variant's table: every evaluated stage, shared ones
        included, except for the component diagnostic (hybrid stages only, see component_stages)."""
        if kind == "components":
            shared, own = [], self.component_stages(variant)
        else:
            shared, own = [s for s in self.stages if s in SHARED_STAGES], self.variant_stages(variant)
        return [
            path(
                "stage_quality",
                model=model,
                variant=s if s in SHARED_STAGES else variant,
                device=device,
                stage=s,
                kind=kind,
            )
            for s in [*shared[:1], *own, *shared[1:]]
        ]

    def report_inputs(self) -> dict[str, list[str]]:
        m_, v_, d_ = list(self.models), list(self.variants), self.devices
        plots = [path("plot_mmlu", model=m, fmt=f) for m in m_ for f in self.config["mmlu"]["formats"]]
        plots += [path(k, model=m, device=d) for m in m_ for d in d_
                  for k in ("plot_throughput", "plot_memory", "plot_nll", "plot_passkey", "plot_components")]
        plots += [path("plot_transfer_loss", model=m, variant=v) for m in m_ for v in self.transfer_slots()]
        plots += [path("plot_lora_loss", model=m, variant=s) for m in m_ for s in self.lora_slots()]
        return {
            "mmlu": [f for m in m_ for f in self.mmlu_files(m)],
            "quality": [
                path("quality", model=m, variant=v, device=d, kind=k)
                for m in m_
                for v in v_
                for d in d_
                for k in QUALITY_KINDS
            ],
            "throughput": [path("throughput", model=m, device=d) for m in m_ for d in d_],
            "generations": [
                path("generations", model=m, variant=slot, stage=stage) for m in m_ for slot, stage in self.eval_slots()
            ],
            "plots": plots,
            "transfer_metrics": [
                path("transfer_metrics", model=m, variant=v) for m in m_ for v in self.transfer_slots()
            ],
            "lora_metrics": [path("lora_metrics", model=m, variant=s) for m in m_ for s in self.lora_slots()],
            "manifests": [f for m in m_ for f in self.corpus_files(m, name="transfer_manifest")]
            + [path("instruct_manifest", model=m) for m in m_ if self._uses_instruct()],
        }

    def _uses_instruct(self) -> bool:
        return any(s == "base_lora" or self.lora(s)["objective"] == "instruct" for s in self.lora_slots())

    def wildcard_constraints(self) -> dict[str, str]:
        alternatives = lambda names: "|".join(re.escape(n) for n in names)  # noqa: E731
        return {
            "model": alternatives(self.models),
            "variant": alternatives([*self.variants, *SHARED_STAGES]),
            "stage": alternatives(STAGES),
            "device": WILDCARD_PATTERNS["device"],
            "fmt": alternatives(MMLU_FORMATS),
            "shots": WILDCARD_PATTERNS["shots"],
            "seq_len": WILDCARD_PATTERNS["seq_len"],
            "num_tokens": WILDCARD_PATTERNS["num_tokens"],
        }
