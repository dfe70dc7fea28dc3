"""hybrid_llama.pipeline (the path table, config views and checks) and hybrid_llama.config (defaults,
merging), without running Snakemake (except to resolve a config exactly as the workflow does)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from snakemake.utils import validate

from hybrid_llama import config, pipeline
from hybrid_llama.config import ConfigError, canonical, deep_merge, schema_defaults
from hybrid_llama.pipeline import PATHS, Pipeline, parse_result_path, path, shared_data_dir

REPO = Path(__file__).resolve().parents[1]

MINIMAL = {"models": [{"name": "m", "kind": "random", "preset": "tiny"}],
           "variants": [{"name": "v", "hybrid": {"layers": [0]}}]}


def resolved(cfg: dict) -> dict:
    """A config with the schema's defaults filled in, exactly as the Snakefile's validate() does."""
    cfg = json.loads(json.dumps(cfg))
    validate(cfg, str(config.SCHEMA_PATH))
    return cfg


def make(cfg: dict | None = None, **overrides) -> Pipeline:
    return Pipeline(resolved(deep_merge(cfg or MINIMAL, overrides)), repo=REPO)


SAMPLE = {"model": "smollm2", "variant": "even_w64", "stage": "transfer_lora", "device": "cuda:1-h100",
          "fmt": "cloze", "shots": "5", "kind": "perplexity", "job": "transfer/smollm2/even_w64",
          "seq_len": "2048", "num_tokens": "65536", "book": "pg1342", "rows": "8", "facts": "4",
          "key": "0123456789ab"}


@pytest.mark.parametrize("name", sorted(PATHS))
def test_every_path_parses_back_to_its_name_and_wildcards(name):
    wildcards = {k: SAMPLE[k] for k in re.findall(r"\{(\w+)\}", PATHS[name])}
    file = path(name, **wildcards)
    assert "{" not in file
    got_name, got = parse_result_path(file)
    if got_name != name:  # a less specific template may not claim a file of another
        pytest.fail(f"{file} parsed as {got_name}, not {name}")
    assert got == wildcards
    assert parse_result_path("/abs/workdir/" + file) == (name, wildcards)


def test_parse_result_path_rejects_other_files():
    for bad in ("results/x.txt", "notresults/m/v/transfer/metrics.jsonx", "results/m/v/quality/gpu0/perplexity.csv"):
        with pytest.raises(ValueError, match="not a workflow artifact"):
            parse_result_path(bad)


def test_path_leaves_missing_wildcards_for_snakemake():
    assert path("adapter", variant="base_lora") == "results/{model}/base_lora/lora/adapter_model.safetensors"


def test_deep_merge_and_canonical():
    base = {"a": 1, "b": {"x": 1, "y": [1, 2]}}
    merged = deep_merge(base, {"b": {"y": [3]}, "c": 2})
    assert merged == {"a": 1, "b": {"x": 1, "y": [3]}, "c": 2} and base["b"]["y"] == [1, 2]
    assert list(canonical({"b": 1, "a": {"d": 1, "c": 2}})) == ["a", "b"]
    assert json.dumps(canonical({"z": {"b": 1, "a": 2}})) == '{"z": {"a": 2, "b": 1}}'


def test_library_defaults_are_the_schema_defaults():
    from hybrid_llama.train.finetune import FINETUNE_DEFAULTS
    from hybrid_llama.train.settings import RUN_DEFAULTS
    from hybrid_llama.train.transfer import CORPUS_KEYS, TRANSFER_DEFAULTS

    assert {k: v for k, v in TRANSFER_DEFAULTS.items() if k not in RUN_DEFAULTS and k != "eval_path"} \
        == {k: v for k, v in schema_defaults("transfer").items() if k not in CORPUS_KEYS}
    assert {k: v for k, v in FINETUNE_DEFAULTS.items() if k not in RUN_DEFAULTS} == schema_defaults("lora")


def test_hybrid_config_defaults_are_the_schema_defaults():
    """HybridConfig (the layers' own defaults) and the schema's hybrid block (the workflow's and the
    CLIs' defaults, via hybrid_llama.config) name the same recipe."""
    from hybrid_llama.layers import HybridConfig

    fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(HybridConfig) if f.name != "layers"}
    assert fields == config.hybrid_defaults()
    assert set(config.hybrid_defaults()) == set(config.load_schema()["$defs"]["hybrid"]["properties"]) - {"layers"}


def test_pipeline_reexports_the_config_and_names_it_was_built_on():
    """The Snakefile, the report and the training CLIs still import these from hybrid_llama.pipeline."""
    from hybrid_llama import names

    for name in ("SCHEMA_PATH", "ConfigError", "canonical", "deep_merge", "hybrid_defaults", "load_schema",
                 "schema_defaults", "settings_key"):
        assert getattr(pipeline, name) is getattr(config, name)
    for name in ("STAGES", "SHARED_STAGES", "VARIANT_STAGES", "STAGE_LABELS", "MMLU_FORMATS"):
        assert getattr(pipeline, name) is getattr(names, name)
    assert not hasattr(pipeline, "torch_device")


def test_shared_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRID_LLAMA_SHARED_DATA", raising=False)
    assert shared_data_dir() == REPO.resolve().parent / "shared" / "data"  # beside this checkout
    assert shared_data_dir(repo=tmp_path / "repo") == tmp_path / "shared" / "data"
    assert shared_data_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("HYBRID_LLAMA_SHARED_DATA", str(tmp_path / "env"))
    assert shared_data_dir() == tmp_path / "env"


def test_workflow_library_and_cli_train_the_same_recipe_for_an_empty_config(tiny_model_dir, shared_data_dir,
                                                                              tmp_path):
    """An empty transfer/lora section: the params the workflow hands its rules, the library's
    defaults and what the CLI runs with (its metrics.json records the resolved settings) agree."""
    from hybrid_llama.data import prepare_transfer_corpus
    from hybrid_llama.train.settings import RUN_DEFAULTS
    from hybrid_llama.train.transfer import TRANSFER_DEFAULTS

    wf = make()
    workflow_recipe = wf.transfer_train("v")  # the transfer rule's params
    recipe_keys = set(workflow_recipe)
    library_recipe = canonical({k: TRANSFER_DEFAULTS[k] for k in recipe_keys})
    assert workflow_recipe == library_recipe

    corpus = tmp_path / "corpus.safetensors"
    prepare_transfer_corpus({"kind": "local", "path": str(shared_data_dir / "fineweb-edu" /
                                                      "fineweb-edu-sample-10BT.150docs.text.jsonl")},
                            str(tiny_model_dir), corpus, seq_len=32, num_tokens=32 * 8)
    out = tmp_path / "cli"
    run = subprocess.run(
        [sys.executable, "-m", "hybrid_llama.train.transfer", "--model-dir", str(tiny_model_dir),
         "--packed", str(corpus), "--layers", "0", "--out", str(out),
         "--train", json.dumps({"progress": False, "checkpoint_every": 0})],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    cli_recipe = {k: v for k, v in metrics["train"].items() if k in recipe_keys and k != "checkpoint_every"}
    assert canonical(cli_recipe) == {k: v for k, v in workflow_recipe.items() if k != "checkpoint_every"}
    assert metrics["hybrid"] == {**wf.hybrid("v"), "layers": [0]}  # CLI flags' defaults
    assert set(metrics["train"]) == set(TRANSFER_DEFAULTS) and set(RUN_DEFAULTS) <= set(metrics["train"])


def test_lora_control_overrides_only_target():
    wf = make()
    # the keys added later (answer_target, position_draw, recall_*) at their defaults stay out of the params
    # (LoraSettings fills them in), so no job reruns for them
    later = ("answer_target", "position_draw", "recall_asks", "recall_same_attribute", "recall_subjects")
    defaults = {k: v for k, v in schema_defaults("lora").items() if k not in later}
    assert schema_defaults("lora")["answer_target"] == "teacher"
    assert wf.lora("base_lora") == canonical({**defaults, "target": "all"})
    assert wf.lora("v") == canonical(defaults)
    cfg = deep_merge(MINIMAL, {})
    cfg["variants"][0]["lora"] = {"answer_target": "token"}
    assert make(cfg).lora("v")["answer_target"] == "token"


def test_variant_overrides_merge_into_the_sections():
    cfg = deep_merge(MINIMAL, {})
    cfg["variants"][0]["transfer"] = {"lr": 0.01}
    wf = make(cfg)
    assert wf.transfer("v")["lr"] == 0.01
    assert wf.transfer("v")["batch_size"] == schema_defaults("transfer")["batch_size"]


@pytest.mark.parametrize(
    "mutate,key,needle",
    [
        (lambda c: c["variants"][0]["hybrid"].update(layers=[0, 4]), "variants[v].hybrid.layers", "layer index 4"),
        (lambda c: c["variants"].append(dict(c["variants"][0])), "variants[1].name", "duplicate name"),
        (lambda c: c.update(base_lora={"layers": [9]}), "base_lora.layers", "4 layers"),
        (
            lambda c: c["data"]["transfer"].update(source="local", local="nowhere/x.jsonl"),
            "data.transfer.local",
            "does not exist",
        ),
        (lambda c: c["mmlu"].update(subjects=["astrology"]), "mmlu.subjects", "unknown subjects"),
        (
            lambda c: c["transfer"].update(num_tokens=2048, seq_len=1024),
            "transfer.num_tokens",
            "needs at least 8 (eval_sequences + one batch)",
        ),
        (lambda c: c["transfer"].update(seq_len=8192), "transfer.seq_len", "positions (4096)"),
        (lambda c: c["transfer"].update(max_position=512), "transfer.max_position", "shorter than a training row"),
        (lambda c: c["variants"][0].update(transfer={"max_position": 8192}), "variants[v].transfer.max_position",
         "4096 positions"),
        (lambda c: c["lora"].update(max_position=5000), "lora.max_position", "4096 positions"),
        (
            lambda c: c["variants"][0].update(transfer={"trainable": "feature_map"}),
            "variants[v].transfer.trainable",
            "selects nothing",
        ),
        (
            lambda c: (
                c["variants"][0]["hybrid"].update(formulation="window"),
                c["variants"][0].update(transfer={"trainable": "logits"}),
            ),
            "variants[v].transfer.trainable",
            "window-only",
        ),
        (
            lambda c: c["variants"][0].update(lora={"objective": "distill"}, transfer={"num_tokens": 1024 * 9}),
            "variants[v].transfer.num_tokens",
            "LoRA (objective distill)",
        ),
        (lambda c: c["base_lora"].update(objective="distill"), "base_lora.objective", "instruct"),
        (
            lambda c: c["variants"][0].update(transfer={"seq_len": 64}),
            "variants[v].transfer.seq_len",
            "rows of 64 tokens hold no key older than variant 'v''s 64-token window",
        ),
        (
            lambda c: (c["variants"][0]["hybrid"].update(window=128), c["transfer"].update(seq_len=100)),
            "transfer.seq_len",
            "use more than 128",
        ),
        (
            lambda c: c["variants"][0]["hybrid"].update(formulation="window", decay=0.99),
            "variants[v].hybrid.decay",
            "no linear state to decay",
        ),
    ],
)
def test_semantic_checks_name_the_key(mutate, key, needle):
    cfg = resolved(MINIMAL)
    mutate(cfg)
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        Pipeline(cfg, repo=REPO).check()
    assert err.value.key == key and f"'{key}'" in str(err.value)


def test_report_inputs_are_artifacts_of_the_table():
    wf = make()
    inputs = wf.report_inputs()
    files = [f for group in inputs.values() for f in group]
    assert files and all(parse_result_path(f) for f in files)
    assert {parse_result_path(f)[0] for f in inputs["mmlu"]} == {"mmlu"}
    slots = {(w["variant"], w["stage"]) for _, w in map(parse_result_path, inputs["mmlu"])}
    assert slots == {("base", "base"), ("base_lora", "base_lora"), ("v", "transfer"), ("v", "transfer_lora")}


def test_stage_inputs():
    wf = make()
    assert wf.stage_inputs("m", "base", "base") == {"weights": path("weights", model="m")}
    assert set(wf.stage_inputs("m", "v", "transfer_lora")) == {"weights", "layers", "adapter"}
    assert wf.stage_inputs("m", "base_lora", "base_lora")["adapter"] == path("adapter", model="m", variant="base_lora")
    with pytest.raises(ValueError, match="not evaluated under"):
        wf.stage_inputs("m", "v", "base")


def test_variant_stages_and_the_files_they_need():
    cfg = resolved(MINIMAL)
    cfg["variants"] += [
        {
            "name": "lc",
            "hybrid": {"layers": [0], "formulation": "lolcats", "feature_map": "hedgehog"},
            "transfer": {"seq_len": 2048, "num_tokens": 65536},
            "lora": {"objective": "distill"},
        },
        {"name": "ctl", "hybrid": {"layers": [0], "formulation": "window"}, "stages": ["converted"]},
        {"name": "final", "hybrid": {"layers": [0]}, "stages": ["transfer_lora"]},
    ]
    wf = Pipeline(resolved(cfg), repo=REPO)
    wf.check()
    # a variant evaluated only at its last stage still trains through transfer, and the component
    # diagnostic (alone) also looks at the model right after transfer
    assert ("final", "transfer") not in wf.eval_slots() and "final" in wf.transfer_slots()
    expected = {"perplexity": ["base", "transfer_lora", "base_lora"], "components": ["transfer", "transfer_lora"]}
    for kind, stages in expected.items():
        assert [parse_result_path(f)[1]["stage"] for f in wf.stage_quality_files("m", "final", "cpu", kind)] == stages
    cfg["variants"].pop()
    wf = Pipeline(resolved(cfg), repo=REPO)
    assert wf.variant_stages("v") == ["transfer", "transfer_lora"] and wf.variant_stages("ctl") == ["converted"]
    assert ("ctl", "converted") in wf.eval_slots() and ("ctl", "transfer") not in wf.eval_slots()
    assert wf.stage_inputs("m", "ctl", "converted") == {"weights": path("weights", model="m")}
    assert wf.stage_hybrid("ctl", "converted")["formulation"] == "window"
    assert wf.transfer_slots() == ["v", "lc"] == wf.throughput_variants() and wf.lora_slots() == [
        "v",
        "lc",
        "base_lora",
    ]
    # one corpus per distinct seq_len x num_tokens; distill trains on its variant's corpus
    assert wf.corpus("lc") == {"seq_len": "2048", "num_tokens": "65536"}
    assert wf.corpus_files("m") == [
        "resources/data/transfer/m/L1024_N1000000.safetensors",
        "resources/data/transfer/m/L2048_N65536.safetensors",
    ]
    assert wf.lora_data("m", "lc") == wf.corpus_files("m")[1]
    assert wf.lora_data("m", "v") == wf.lora_data("m", "base_lora") == path("instruct_data", model="m")
    assert wf.corpus_settings("2048", "all")["num_tokens"] is None
    assert "seq_len" not in wf.transfer_train("lc") and wf.transfer("lc")["seq_len"] == 2048
    assert [parse_result_path(f)[1]["stage"] for f in wf.stage_quality_files("m", "ctl", "cpu", "perplexity")] == [
        "base",
        "converted",
        "base_lora",
    ]
    assert [parse_result_path(f)[1]["stage"] for f in wf.stage_quality_files("m", "lc", "cpu", "components")] == [
        "transfer",
        "transfer_lora",
    ]


def test_untrained_variants_still_get_the_top_level_corpus():
    """With no variant to train, perplexity still reads the top-level transfer section's corpus, named
    by the same wildcards a trained variant's corpus would have."""
    cfg = resolved(MINIMAL)
    cfg["variants"][0]["stages"] = ["converted"]
    cfg["transfer"]["num_tokens"] = None
    wf = Pipeline(cfg, repo=REPO)
    assert wf.transfer_slots() == [] and wf.corpus("v") == {"seq_len": "1024", "num_tokens": "all"}
    assert wf.corpus_files("m") == [path("transfer_corpus", model="m", **wf.corpus("v"))]


def test_formulations_of_the_schema_are_the_ops():
    from hybrid_llama.ops.hybrid.reference import FORMULATIONS

    hybrid = config.load_schema()["$defs"]["hybrid"]["properties"]
    assert tuple(hybrid["formulation"]["enum"]) == FORMULATIONS
    assert tuple(config.load_schema()["properties"]["stages"]["items"]["enum"]) == pipeline.STAGES
    from hybrid_llama.train.positions import POSITION_DRAWS

    defs = config.load_schema()["$defs"]
    assert tuple(defs["position_draw"]["enum"]) == POSITION_DRAWS
    for section in ("transfer", "lora"):  # one definition serves both stages
        assert defs[section]["properties"]["position_draw"] == {"$ref": "#/$defs/position_draw"}


def test_position_draw_is_a_param_where_it_leaves_its_default_only():
    """At its default (the draw of every run before the key) it stays out of the params, so adding the
    key reran no stage; set otherwise it is a param, so changing it retrains the stage."""
    from hybrid_llama.train.settings import LoraSettings, TransferSettings

    wf = make()
    assert "position_draw" not in wf.transfer_train("v") and "position_draw" not in wf.lora_train("v")
    cfg = deep_merge(MINIMAL, {})
    cfg["variants"][0]["transfer"] = {"max_position": 2048, "seq_len": 512, "position_draw": "cover"}
    cfg["variants"][0]["lora"] = {"max_position": 2048}
    wf = make(cfg)
    assert wf.transfer_train("v")["position_draw"] == "cover" and "position_draw" not in wf.lora_train("v")
    assert TransferSettings.from_dict(wf.transfer_train("v")).position_draw == "cover"
    assert LoraSettings.from_dict(wf.lora_train("v")).position_draw == "uniform"


DERIVED = {**MINIMAL, "variants": [
    {"name": "v", "hybrid": {"layers": [0], "formulation": "lolcats", "feature_map": "hedgehog"},
     "transfer": {"trainable": "logits+feature_map"}, "lora": {"objective": "distill"}},
    {"name": "cache", "from": "v", "hybrid": {"sparse_cache": 16, "sinks": 2}, "stages": ["transfer_lora"]},
    {"name": "cache_ft", "from": "v", "hybrid": {"sparse_cache": 16}, "lora": {"lr": 0.001}},
]}


def test_derived_variants_reuse_the_parents_artifacts():
    wf = make(DERIVED)
    assert wf.hybrid("cache") == {**wf.hybrid("v"), "sparse_cache": 16, "sinks": 2, "cache_score": "sre"}
    assert "sparse_cache" not in wf.hybrid("v")  # the cache off: params as before the cache existed
    assert wf.transfer("cache") == wf.transfer("v") and wf.lora("cache") == wf.lora("v")
    assert wf.lora("cache_ft")["lr"] == 0.001 and wf.lora("cache_ft")["objective"] == "distill"
    # one transfer and one LoRA job per owner: 'cache' trains nothing, 'cache_ft' only its LoRA
    assert wf.transfer_slots() == ["v"] and wf.lora_slots() == ["v", "cache_ft", "base_lora"]
    owned = {"layers": path("hybrid_layers", model="m", variant="v")}
    assert wf.stage_inputs("m", "cache", "transfer_lora") == {
        "weights": path("weights", model="m"), **owned, "adapter": path("adapter", model="m", variant="v")}
    assert wf.stage_inputs("m", "cache_ft", "transfer_lora")["adapter"] == path("adapter", model="m",
                                                                                variant="cache_ft")
    assert wf.lora_inputs("m", "cache_ft") == {**owned, "teacher_states": path("teacher_states", model="m",
                                                                                  variant="v")}
    assert set(wf.throughput_variants()) == {"v", "cache", "cache_ft"}
    assert wf.component_stages("cache") == ["transfer_lora"]  # no diagnostic of the parent's transfer again


def test_a_variant_with_no_stages_trains_only_as_a_parent():
    """stages: [] (the default's lolcats_sparse_distill): its LoRA job still runs for the variant
    derived from it, and nothing of its own is evaluated, tabled or exported."""
    cfg = deep_merge(DERIVED, {})
    cfg["variants"][2]["stages"] = []
    cfg["variants"].append({"name": "heads", "from": "cache_ft", "hybrid": {"sinks": 1},
                            "stages": ["transfer_lora"]})
    wf = make(cfg)
    assert wf.variant_stages("cache_ft") == [] and wf.variant_stages("heads") == ["transfer_lora"]
    assert wf.lora_slots() == ["v", "cache_ft", "base_lora"]  # the adapter 'heads' evaluates
    assert wf.stage_inputs("m", "heads", "transfer_lora")["adapter"] == path("adapter", model="m",
                                                                             variant="cache_ft")
    assert all(slot != "cache_ft" for slot, _ in wf.eval_slots())
    assert wf.component_stages("cache_ft") == []
    for kind in ("perplexity", "passkey", "components"):
        assert wf.stage_quality_files("m", "cache_ft", "cpu", kind) == []
    assert "cache_ft" not in dict(wf.export_slots()) and "heads" in dict(wf.export_slots())
    inputs = wf.report_inputs()
    # only its training's files: the adapter's metrics and loss curve
    assert [f for group in inputs.values() for f in group if "/cache_ft/" in f] == [
        path("plot_lora_loss", model="m", variant="cache_ft"), path("lora_metrics", model="m", variant="cache_ft")]


@pytest.mark.parametrize("mutate,key,needle", [
    (lambda c: c["variants"][1].update({"from": "nope"}), "variants[cache].from", "no variant named 'nope'"),
    (lambda c: c["variants"][0].update({"from": "cache_ft"}), "variants[cache_ft].from", "cycle"),
    (lambda c: c["variants"][1]["hybrid"].update(window=32), "variants[cache].hybrid.window", "may change only"),
    (lambda c: c["variants"][0]["hybrid"].update(formulation="hybrid", feature_map="elu1"),
     "variants[cache].hybrid.sparse_cache", "formulation 'lolcats'"),
    # stages: [] with no variant derived from it would run nothing
    (lambda c: c["variants"][1].update(stages=[]), "variants[cache].stages", "no variant derives from it"),
])
def test_derived_variant_errors_name_the_key(mutate, key, needle):
    cfg = resolved(DERIVED)
    mutate(cfg)
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        Pipeline(cfg, repo=pipeline.SCHEMA_PATH.parents[2]).check()
    assert err.value.key == key


def test_throughput_variants_names_whom_to_time_and_brings_their_twins():
    """A named variant is timed with every variant of the same hybrid settings (measured once, so
    free); the others are not, and the long lengths may only name timed variants."""
    twin = {"name": "twin", "from": "v", "hybrid": {"sparse_cache": 16, "sinks": 2}, "lora": {"lr": 0.01}}
    cfg = {**DERIVED, "variants": [*DERIVED["variants"], twin, {"name": "other", "hybrid": {"layers": [0]}}]}
    assert make(cfg).throughput_variants() == ["v", "cache", "cache_ft", "twin", "other"]  # null: every trained one
    wf = make(cfg, throughput={"variants": ["recommended"], "long": {"variants": ["recommended"]}}, recommended="cache")
    wf.check()
    assert wf.throughput_variants() == ["cache", "twin"]  # twin: other weights, the same hybrid settings
    assert make(cfg, throughput={"variants": ["other"]}).throughput_variants() == ["other"]
    for settings, key in [({"variants": ["nope"]}, "throughput.variants[0]"),
                          ({"variants": ["other"], "long": {"variants": ["v"]}}, "throughput.long.variants")]:
        with pytest.raises(ConfigError) as err:
            make(cfg, throughput=settings).check()
        assert err.value.key == key


@pytest.mark.parametrize("value", [-1, 2.5, "8"])
def test_sparse_cache_must_be_a_non_negative_integer(value):
    cfg = json.loads(json.dumps(DERIVED))
    cfg["variants"][1]["hybrid"]["sparse_cache"] = value
    with pytest.raises(Exception, match="sparse_cache"):
        resolved(cfg)


def test_exports_are_the_final_trained_stages_and_read_their_owners_metrics():
    cfg = resolved(DERIVED)
    cfg["variants"] += [{"name": "ctl", "hybrid": {"layers": [0], "formulation": "window"}, "stages": ["converted"]},
                        {"name": "tr", "hybrid": {"layers": [0]}, "stages": ["transfer"]}]
    wf = Pipeline(resolved(cfg), repo=REPO)
    # untrained controls are not exported; a variant evaluated only after transfer is exported there
    assert wf.export_slots() == [("v", "transfer_lora"), ("cache", "transfer_lora"), ("cache_ft", "transfer_lora"),
                                 ("tr", "transfer")]
    with pytest.raises(ValueError, match="not exported"):
        wf.export_inputs("m", "ctl")
    derived = wf.export_inputs("m", "cache")
    assert derived["layers"] == path("hybrid_layers", model="m", variant="v")
    assert derived["transfer_metrics"] == path("transfer_metrics", model="m", variant="v")
    assert derived["lora_metrics"] == path("lora_metrics", model="m", variant="v")
    assert wf.export_inputs("m", "cache_ft")["lora_metrics"] == path("lora_metrics", model="m", variant="cache_ft")
    # the card quotes the variant's own quality tables and the throughput it was measured in
    assert derived["results"] == [path("quality", model="m", variant="cache", device="cpu", kind=k)
                                  for k in ("perplexity", "passkey")] + [path("throughput", model="m", device="cpu")]
    only_transfer = wf.export_inputs("m", "tr")
    assert "lora_metrics" not in only_transfer and "adapter" not in only_transfer
    exports = wf.report_inputs()["exports"]
    assert exports == [path("export", model="m", variant=v) for v, _ in wf.export_slots()]
    assert all(parse_result_path(f) == ("export", {"model": "m", "variant": v})
               for f, (v, _) in zip(exports, wf.export_slots()))
    assert parse_result_path(exports[0] + "/README.md")[0] == "model_card"
