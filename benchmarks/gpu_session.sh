#!/usr/bin/env bash
# Every GPU measurement the project wants, in one call that fits a 15-minute GPU lease: the GPU
# tests, the layer benchmark and the model-level benchmark, then the remaining triton tests. Each
# step has its own cap (TESTS_S / LAYER_S / MODEL_S / REST_S seconds) and a failing step does not
# stop the next. Runs from the repo root with the machine's own python3 (torch, triton,
# transformers, peft, pandas, safetensors, tokenizers, pytest preinstalled; nothing is installed).
# Writes logs, JSON and the model CSV to $OUT (default results/gpu/); copy the numbers into
# docs/triton.md with the device line from versions.txt.
#
#   bash benchmarks/gpu_session.sh                       # tests, layer, model: 8 minutes at most
#   STEPS="rest" REST_S=300 bash benchmarks/gpu_session.sh   # the small-shape tests as well
# On a fresh H200 (2026-11-27) the steps took about 120 / 26 / 150 s, most of it triton's first
# compiles; the small-shape tests ("rest") compile a kernel per shape and need over 210 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
STEPS=${STEPS:-"tests layer model"}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
    "$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__,
"transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/versions.txt"

status=0
run() {  # run <step> <log name> <seconds> <command...>: tee the output, remember a failure
    local step=$1 log=$2 limit=$3 t0=$SECONDS
    shift 3
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    echo "== step $step exited $rc after $((SECONDS - t0)) s (cap $limit s)" | tee -a "$OUT/versions.txt"
    [ "$rc" -eq 0 ] || status=$rc
}
pytest_args=(-q -p no:cacheprovider -rfE tests/test_triton.py)
for step in $STEPS; do
    case $step in
    tests) # the @pytest.mark.gpu tests: bf16 at T=4096 and 32768, fp32 grads, decode, Hedgehog pair
        run tests gpu_tests.log "${TESTS_S:-170}" "$PY" -m pytest "${pytest_args[@]}" -m gpu ;;
    layer) # B=1, H=32/8, D=64, bf16, T=2^10..2^15, fwd and fwd+bwd; decode at batch 1 and 64
        run layer bench_triton.txt "${LAYER_S:-90}" "$PY" benchmarks/bench_triton.py \
            --impls triton,triton_hedgehog,chunked,sdpa --json "$OUT/bench_triton.json" ;;
    model) # Llama-3.2-1B architecture, 8 of 16 layers lolcats (Hedgehog, triton): prefill 1 to 32K,
           # decode at batch 16 with 32K of context; 2 repeats keep it inside its cap on a cold machine
        run model bench_model.txt "${MODEL_S:-210}" "$PY" benchmarks/bench_model.py \
            --formulation lolcats --feature-map hedgehog --backends triton \
            --prefill-lens 1,64,1024,4096,8192,16384,32768 --repeats 2 --decode-tokens 16 \
            --json "$OUT/bench_model.json" --csv "$OUT/throughput_gpu.csv" ;;
    rest) # the interpreter-sized tests, compiled for the GPU
        run rest rest_tests.log "${REST_S:-300}" "$PY" -m pytest "${pytest_args[@]}" -m "not gpu" ;;
    *) echo "unknown step $step (want tests, layer, model, rest)"; status=2 ;;
    esac
done
exit $status
