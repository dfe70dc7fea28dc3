"""Write config/paper.yaml's DAG with a tiny random Llama in place of Llama-3.2-1B, for the CPU.

config/paper.yaml needs the gated Llama-3.2-1B, the Hub's data and a GPU. This keeps its shape
(every variant and stage, MMLU 0/5-shot in both formats, the zero-shot suite, every long-context
slot at every length, every throughput backend the device has) and shrinks what makes it
expensive: a random Llama of 16 layers (paper.yaml's layer indices stay valid) and 4,096
positions, local data, a few steps of training, 2 trials or windows a cell, lengths cut to the
tiny model's positions. It checks that the published recipe's rules and their combinations run
end to end; its numbers mean nothing.

    python benchmarks/paper_dag_tiny.py > /tmp/paper_tiny.yaml
    .venv/bin/snakemake --cores all results/report.html --configfile /tmp/paper_tiny.yaml \\
        --replace-workflow-config
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
POSITIONS = 4096  # the tiny preset's


def tiny_paper_config(paper: dict) -> dict:
    """paper.yaml's config with the model, data sources, budgets and lengths shrunk for a CPU."""
    c = copy.deepcopy(paper)
    c["models"] = [{"name": "tiny16", "kind": "random", "preset": "tiny", "seed": 0, "num_hidden_layers": 16}]
    for key in ("transfer", "instruct", "mmlu", "books"):
        c["data"][key]["source"] = "local"
    c["data"]["instruct"].update(max_examples=24, max_length=96)
    for v in c["variants"]:
        for section in ("transfer", "lora"):
            if "max_position" in v.get(section, {}):
                v[section]["max_position"] = POSITIONS
        if v.get("lora", {}).get("recall_seq_len"):
            # the random tokenizer spends a token a byte: 8 facts and their questions need ~1K tokens
            v["lora"]["recall_seq_len"] = POSITIONS
    # rows longer than the 64-token window, or the linear part gets no gradient (a config error)
    c["transfer"].update(seq_len=128, num_tokens=4096, max_steps=4, eval_sequences=2, device="cpu",
                         autocast=False, checkpoint_every=0)
    c["lora"].update(batch_size=4, max_steps=3, device="cpu", autocast=False, checkpoint_every=0)
    c["devices"] = ["cpu"]
    c["threads"] = {"train": 1, "eval": 1, "throughput": 1}
    c["mmlu"].update(subjects=["marketing", "sociology"], limit=2, batch_size=4, dtype="float32")
    c["zeroshot"].update(limit=2, batch_size=4, dtype="float32")
    q = c["quality"]
    q["dtype"] = "float32"
    q["perplexity"].update(context_lens=[16, 32, 64, POSITIONS], max_windows=2, n_docs=4, tail=8)
    q["passkey"].update(context_lens=[256, 512, 1024, POSITIONS], trials=2, generate_trials=1)
    q["long_context"]["books"].update(context_lens=[16, 64, 1024, POSITIONS], tail=8, max_windows=2)
    q["long_context"]["niah"].update(context_lens=[512, 1024, POSITIONS], trials=2)
    c["throughput"].update(seq_lens=[1, 2, 4, 8, 16, 32, POSITIONS], decode_tokens=2, repeats=1, warmup=0)
    c["throughput"]["long"].update(repeats=1)
    c["generations"] = {"prompts": ["The capital of France is"], "max_new_tokens": 4, "device": "cpu"}
    c["retrieval_heads"] = {"context_len": 256, "trials": 2}
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paper", type=Path, default=REPO / "config" / "paper.yaml")
    args = ap.parse_args()
    yaml.safe_dump(tiny_paper_config(yaml.safe_load(args.paper.read_text())), sys.stdout, sort_keys=False)


if __name__ == "__main__":
    main()
