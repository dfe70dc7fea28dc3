"""Resolve a model spec to resources/weights/{model}/ (config.json, model.safetensors, tokenizer)."""

import json
import shutil
from pathlib import Path

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.files import atomic_write, sha256_of
from hybrid_llama.weights import resolve_model

dest = Path(snakemake.output.config).parent
# resolve_model refuses a directory made from another spec: a rerun (spec changed) starts clean.
shutil.rmtree(dest, ignore_errors=True)
dest = resolve_model(dict(snakemake.params.spec), dest)
hashes = {p.name: sha256_of(p) for p in sorted(Path(dest).glob("*.safetensors"))}
atomic_write(Path(dest, "hashes.json"), json.dumps(hashes, indent=1) + "\n")
print(json.dumps({"dest": str(dest), "sha256": hashes}, indent=1))
