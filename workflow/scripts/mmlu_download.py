"""Download MMLU from Hugging Face into the mirror's layout: {dev,test}/<subject>_{split}.csv."""

import csv
import json
from pathlib import Path

from common import start

start(snakemake, torch_threads=False)

import datasets

from hybrid_llama.files import sha256_of

root = Path(snakemake.output.manifest).parent
counts = {}
for split in ("dev", "test"):
    # Streamed per split: the "all" config also holds auxiliary_train (~100k rows), never used here.
    rows_by_subject = {}
    for row in datasets.load_dataset(snakemake.params.id, "all", split=split, streaming=True):
        rows_by_subject.setdefault(row["subject"], []).append(row)
    (root / split).mkdir(parents=True, exist_ok=True)
    for subject, rows in sorted(rows_by_subject.items()):
        with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
            for r in rows:
                writer.writerow([r["question"], *r["choices"], r["answer"]])
    counts[split] = sum(len(r) for r in rows_by_subject.values())
files = {str(p.relative_to(root)): sha256_of(p) for p in sorted(root.glob("*/*.csv"))}
manifest = {"source": {"kind": "hf", "id": snakemake.params.id}, "rows": counts, "files": files}
Path(snakemake.output.manifest).write_text(json.dumps(manifest, indent=1) + "\n")
