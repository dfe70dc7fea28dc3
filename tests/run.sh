#!/usr/bin/env bash
# The whole test suite, as CI runs it. Assumes ./setup.sh has been run.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
export PYTHONUNBUFFERED=1
# Much of the suite reads the offline data mirror; without it, stop here with the reason instead of
# a scatter of failures deep in the run.
data=$("$py" -c 'import sys; from hybrid_llama.pipeline import shared_data_dir; print(shared_data_dir(repo=sys.argv[1]))' "$PWD")
if [ ! -d "$data" ]; then
    echo "tests/run.sh: the offline data mirror $data does not exist; put shared/data beside the" \
         "checkout (../shared/data) or point HYBRID_LLAMA_SHARED_DATA at it" >&2
    exit 2
fi
# The report test renders in headless Chromium; install it where we may (CI runs as root).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) >/dev/null 2>&1 ||
        echo "note: could not install chromium; the report screenshot test will be skipped"
fi
# Triton kernels run under the interpreter; TRITON_INTERPRET must be set before triton is first
# imported, so they get a process of their own.
TRITON_INTERPRET=1 "$py" -m pytest -q tests/test_triton.py
# Everything else, slow end-to-end and SLURM checks included (GPU-only tests skip themselves).
"$py" -m pytest -q --ignore=tests/test_triton.py "$@"
