"""MMLU through lm-eval: prompts, few-shot rows, label order, aggregates, compare."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from hybrid_llama.eval.mmlu import compare, run_mmlu, write_result
from hybrid_llama.models import load_model
from hybrid_llama.pipeline import shared_data_dir

REPO = Path(__file__).resolve().parents[1]
SHARED = shared_data_dir()
MMLU_DIR = SHARED / "mmlu"
# Two subjects with short questions so 5-shot prompts fit the tiny model's 4096 positions (byte tokens).
SUBJECTS = ["abstract_algebra", "college_mathematics"]
LIMIT = 4
needs_mmlu = pytest.mark.skipif(not (MMLU_DIR / "dev").is_dir(), reason=f"no MMLU copy at {MMLU_DIR}")


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def render_mc(row: dict, with_answer: bool) -> str:
    """lm-eval's MMLU layout, written out independently of the generated YAML."""
    text = row["question"].strip() + "".join(f"\n{L}. {row[f'choice{i}']}" for i, L in enumerate("ABCD"))
    text += "\nAnswer:"
    return text + (" " + "ABCD"[int(row["answer"])] if with_answer else "")


# ------------------------------------------------------------------ shared runs (lm-eval is slow to import)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def runs(tiny):
    if not (MMLU_DIR / "dev").is_dir():
        pytest.skip(f"no MMLU copy at {MMLU_DIR}")
    model, tok = tiny
    out = {}
    for fmt, shots in [("mc", 0), ("mc", 5), ("cloze", 5)]:
        out[fmt, shots] = run_mmlu(model, tok, data={"kind": "local", "path": str(MMLU_DIR)}, shots=shots,
                                   fmt=fmt, limit=LIMIT, subjects=SUBJECTS, batch_size=4, device="cpu",
                                   meta={"model_hash": "m0", "variant": "tiny"}, log_prompts=True)
    return out


@needs_mmlu
def test_five_shot_prompt_holds_first_five_dev_rows(runs, tiny):
    res = runs["mc", 5]
    # lm-eval silently left-truncates prompts longer than the model: make sure none was cut
    assert max(len(tiny[1](q["prompt"]).input_ids) for q in res["questions"]) + 2 <= res["max_length"]
    assert res["shots"] == 5 and res["fmt"] == "mc"
    for subject in SUBJECTS:
        dev = read_csv(MMLU_DIR / "dev" / f"{subject}_dev.csv")
        test = read_csv(MMLU_DIR / "test" / f"{subject}_test.csv")
        qs = [q for q in res["questions"] if q["subject"] == subject]
        assert [q["doc_id"] for q in qs] == list(range(LIMIT))
        for q in qs:
            desc = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
            shots = "".join(render_mc(r, True) + "\n\n" for r in dev[:5])
            assert q["prompt"] == desc + shots + render_mc(test[q["doc_id"]], False)
            assert q["continuations"] == [" A", " B", " C", " D"]
            assert q["gold"] == "ABCD"[int(test[q["doc_id"]]["answer"])]


@needs_mmlu
def test_zero_shot_prompt_is_description_and_question(runs):
    res = runs["mc", 0]
    test = read_csv(MMLU_DIR / "test" / f"{SUBJECTS[0]}_test.csv")
    q = next(q for q in res["questions"] if q["subject"] == SUBJECTS[0] and q["doc_id"] == 1)
    assert q["prompt"] == ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
                           + render_mc(test[1], False))


@needs_mmlu
@pytest.mark.parametrize("key", [("mc", 0), ("mc", 5), ("cloze", 5)])
def test_aggregates_match_recomputation(runs, key):
    res = runs[key]
    metrics = ["acc", "acc_norm"] if key[0] == "cloze" else ["acc"]
    assert set(res["per_subject"]) == set(SUBJECTS)
    for m in metrics:
        for subject, s in res["per_subject"].items():
            vals = [q[m] for q in res["questions"] if q["subject"] == subject]
            assert s["n"] == len(vals) == LIMIT
            assert s[m] == pytest.approx(sum(vals) / len(vals))
            # lm-eval's stderr of a mean: sample std / sqrt(n)
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
            assert s[f"{m}_stderr"] == pytest.approx(sd / math.sqrt(len(vals)))
        ps = res["per_subject"].values()
        agg = res["aggregate"]
        weighted = sum(s[m] * s["n"] for s in ps) / sum(s["n"] for s in ps)
        assert agg[f"{m}_weighted"] == pytest.approx(weighted)
        assert agg[f"lm_eval_group_{m}"] == pytest.approx(weighted)
        assert agg[f"{m}_mean"] == pytest.approx(sum(s[m] for s in ps) / len(SUBJECTS))
        assert agg[f"{m}_mean_stderr"] == pytest.approx(
            math.sqrt(sum(s[f"{m}_stderr"] ** 2 for s in ps)) / len(SUBJECTS))
    assert agg["n"] == LIMIT * len(SUBJECTS)


