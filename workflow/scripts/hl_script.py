"""The shared start of every workflow script (Snakemake puts workflow/scripts on sys.path).

- puts the repository's src/ first on sys.path, so the rules' conda envs (which hold only the
  dependencies) run this checkout's hybrid_llama;
- sends stdout, stderr and logging to the rule's log file;
- caps torch's threads at the job's `threads`;
- fails with a clear message when a CUDA device is asked for but there is none.
"""

import hashlib
import logging
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def start(snakemake, *, torch_threads: bool = True):
    """Redirect output to snakemake.log[0]; return the log file."""
    log = open(snakemake.log[0], "w", buffering=1)
    sys.stdout = sys.stderr = log
    logging.basicConfig(
        stream=log, level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True
    )
    logging.info("rule %s, wildcards %s", snakemake.rule, dict(snakemake.wildcards))
    if torch_threads:
        import torch

        torch.set_num_threads(max(1, int(snakemake.threads)))
    return log


def require_device(device: str) -> str:
    """The torch device for a config/wildcard device; raise if it names CUDA and there is none.

    Devices may carry a label for the cluster profile ('cuda-h100', 'cuda:1-a100'): the torch
    device is the part before '-'. Inside a SLURM job only the allocated GPU is visible (as
    cuda:0), so there any 'cuda:N' runs on the one GPU torch sees.
    """
    import os

    device = str(device).split("-", 1)[0]
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device '{device}' was requested (config 'devices' or a 'device' key) but "
                f"torch.cuda.is_available() is False on this host; run on a GPU node or use 'cpu'"
            )
        index = int(device.split(":")[1]) if ":" in device else 0
        count = torch.cuda.device_count()
        if os.environ.get("SLURM_JOB_ID") and count == 1:
            return "cuda:0"
        if index >= count:
            raise RuntimeError(f"device '{device}' was requested but only {count} CUDA device(s) exist")
    return device


def sha256_file(path) -> str:
    from hybrid_llama.weights import sha256_of

    return sha256_of(path)


def model_dir(snakemake) -> Path:
    """The resolved weights directory (the rule's `weights` input is its config.json)."""
    return Path(snakemake.input.weights).parent


def load_stage_model(snakemake, *, device: str, dtype=None):
    """(model, tokenizer, meta) of the stage named by the job's wildcards."""
    from hybrid_llama.stages import load_stage

    w = snakemake.wildcards
    device = require_device(device)
    layers = getattr(snakemake.input, "layers", None)
    adapter = getattr(snakemake.input, "adapter", None)
    adapter_dir = str(Path(adapter).parent) if adapter else None
    model, tokenizer = load_stage(
        model_dir(snakemake),
        w.stage,
        hybrid=snakemake.params.hybrid,
        hybrid_layers=layers,
        adapter=adapter_dir,
        dtype=dtype,
        device=device,
    )
    meta = {
        "model": w.model,
        "variant": w.variant,
        "stage": w.stage,
        # the requested device (wildcard or config, label included); results also record the real one
        "device": getattr(w, "device", None),
        "hybrid": snakemake.params.hybrid,
        "model_hash": _weights_hash(model_dir(snakemake)),
        "layers_hash": sha256_file(layers) if layers else None,
        "adapter_hash": sha256_file(adapter) if adapter else None,
    }
    return model, tokenizer, meta, device


def _weights_hash(directory: Path) -> str:
    """sha256 of the weights (from the weights rule's hashes.json): the file's, or for shards the
    sha256 of their sorted {name: sha256} JSON."""
    import json

    hashes = json.loads((Path(directory) / "hashes.json").read_text())
    if list(hashes) == ["model.safetensors"]:
        return hashes["model.safetensors"]
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()
