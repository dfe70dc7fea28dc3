"""``Pipeline``: a validated config seen the way each rule needs it, and the workflow's targets.

Each rule's params hold only the keys it uses (canonical, so key order never looks like a change),
so Snakemake reruns exactly what a config change affects. The config arrives with the schema's
defaults filled in (the Snakefile validates it against ``config/schema.yaml``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybrid_llama.config import ConfigError, canonical, deep_merge, without_unused_hybrid_keys
from hybrid_llama.names import (
    CORPUS_KEYS,
    MMLU_FORMATS,
    RECALL_KEYS,
    SHARED_STAGES,
    STAGES,
    VARIANT_STAGES,
    RecallShape,
)

from . import long_context
from .checks import check_config
from .paths import (
    PATHS,
    QUALITY_KINDS,
    ROW_FILES,
    STAGE_ARTIFACTS,
    WILDCARD_PATTERNS,
    corpus_parts,
    path,
    shared_data_dir,
)
from .variants import lora_owner, resolve_variants, transfer_owner

# Training keys added after runs existed, with the default that reproduces those runs.
LATER_KEYS = {"answer_target": "teacher", "position_draw": "uniform", "recall_asks": 1,
              "recall_same_attribute": False, "recall_subjects": "names"}

__all__ = ["Pipeline"]


def _each_once(items: list) -> list:
    """The items in order without repeats; they may be unhashable (dicts of wildcards)."""
    return [x for i, x in enumerate(items) if x not in items[:i]]


def _without_defaults(stage: dict) -> dict:
    """A training stage's settings without the keys added later, where they hold their default (the
    stage's settings class fills them in): the stage's params, and snakemake's rerun decision, stay
    what they were before each key existed."""
    return {k: v for k, v in stage.items() if LATER_KEYS.get(k, object()) != v}


def _corpus_wildcards(transfer: dict) -> dict[str, str]:
    """The corpus wildcards ``{seq_len, num_tokens}`` of a transfer section (num_tokens None = "all")."""
    num_tokens = transfer["num_tokens"]
    return {"seq_len": str(transfer["seq_len"]), "num_tokens": "all" if num_tokens is None else str(num_tokens)}


class Pipeline:
    """A config validated against the schema (defaults filled), with its views, checks and targets."""

    def __init__(self, config: dict, repo: str | os.PathLike) -> None:
        self.config = config
        self.repo = Path(repo)
        self.models = self._by_name("models")
        self.own = self._by_name("variants")  # each variant's entry as written
        self.variants = resolve_variants(self.own)  # with its parent's settings filled in ('from')
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

    def check(self) -> None:
        """Raise ConfigError (naming the key) for what the schema cannot catch (see ``checks``)."""
        check_config(self)

    # ---- data

    def shared_data(self) -> Path:
        return shared_data_dir(self.config.get("shared_data", "auto"), self.repo)

    def local_data_path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.shared_data() / p

    def data_kind(self, name: str) -> str:
        """'local' or 'hf' for data set ``name`` (transfer | instruct | mmlu | books), resolving 'auto'."""
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

    def zeroshot_settings(self) -> dict:
        """Params of every zero-shot job: the sample, the lm-eval settings and where the data is."""
        cfg = self.config["zeroshot"]
        keep = ("tasks", "limit", "seed", "batch_size", "dtype", "source", "share_prefixes")
        return canonical({**{k: cfg[k] for k in keep}, "shared_data": str(self.shared_data())})

    def zeroshot_slots(self) -> list[tuple[str, str]]:
        """(slot, stage) of the zero-shot jobs: base, and each named variant (every variant when
        zeroshot.variants is null) at its final stage."""
        named = self.config["zeroshot"]["variants"]
        variants = list(self.variants) if named is None else named
        return [("base", "base")] + [(v, self.variant_stages(v)[-1]) for v in variants if self.variant_stages(v)]

    def zeroshot_files(self, model: str) -> list[str]:
        return [path("zeroshot", model=model, variant=slot, device=d, stage=stage)
                for d in self.devices for slot, stage in self.zeroshot_slots()]

    # ---- per-variant settings

    def hybrid(self, variant: str) -> dict:
        return canonical(without_unused_hybrid_keys(self.variants[variant]["hybrid"]))

    def ranks_heads(self, variant: str) -> bool:
        """Whether the variant keeps ranked heads exact (``softmax_heads: {top: N}``): its models are
        then built with the model's retrieval_heads ranking."""
        return isinstance(self.variants[variant]["hybrid"].get("softmax_heads"), dict)

    def heads_ranking(self, model: str, variants: Iterable[str]) -> dict[str, str]:
        """``{"retrieval_heads": file}`` when one of ``variants`` keeps ranked heads, else ``{}``: the
        input its jobs add so that they read the heads, and rerun when the ranking changes."""
        if any(self.ranks_heads(v) for v in variants):
            return {"retrieval_heads": path("retrieval_heads", model=model)}
        return {}

    def transfer_owner(self, variant: str) -> str:
        return transfer_owner(self.own, variant)

    def lora_owner(self, variant: str) -> str:
        return lora_owner(self.own, variant)

    def transfer(self, variant: str) -> dict:
        """The variant's transfer section: top-level defaults with its overrides."""
        return canonical(deep_merge(self.config["transfer"], self.variants[variant].get("transfer")))

    def transfer_train(self, variant: str) -> dict:
        """What ``run_transfer`` gets: the transfer section without the corpus keys (the corpus is
        its input file), and without the later keys at their defaults (``_without_defaults``)."""
        return _without_defaults({k: v for k, v in self.transfer(variant).items() if k not in CORPUS_KEYS})

    def corpus(self, variant: str) -> dict[str, str]:
        """The wildcards of the variant's transfer corpus: ``{seq_len, num_tokens}``."""
        return _corpus_wildcards(self.transfer(variant))

    def training_rows(self, model: str, variant: str, manifest: bool = False, corpus: str | None = None) -> str:
        """The file of the variant's training rows of ``corpus`` (default: its transfer's,
        transfer.corpus): the packed documents of data.transfer, or rows cut from the training books;
        the variant's transfer sets their seq_len and num_tokens."""
        name = ROW_FILES[corpus or self.transfer(variant)["corpus"]]
        return path(f"{name}_manifest" if manifest else name, model=model, **self.corpus(variant))

    def mixed_inputs(self, model: str, seq_len: str, num_tokens: str) -> dict[str, str]:
        """The two row files a mixed corpus interleaves: ``{documents, books}``."""
        return {part: path(ROW_FILES[part], model=model, **wildcards)
                for part, wildcards in corpus_parts("mixed", seq_len, num_tokens).items()}

    def trained_parts(self, variants: Iterable[str] | None = None) -> list[tuple[str, dict[str, str]]]:
        """``(part, wildcards)`` of every documents or books row file the variants' transfers and
        distillations read, once each (default: every variant trained)."""
        transfers = self.transfer_slots() if variants is None else [self.transfer_owner(v) for v in variants]
        loras = self.lora_slots() if variants is None else [self.lora_owner(v) for v in variants]
        corpora = [(self.transfer(v)["corpus"], self.corpus(v)) for v in transfers]
        corpora += [(self.lora_corpus(v), self.corpus(v)) for v in loras if self.lora_corpus(v)]
        parts = [(part, wc) for corpus, c in corpora for part, wc in corpus_parts(corpus, **c).items()]
        return _each_once(parts)

    def book_rows_settings(self, seq_len: str, num_tokens: str) -> dict:
        """``prepare_book_rows`` settings of the book rows with these wildcards (num_tokens "all" = None)."""
        return {"seq_len": int(seq_len), "num_tokens": None if num_tokens == "all" else int(num_tokens)}

    def corpus_settings(self, seq_len: str, num_tokens: str) -> dict:
        """``prepare_transfer_corpus`` settings of the corpus with these wildcards."""
        return {**self.data_settings("transfer"), **self.book_rows_settings(seq_len, num_tokens)}

    def lora_corpus(self, variant: str) -> str | None:
        """The corpus a distilled LoRA stage trains on (lora.corpus, else the transfer's); None for an
        instruction-tuned one."""
        lora = self.lora(variant)
        if variant == "base_lora" or lora["objective"] != "distill":
            return None
        return lora.get("corpus") or self.transfer(variant)["corpus"]

    def lora_train(self, variant: str) -> dict:
        """What ``run_finetune`` gets: the LoRA section without its corpus (which chose the data file),
        and without the recall keys when it trains no recall rows (so that a stage's params, and
        snakemake's rerun decision, stay what they were before those keys existed)."""
        lora = self.lora(variant)
        drop = {"corpus"} | (set() if lora.get("recall_rows") else set(RECALL_KEYS))
        return {k: v for k, v in lora.items() if k not in drop}

    def recall_wildcards(self, variant: str) -> dict[str, str] | None:
        """``{seq_len, rows, facts}`` of the recall rows a distilled LoRA stage trains on (None: none);
        ``facts`` is the rows' ``RecallShape`` name."""
        lora = self.lora(variant)
        if not self.lora_corpus(variant) or not lora["recall_rows"]:
            return None
        seq_len = lora["recall_seq_len"] or self.transfer(variant)["seq_len"]
        return {"seq_len": str(seq_len), "rows": str(lora["recall_rows"]),
                "facts": RecallShape.of(lora).name}

    def lora(self, variant: str) -> dict:
        """LoRA settings of a variant; 'base_lora' gives the control's settings; the later keys at
        their defaults are left out (``_without_defaults``)."""
        own = self.config["base_lora"] if variant == "base_lora" else self.variants[variant].get("lora")
        return _without_defaults(canonical(deep_merge(self.config["lora"], own)))

    def variant_stages(self, variant: str) -> list[str]:
        """The stages evaluated for a variant: its own 'stages', else the top-level variant stages."""
        own = self.variants[variant].get("stages")
        wanted = own if own is not None else [s for s in self.stages if s in VARIANT_STAGES]
        return [s for s in VARIANT_STAGES if s in wanted]

    def derived_from(self, variant: str) -> list[str]:
        """The variants whose 'from' names ``variant``."""
        return [v for v, spec in self.variants.items() if spec.get("from") == variant]

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

    # ---- long context (pipeline.long_context)

    def recommended(self) -> str | None:
        return long_context.recommended(self)

    def quality_settings(self, kind: str, slot: str) -> dict:
        """A quality job's params: its kind's section with the lengths ``slot`` runs."""
        return long_context.slot_settings(self, kind, slot)

    def books_source(self) -> dict:
        return long_context.books_source(self)

    def book_files(self) -> list[str]:
        return long_context.book_files(self)

    def training_book_files(self) -> list[str]:
        return long_context.training_book_files(self)

    def hub_books(self) -> dict[str, str]:
        return long_context.hub_books(self)

    def books_hub_source(self) -> dict:
        return long_context.books_hub_source(self)

    def hub_book_files(self) -> list[str]:
        return long_context.hub_book_files(self)

    def quality_tables(self, model: str, device: str, kind: str) -> list[str]:
        """The ``kind`` tables of the variants that have one (the figures read them)."""
        return [path("quality", model=model, variant=v, device=device, kind=kind) for v in self.variants
                if self.stage_quality_files(model, v, device, kind)]

    def section(self, *keys: str) -> Any:
        """A canonical copy of config[keys[0]][keys[1]]..., for a rule's params."""
        node = self.config
        for key in keys:
            node = node[key]
        return canonical(node)

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
        if stage in VARIANT_STAGES:
            files.update(self.heads_ranking(model, [slot]))
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
        """The variants whose speed is measured: those named by ``throughput.variants`` with the ones
        that share their hybrid settings (timed once, so free), else the trained ones and those derived
        from them (an untrained control only shows quality), or every variant when none trains."""
        named = self.config["throughput"].get("variants")
        if named is None:
            return [v for v in self.variants if self.trained(v, "transfer")] or list(self.variants)
        chosen = set(long_context.with_recommended(self, named))
        timed = [self.hybrid(v) for v in chosen if v in self.variants]
        return [v for v in self.variants if v in chosen or self.hybrid(v) in timed]

    def export_slots(self) -> list[tuple[str, str]]:
        """(variant, stage) of every exported model: each variant that trains (or derives from one
        that does) at its last evaluated trained stage; untrained controls are not exported."""
        out = []
        for v in self.variants:
            trained = [s for s in self.variant_stages(v) if s in ("transfer", "transfer_lora")]
            if trained:
                out.append((v, trained[-1]))
        return out

    def export_stage(self, variant: str) -> str:
        stages = dict(self.export_slots())
        if variant not in stages:
            raise ValueError(f"variant '{variant}' is not exported (it trains no stage)")
        return stages[variant]

    def export_inputs(self, model: str, variant: str) -> dict[str, Any]:
        """What an export is built from: the stage's files, the training metrics of the runs it
        comes from, and the results its model card quotes (quality tables, throughput)."""
        stage = self.export_stage(variant)
        files: dict[str, Any] = dict(self.stage_inputs(model, variant, stage))
        files["transfer_metrics"] = path("transfer_metrics", model=model, variant=self.transfer_owner(variant))
        if stage == "transfer_lora":
            files["lora_metrics"] = path("lora_metrics", model=model, variant=self.lora_owner(variant))
        files["results"] = [path("quality", model=model, variant=variant, device=d, kind=k)
                            for d in self.devices for k in ("perplexity", "passkey")
                            if self.stage_quality_files(model, variant, d, k)]
        if variant in self.throughput_variants():
            files["results"] += [path("throughput", model=model, device=d) for d in self.devices]
        return files

    def corpus_files(
        self, model: str, variants: Iterable[str] | None = None, name: str = "transfer_corpus"
    ) -> list[str]:
        """The packed-document corpora the variants train on, in transfer or distillation (one per
        distinct seq_len/num_tokens; book rows are not among them); when none does, the top-level
        transfer section's (perplexity reads its held-out split and drops every document these list)."""
        corpora = [wc for part, wc in self.trained_parts(variants) if part == "documents"]  # each once
        return [path(name, model=model, **c) for c in corpora or [_corpus_wildcards(self.config["transfer"])]]

    def lora_data(self, model: str, variant: str) -> str:
        """The LoRA stage's data: instruction data, or the rows of its corpus (objective distill: lora.corpus,
        else the transfer's)."""
        corpus = self.lora_corpus(variant)
        if corpus is not None:
            return self.training_rows(model, variant, corpus=corpus)
        return path("instruct_data", model=model)

    def lora_inputs(self, model: str, variant: str) -> dict[str, str]:
        """The transfer artifacts a variant's LoRA stage starts from (its transfer owner's)."""
        owner = self.transfer_owner(variant)
        inputs = {a: path(f, model=model, variant=owner) for a, f in (("layers", "hybrid_layers"),
                                                                      ("teacher_states", "teacher_states"))}
        inputs.update(self.heads_ranking(model, [variant]))
        recall = self.recall_wildcards(variant)
        return inputs if recall is None else {**inputs, "recall": path("recall_rows", model=model, **recall)}

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
        if not own:  # a variant trained only as another's parent (stages: []) has no table
            return []
        # a slot left with no length of a long-context kind runs no job of it, and a variant that runs
        # none has no table of it (base's rows are in the tables of the variants that do)
        if not long_context.quality_lens(self, kind, variant):
            return []
        shared = [s for s in shared if long_context.quality_lens(self, kind, s)]
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
        plots = [path("plot_mmlu", model=m, fmt=f) for m in m_ for f in self.config["mmlu"]["formats"]
                 if self.mmlu_files(m, f)]
        plots += [path(k, model=m, device=d) for m in m_ for d in d_
                  for k in ("plot_throughput", "plot_memory", "plot_nll", "plot_passkey", "plot_components")]
        plots += [path("plot_books_nll", model=m, device=d) for m in m_ for d in d_
                  if self.quality_tables(m, d, "books")]
        plots += [path("plot_transfer_loss", model=m, variant=v) for m in m_ for v in self.transfer_slots()]
        plots += [path("plot_lora_loss", model=m, variant=s) for m in m_ for s in self.lora_slots()]
        return {
            "mmlu": [f for m in m_ for f in self.mmlu_files(m)],
            "zeroshot": [f for m in m_ for f in self.zeroshot_files(m)],
            "quality": [
                path("quality", model=m, variant=v, device=d, kind=k)
                for m in m_
                for v in v_
                for d in d_
                for k in QUALITY_KINDS
                if self.stage_quality_files(m, v, d, k)
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
            "exports": [path("export", model=m, variant=v) for m in m_ for v, _ in self.export_slots()],
            "manifests": [f for m in m_ for f in self.corpus_files(m, name="transfer_manifest")]
            + [path("book_rows_manifest", model=m, **wc) for m in m_ for part, wc in self.trained_parts()
               if part == "books"]
            + [path("recall_rows_manifest", model=m, **wc) for m in m_ for wc in self._recall_files()]
            + [path("instruct_manifest", model=m) for m in m_ if self._uses_instruct()],
        }

    def _recall_files(self) -> list[dict[str, str]]:
        return _each_once([wc for s in self.lora_slots() if (wc := self.recall_wildcards(s)) is not None])

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
            "rows": WILDCARD_PATTERNS["rows"],
            "facts": WILDCARD_PATTERNS["facts"],
        }