@needs_mmlu
def test_result_metadata_and_predictions(runs, tmp_path):
    import lm_eval

    res = runs["mc", 0]
    assert res["lm_eval_version"] == lm_eval.__version__
    assert res["device_name"] == "cpu" and res["dtype"] == "float32" and res["wall_time_s"] > 0
    assert res["model_hash"] == "m0" and res["meta"]["variant"] == "tiny" and res["limit"] == LIMIT
    for q in res["questions"]:
        lls = q["loglikelihoods"]
        assert len(lls) == 4 and all(ll < 0 for ll in lls)
        assert q["pred"] == "ABCD"[lls.index(max(lls))]
        assert q["acc"] == int(q["pred"] == q["gold"])
    back = json.loads(write_result(res, tmp_path / "r.json").read_text())
    assert back["questions"] == res["questions"]


@needs_mmlu
def test_cloze_prompt_and_choices(runs):
    res = runs["cloze", 5]
    test = read_csv(MMLU_DIR / "test" / f"{SUBJECTS[1]}_test.csv")
    dev = read_csv(MMLU_DIR / "dev" / f"{SUBJECTS[1]}_dev.csv")
    q = next(q for q in res["questions"] if q["subject"] == SUBJECTS[1] and q["doc_id"] == 2)
    row = test[2]
    shots = "".join(f"Question: {r['question'].strip()}\nAnswer: {r['choice' + r['answer']]}\n\n" for r in dev)
    assert q["prompt"] == ("The following are questions (with answers) about college mathematics.\n\n" + shots
                           + f"Question: {row['question'].strip()}\nAnswer:")
    assert q["continuations"] == [" " + row[f"choice{i}"] for i in range(4)]
    lens = [len(row[f"choice{i}"]) for i in range(4)]
    norm = [ll / n for ll, n in zip(q["loglikelihoods"], lens)]
    assert q["pred_norm"] == "ABCD"[norm.index(max(norm))]
    assert {"acc_norm", "acc_norm_stderr"} <= set(res["per_subject"][SUBJECTS[1]])


# ------------------------------------------------------------------ label order: a model that knows the answer


class OracleLM(LlamaForCausalLM):
    """Reads the current question (text after the last blank line) and puts all probability on the
    right answer: in the MC format the letter of the choice line that reads RIGHT, in the cloze
    format the text " RIGHT". Any swap of letters, choices or gold indices makes it lose points."""

    def __init__(self, config, tokenizer):
        super().__init__(config)
        self.tok = tokenizer

    def _target(self, text: str) -> str | None:
        block = text.split("\n\n")[-1]
        if block.endswith("Answer:"):
            return " "
        if "\nA. " in block:  # MC format
            if block.endswith("Answer: "):
                return next(ln[0] for ln in block.split("\n") if ln[1:] == ". RIGHT")
            return None
        for k in range(len("RIGHT")):  # cloze format: spell out RIGHT
            if block.endswith("Answer: " + "RIGHT"[:k]):
                return "RIGHT"[k]
        return None

    def forward(self, input_ids=None, **kwargs):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        for b in range(B):
            for t in range(T):
                text = self.tok.decode(input_ids[b, : t + 1], skip_special_tokens=True)
                nxt = self._target(text)
                if nxt is not None:
                    logits[b, t, self.tok.convert_tokens_to_ids(self.tok.tokenize(nxt))[0]] = 30.0
        return CausalLMOutputWithPast(logits=logits)


