#!/usr/bin/env bash
# Create ./.venv and install hybrid-llama with everything the workflow and the tests need.
#   TORCH_SPEC   pip spec for torch when none is importable (default: torch==2.13.0 triton==3.7.1)
#   PYTHON       interpreter for the venv (default: python3)
#   VENV_ARGS    extra args to `python -m venv`, e.g. --system-site-packages to reuse a GPU box's torch
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv ${VENV_ARGS:-} .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
# Keep a torch that is already there (a CUDA build on a GPU box); otherwise take the pinned CPU build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086
    "${pip[@]}" ${TORCH_SPEC:-torch==2.13.0 triton==3.7.1}
fi
"${pip[@]}" -e '.[test]'
.venv/bin/python -c "import hybrid_llama, torch, transformers; print('hybrid-llama ready: torch', torch.__version__, 'transformers', transformers.__version__)"
