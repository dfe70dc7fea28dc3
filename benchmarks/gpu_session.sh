#!/usr/bin/env bash
# Every GPU measurement the project wants: the GPU tests, the layer benchmark and the model-level
# benchmark. Each step is capped (240 / 300 / 300 s); where one command may run at most 10 minutes
# (the project's device tool), run the steps in separate calls: STEPS=tests, STEPS=layer, STEPS=model. Runs from the repo root with the machine's own
# python3 (torch, triton, transformers, peft, pandas, safetensors, tokenizers, pytest preinstalled;
# nothing is installed). Writes logs and JSON to $OUT (default results/gpu/), then copy the numbers
# into docs/triton.md with the device name printed in versions.txt.
#
#   bash benchmarks/gpu_session.sh                 # everything
#   STEPS="tests layer" bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
STEPS=${STEPS:-"tests layer model"}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    "$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/versions.txt"

status=0
run() {  # run <step> <log name> <seconds> <command...>: tee the output, remember a failure
    local step=$1 log=$2 limit=$3
    shift 3
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    echo "== step $step exited $rc" | tee -a "$OUT/versions.txt"
    [ "$rc" -eq 0 ] || status=$rc
}
for step in $STEPS; do
    case $step in
    tests) # every @pytest.mark.gpu test plus the model-level triton test, on the GPU
        run tests gpu_tests.log 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton.py ;;
    layer) # B=1, H=32/8, D=64, bf16, T=2^10..2^15, fwd and fwd+bwd; decode at batch 1 and 64
        run layer bench_triton.txt 300 "$PY" benchmarks/bench_triton.py --json "$OUT/bench_triton.json" ;;
    model) # Llama-3.2-1B architecture, 8 of 16 layers hybrid: prefill to 32K, decode batch 16 at 32K
        run model bench_model.txt 300 "$PY" benchmarks/bench_model.py --json "$OUT/bench_model.json" ;;
    *) echo "unknown step $step (want tests, layer, model)"; status=2 ;;
    esac
done
exit $status