def write_fixture_mmlu(root: Path) -> dict[str, list[int]]:
    """Two subjects whose right answer text is RIGHT, at varying positions."""
    answers = {"alpha_facts": [2, 0, 3, 1, 1, 2], "beta_facts": [3, 3, 0, 2, 1, 0]}
    for subject, ans in answers.items():
        for split, rows in (("dev", ans[:5]), ("test", ans)):
            (root / split).mkdir(parents=True, exist_ok=True)
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
                for i, a in enumerate(rows):
                    choices = [f"wrong {j}" for j in range(4)]
                    choices[a] = "RIGHT"
                    w.writerow([f"{subject} {split} question {i}?", *choices, a])
    return answers


@pytest.mark.parametrize("fmt", ["mc", "cloze"])
def test_label_order_with_oracle(tmp_path, fmt, tiny_model_dir, tiny_tokenizer):
    answers = write_fixture_mmlu(tmp_path / "mmlu")
    tok = tiny_tokenizer
    oracle = OracleLM(LlamaConfig.from_pretrained(tiny_model_dir), tok).eval()
    res = run_mmlu(oracle, tok, data={"kind": "local", "path": str(tmp_path / "mmlu")}, shots=2, fmt=fmt,
                   limit=None, subjects=None, batch_size=3, device="cpu")
    assert res["subjects"] == sorted(answers)
    for q in res["questions"]:
        assert q["gold"] == "ABCD"[answers[q["subject"]][q["doc_id"]]]
        assert q["pred"] == q["gold"] and q["acc"] == 1
    assert res["aggregate"]["acc_weighted"] == 1.0 and res["aggregate"]["acc_mean"] == 1.0
    if fmt == "cloze":
        assert res["aggregate"]["acc_norm_weighted"] == 1.0


# ------------------------------------------------------------------ compare


def _fixture_result(preds: list[str], lls: list[list[float]], **settings) -> dict:
    qs = [{"subject": "s", "doc_id": i, "gold": "A", "pred": p, "loglikelihoods": ll, "acc": int(p == "A"),
           "prompt_hash": f"h{i}"} for i, (p, ll) in enumerate(zip(preds, lls))]
    return {"fmt": "mc", "shots": 0, "device_name": "cpu", "questions": qs, **settings}


def test_compare_fixture_files(tmp_path):
    a = _fixture_result(["A", "B", "C"], [[-1, -2, -3, -4], [-2, -1, -3, -4], [-3, -3, -1, -4]])
    b = _fixture_result(["A", "A", "C"], [[-1, -2, -3, -4], [-0.5, -1, -3, -4], [-3, -3, -1.25, -4]],
                        device_name="NVIDIA H100 80GB HBM3")
    pa, pb = write_result(a, tmp_path / "a.json"), write_result(b, tmp_path / "b.json")
    c = compare(pa, pb)
    assert c["n_common"] == 3 and c["n_changed"] == 1
    assert c["changed"][0]["doc_id"] == 1 and (c["changed"][0]["pred_a"], c["changed"][0]["pred_b"]) == ("B", "A")
    assert c["max_abs_ll_diff"] == pytest.approx(1.5) and c["max_abs_ll_diff_at"]["doc_id"] == 1
    assert c["settings_differ"] == {"device_name": ["cpu", "NVIDIA H100 80GB HBM3"]}
    assert c["acc_a"] == pytest.approx(1 / 3) and c["acc_b"] == pytest.approx(2 / 3)
    same = compare(pa, pa)
    assert same["n_changed"] == 0 and same["max_abs_ll_diff"] == 0.0

    cli = subprocess.run([sys.executable, "-m", "hybrid_llama.eval.mmlu", "compare", str(pa), str(pb)],
                         capture_output=True, text=True, check=True)
    assert json.loads(cli.stdout)["n_changed"] == 1


@needs_mmlu
def test_compare_real_runs(runs, tmp_path):
    c = compare(runs["mc", 0], runs["mc", 5])
    assert c["n_common"] == LIMIT * len(SUBJECTS)
    assert c["settings_differ"]["shots"] == [0, 5] and c["prompts_differ"] == c["n_common"]
    assert c["max_abs_ll_diff"] > 0


@pytest.mark.parametrize("fmt,shipped", [("mc", "default/_default_template_yaml"),
                                         ("cloze", "continuation/_continuation_template_yaml")])
