"""The linter configured in pyproject.toml ([tool.ruff]) passes on every Python file we ship."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "workflow", "benchmarks"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_catches_an_unused_import(tmp_path):
    """The check above can fail: the same configuration flags a planted defect."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 1 and "F401" in proc.stdout
