"""`python -m hybrid_llama.lm_eval`: lm-eval's own command line on an exported hybrid, offline, against
the pipeline's MMLU path (hybrid_llama.eval.mmlu) on the same model and questions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_llama.eval.mmlu import LETTERS, run_mmlu, task_name, write_task_yamls
from hybrid_llama.models import HybridLlamaAttention, convert_to_hybrid, load_model, save_hybrid
from hybrid_llama.pipeline import shared_data_dir

SRC = Path(__file__).resolve().parents[1] / "src"
MMLU_DIR = shared_data_dir() / "mmlu"
# Short questions: the window (8) is far shorter than every prompt, so the linear part decides.
SUBJECTS = ["abstract_algebra", "marketing"]
LIMIT = 6
DATA = {"kind": "local", "path": str(MMLU_DIR)}
needs_mmlu = pytest.mark.skipif(not (MMLU_DIR / "dev").is_dir(), reason=f"no MMLU copy at {MMLU_DIR}")


def _randomize_mixing(model, seed: int = 0) -> None:
    """Mixing logits away from 0 and feature maps away from identity, so every part of the layer counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, HybridLlamaAttention):
                for p in (*mod.mixing.parameters(), *mod.feature_map.parameters()):
                    p.add_(torch.randn(p.shape, generator=g) * 0.5)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "hybrid_llama.lm_eval", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def _samples(out_dir: Path, task: str) -> list[dict]:
    files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"))
    assert len(files) == 1, files
    return sorted((json.loads(line) for line in files[0].read_text().splitlines()), key=lambda s: s["doc_id"])


@needs_mmlu
def test_cli_scores_the_exported_hybrid_as_the_pipeline_does(lively_dir, tmp_path):
    model, tok = load_model(lively_dir, dtype=torch.float32)
    convert_to_hybrid(model, [0, 1, 2, 3], window=8, formulation="lolcats", feature_map="hedgehog")
    _randomize_mixing(model)
    ckpt = save_hybrid(model, tmp_path / "model", tokenizer=tok)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    group = write_task_yamls(DATA, SUBJECTS, "mc", tasks)

    out = _cli("--model", "hf", "--model_args", f"pretrained={ckpt}", "--tasks", group, "--include_path",
               str(tasks), "--num_fewshot", "0", "--limit", str(LIMIT), "--batch_size", "4", "--device", "cpu",
               "--output_path", str(tmp_path / "out"), "--log_samples", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())

    # The pipeline's path, on the model as the pipeline loads it (a different process, another loader).
    loaded, tok2 = load_model(ckpt)
    ours = run_mmlu(loaded, tok2, data=DATA, shots=0, fmt="mc", limit=LIMIT, subjects=SUBJECTS, batch_size=4)
    # A plain Llama with the same weights: what a silent fallback to LlamaForCausalLM would score.
    plain, _ = load_model(lively_dir, dtype=torch.float32)
    softmax = run_mmlu(plain, tok, data=DATA, shots=0, fmt="mc", limit=LIMIT, subjects=SUBJECTS, batch_size=4)

    cli_lls, our_lls, plain_lls = [], [], []
    for subject in SUBJECTS:
        task = task_name("mc", subject)
        samples = _samples(tmp_path / "out", task)
        mine = [q for q in ours["questions"] if q["subject"] == subject]
        flat = [q for q in softmax["questions"] if q["subject"] == subject]
        assert [s["doc_id"] for s in samples] == [q["doc_id"] for q in mine] == list(range(LIMIT))
        for s, q, p in zip(samples, mine, flat):
            lls = [float(r[0]) for r in s["filtered_resps"]]
            assert LETTERS[int(s["target"])] == q["gold"]
            assert LETTERS[max(range(4), key=lls.__getitem__)] == q["pred"] and int(s["acc"]) == q["acc"]
            cli_lls += lls
            our_lls += q["loglikelihoods"]
            plain_lls += p["loglikelihoods"]
        assert results["results"][task]["acc,none"] == ours["per_subject"][subject]["acc"]
    assert results["results"][group]["acc,none"] == ours["aggregate"]["lm_eval_group_acc"]
    assert max(abs(a - b) for a, b in zip(cli_lls, our_lls)) < 1e-4
    # Meaningful: the questions' scores differ from each other, and from the plain Llama's by far more.
    assert len({round(x, 3) for x in our_lls}) > len(our_lls) // 2
    assert max(abs(a - b) for a, b in zip(our_lls, plain_lls)) > 0.05