def test_generated_yaml_matches_lm_eval_mmlu_templates(tmp_path, fmt, shipped):
    """Our task definitions use lm-eval's own MMLU prompts (as shipped with the installed lm-eval)."""
    import lm_eval
    import yaml

    from hybrid_llama.eval.mmlu import write_task_yamls

    root = Path(lm_eval.__file__).parent / "tasks" / "mmlu"
    ref = yaml.safe_load((root / shipped).read_text())
    group = write_task_yamls({"kind": "hf"}, ["high_school_physics"], fmt, tmp_path)
    ours = yaml.safe_load((tmp_path / f"hl_mmlu_{fmt}_high_school_physics.yaml").read_text())
    assert ours["doc_to_text"] == ref["doc_to_text"]
    assert ours["fewshot_split"] == ref["fewshot_split"] == "dev" and ours["test_split"] == "test"
    assert ours["fewshot_config"] == ref["fewshot_config"] == {"sampler": "first_n"}
    assert ours["dataset_path"] == "cais/mmlu" and ours["dataset_name"] == "high_school_physics"
    if fmt == "mc":
        assert ours["doc_to_choice"] == ref["doc_to_choice"] and ours["doc_to_target"] == ref["doc_to_target"]
        shipped_task = yaml.safe_load((root / "default" / "mmlu_high_school_physics.yaml").read_text())
    else:  # lm-eval writes these as templates; ours name the same features directly
        assert ref["doc_to_choice"] == "{{choices}}" and ours["doc_to_choice"] == "choices"
        assert ref["doc_to_target"] == "{{answer}}" and ours["doc_to_target"] == "answer"
        shipped_task = yaml.safe_load((root / "continuation" / "mmlu_high_school_physics.yaml").read_text())
    assert ours["description"] == shipped_task["description"]
    grp = yaml.safe_load((tmp_path / f"{group}.yaml").read_text())
    assert grp["task"] == [f"hl_mmlu_{fmt}_high_school_physics"]
    assert all(m["weight_by_size"] for m in grp["aggregate_metric_list"])


def test_local_yaml_uses_absolute_paths(tmp_path, monkeypatch):
    import yaml

    from hybrid_llama.eval.mmlu import write_task_yamls

    write_fixture_mmlu(tmp_path / "data" / "mmlu")
    monkeypatch.chdir(tmp_path / "data")
    out = tmp_path / "tasks"
    out.mkdir()
    write_task_yamls({"kind": "local", "path": "mmlu"}, ["alpha_facts"], "mc", out)
    cfg = yaml.safe_load((out / "hl_mmlu_mc_alpha_facts.yaml").read_text())
    files = cfg["dataset_kwargs"]["data_files"]
    assert set(files) == {"dev", "test"} and all(Path(f).is_absolute() and Path(f).exists() for f in files.values())
    rows = [json.loads(line) for line in Path(files["test"]).read_text().splitlines()]
    assert rows[0] == {"question": "alpha_facts test question 0?", "subject": "alpha_facts",
                       "choices": ["wrong 0", "wrong 1", "RIGHT", "wrong 3"], "answer": 2}


@needs_mmlu
def test_hybrid_with_full_window_matches_base(runs, tiny_model_dir):
    """Window longer than every prompt: the linear part is empty and the hybrid is exact softmax attention,
    so lm-eval must see the same loglikelihoods and predictions as for the base model."""
    from hybrid_llama.models import convert_to_hybrid

    model, tok = load_model(tiny_model_dir, dtype=torch.float32)
    longest = max(len(tok(q["prompt"] + " A").input_ids) for q in runs["mc", 0]["questions"])
    convert_to_hybrid(model, list(range(model.config.num_hidden_layers)), window=longest, backend="chunked")
    res = run_mmlu(model, tok, data={"kind": "local", "path": str(MMLU_DIR)}, shots=0, fmt="mc", limit=LIMIT,
                   subjects=SUBJECTS, batch_size=4, device="cpu", meta={"model_hash": "m0", "variant": "hybrid"})
    c = compare(runs["mc", 0], res)
    assert c["n_common"] == LIMIT * len(SUBJECTS) and c["prompts_differ"] == 0
    assert c["n_changed"] == 0 and c["max_abs_ll_diff"] < 1e-4
