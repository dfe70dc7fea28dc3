"""Where a report came from: the git commit, the packages' versions, the jobs' benchmark files and the
training corpora's manifests."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from hybrid_llama.eval.tables import read_rows
from hybrid_llama.report.results import num

PACKAGES = ["hybrid-llama", "torch", "transformers", "peft", "lm_eval", "triton", "snakemake",
            "safetensors", "tokenizers", "datasets", "numpy", "pandas", "matplotlib", "jinja2"]


def git_info(repo: str | Path) -> dict:
    def run(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20,
                                 check=False)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = run("rev-parse", "HEAD")
    dirty = run("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit or "unknown (not a git checkout, or no commit yet)",
        "short": commit[:12] if commit else "unknown",
        "dirty": bool(dirty),
    }


def package_versions() -> list[dict]:
    out = []
    for name in PACKAGES:
        try:
            out.append({"name": name, "version": metadata.version(name)})
        except metadata.PackageNotFoundError:
            out.append({"name": name, "version": "not installed"})
    out.append({"name": "python", "version": platform.python_version()})
    return out


def benchmark_rows(directory) -> list[dict]:
    """Wall time and peak RSS of every job from Snakemake's benchmark: files."""
    directory = Path(directory)
    rows = []
    for path in sorted(directory.rglob("*.tsv")) if directory.is_dir() else []:
        data = read_rows(path, {}, delimiter="\t")
        if data:
            rows.append({"job": str(path.relative_to(directory).with_suffix("")),
                         "s": num(data[-1].get("s")), "max_rss_mb": num(data[-1].get("max_rss"))})
    return rows


def manifest_summary(path) -> dict:
    """A manifest without its long per-document hash list and per-row lists (the counts stay)."""
    data = json.loads(Path(path).read_text())
    rows = "rows' book and facts" if data.get("kind") == "recall_rows" else "rows' book and token offset"
    counted = {"doc_hashes": "document sha256 hashes", "rows": rows, "row_parts": "rows' part and row"}
    items = {k: (f"{len(v)} {counted[k]}" if k in counted else v) for k, v in data.items()}
    return {"path": str(path), "items": items}
