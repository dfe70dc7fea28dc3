#!/usr/bin/env bash
# Every GPU measurement the project wants, in calls that fit a 15-minute GPU lease: the GPU tests, the
# default run's recipe on its model's architecture, the layer benchmark, then the smaller triton tests.
# Each step has its own cap (TESTS_S / SPARSE_S / MODEL_S / LAYER_S / DECAY_S / MODEL1B_S / REST_S s) and a
# failing step does not stop the next. Runs from the repo root with the machine's own python3 (torch,
# triton, transformers, peft, pandas, safetensors, tokenizers, pytest preinstalled; nothing is
# installed). tests/test_gpu.py trains on fineweb-edu rows: point HYBRID_LLAMA_SHARED_DATA at a copy
# of shared/data's fineweb-edu folder that travels with the call. Writes logs, JSON and the model CSVs
# to $OUT (default results/gpu/); copy the numbers into docs/triton.md with the device line from
# versions.txt.
#
#   bash benchmarks/gpu_session.sh                          # tests, sparse, model (docs/triton.md)
#   STEPS="layer decay" bash benchmarks/gpu_session.sh      # the layer benchmark, the decay's small tests
#   STEPS="model1b rest" bash benchmarks/gpu_session.sh     # Llama-3.2-1B's architecture; all small tests
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
STEPS=${STEPS:-"tests sparse model"}
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
    tests) # the @pytest.mark.gpu tests: kernels in bf16 at T=4096 and 32768 (with and without the decay),
           # fp32 grads, decode, Hedgehog pair; the recipe's model and both training stages against the CPU
        run tests gpu_tests.log "${TESTS_S:-240}" "$PY" -m pytest "${pytest_args[@]}" tests/test_gpu.py -m gpu ;;
    sparse) # the sparse cache's eviction plan: its interpreter-sized tests, compiled for the GPU
        run sparse sparse_tests.log "${SPARSE_S:-120}" "$PY" -m pytest "${pytest_args[@]}" -m "not gpu" -k sparse ;;
    model) # the default run's recommended variant (lolcats_retrieval) on SmolLM2-135M's architecture with
           # random weights: without (hybrid_triton) and with (sparse_triton) its sparse cache; prefill to
           # 8192 (its positions), decode at batch 16 with 8192 tokens of context
        run model bench_model.txt "${MODEL_S:-200}" "$PY" benchmarks/bench_model.py --preset smollm2-135m \
            --layers 0,1,2,6,8,10,11,13,14,16,18,20,22,24,29 --formulation lolcats --feature-map hedgehog \
            --hybrid '{"decay": 0.9995, "softmax_heads": [[18, 2], [20, 1]]}' --sparse-cache 128 --sinks 4 \
            --backends triton --prefill-lens 1,64,1024,4096,8192 --repeats 2 --decode-context 8192 \
            --decode-tokens 16 --json "$OUT/bench_model.json" --csv "$OUT/throughput_gpu.csv" ;;
    layer) # B=1, H=32/8, D=64, bf16, T=2^10..2^15, fwd and fwd+bwd, with the decay and the recipe's layer;
           # decode at batch 1 and 64
        run layer bench_triton.txt "${LAYER_S:-120}" "$PY" benchmarks/bench_triton.py \
            --impls triton,triton_decay,triton_hedgehog,triton_recipe,sdpa --json "$OUT/bench_triton.json" ;;
    decay) # the decaying state's interpreter-sized tests, compiled for the GPU
        run decay decay_tests.log "${DECAY_S:-120}" "$PY" -m pytest "${pytest_args[@]}" -m "not gpu" -k decay ;;
    model1b) # Llama-3.2-1B architecture, 8 of 16 layers lolcats (Hedgehog, triton): prefill 1 to 32K,
             # decode at batch 16 with 32K of context (the 2026-11-27 run's model step)
        run model1b bench_model_1b.txt "${MODEL1B_S:-210}" "$PY" benchmarks/bench_model.py \
            --formulation lolcats --feature-map hedgehog --backends triton \
            --prefill-lens 1,64,1024,4096,8192,16384,32768 --repeats 2 --decode-tokens 16 \
            --json "$OUT/bench_model_1b.json" --csv "$OUT/throughput_gpu_1b.csv" ;;
    rest) # the interpreter-sized tests, compiled for the GPU
        run rest rest_tests.log "${REST_S:-300}" "$PY" -m pytest "${pytest_args[@]}" -m "not gpu" ;;
    *) echo "unknown step $step (want tests, sparse, model, layer, decay, model1b, rest)"; status=2 ;;
    esac
done
exit $status
