#!/usr/bin/env bash
# One device call of at most ~9 minutes (benchmarks/GPU_RUNBOOK.md): the CUDA tests, the quickstart at batch 64,
# and train_step.py on GPT-2, BERT and ResNet-50 in float16 in the five modes, each part under its own timeout so
# that one slow part cannot eat the others. Logs and results go to $OUT (the device tool brings it back).
#
#   bash benchmarks/gpu_run.sh                                   # on the device, from the checkout's root
#   PARTS="train" MODELS=bert bash benchmarks/gpu_run.sh         # a second call: what the first did not reach
#   # a dry run of the Python parts on a CPU (tiny models; the CUDA tests skip):
#   OUT=/tmp/dry PYTHON=python DEVICE=cpu RESULTS=/tmp/dry/RESULTS.md TRAIN_ARGS="--size tiny" \
#       QUICK_ARGS="--device cpu --epochs 1" T_TRAIN=900 bash benchmarks/gpu_run.sh
#
# Settings (environment): PARTS (default "info tests quickstart train"), MODELS (gpt2,resnet50,bert), MODES (the five),
# DTYPES (float16), STEPS (5), WARMUP (2), DEVICE (cuda), RESULTS (benchmarks/RESULTS.md, copied to $OUT),
# T_TESTS / T_QUICK / T_TRAIN (seconds per part: 180 / 50 / 290),
# T_CHILD (seconds per model and mode in train_step.py: 150), TRACES=1 (Chrome traces into $OUT/traces: large),
# TRAIN_ARGS / QUICK_ARGS (more arguments), PYTHON (python3), TAG (a suffix for this invocation's logs and
# copies, so that several invocations in one call keep theirs apart), TEST_WORKERS (pytest-xdist workers: 8).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_run_out}"
PYTHON="${PYTHON:-python3}"
PARTS="${PARTS:-info tests quickstart train}"
TAG="${TAG:-}"
MODELS="${MODELS:-gpt2,resnet50,bert}"
MODES="${MODES:-fp32,autocast,autocast+compile,graphamp,graphamp+compile}"
DTYPES="${DTYPES:-float16}"
DEVICE="${DEVICE:-cuda}"
RESULTS="${RESULTS:-benchmarks/RESULTS.md}"
STEPS="${STEPS:-5}" WARMUP="${WARMUP:-2}"
T_TESTS="${T_TESTS:-180}" T_QUICK="${T_QUICK:-50}" T_TRAIN="${T_TRAIN:-290}" T_CHILD="${T_CHILD:-150}"
mkdir -p "$OUT/logs"
started=$SECONDS

# The device image runs from the checkout (nothing is installed there); graphviz-pure, which it lacks, comes from
# .whl/ when the call carries it (benchmarks/fetch_gpu_wheels.sh): only tests/test_export.py needs it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # a part cut by its timeout still leaves what it printed in its log
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

part() {  # part NAME SECONDS COMMAND...: run under its own timeout, log to $OUT/logs/NAME.log, say how it ended
    local name=$1 seconds=$2
    shift 2
    echo "=== $name$TAG (at most ${seconds} s; $((SECONDS - started)) s in)"
    timeout -k 10 "$seconds" "$@" >"$OUT/logs/$name$TAG.log" 2>&1
    local rc=$?
    case $rc in
        0) echo "=== $name$TAG: done" ;;
        124|137) echo "=== $name$TAG: cut at ${seconds} s (timeout)" ;;
        *) echo "=== $name$TAG: failed (exit $rc)" ;;
    esac
    return 0
}

info() {  # the device, torch and the host CPU, into $OUT/logs/info$TAG.log
    {
        echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: none"
        "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
    'transformers', transformers.__version__, 'device', \
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
        lscpu | grep -i 'model name\|flags'
        for flag in avx512_bf16 amx_bf16 amx_tile; do
            grep -qw "$flag" /proc/cpuinfo && echo "host CPU has $flag" || echo "host CPU lacks $flag"
        done
        nproc
    } 2>&1 | tee "$OUT/logs/info$TAG.log"
}

for p in $PARTS; do
    case $p in
        info) info ;;
        tests)
            # test_cuda.py, and the CUDA tests of the other files (each has "cuda" in its name)
            part tests "$T_TESTS" "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs -n "${TEST_WORKERS:-8}" -k cuda \
                tests/test_cuda.py tests/test_compile_mode.py tests/test_decorate.py tests/test_loss_scaling.py \
                tests/test_in_graph_scaling.py
            tail -n 15 "$OUT/logs/tests$TAG.log" ;;
        quickstart)
            # FP32 vs autocast vs graphamp on the digits CNN, batch 64, fused AdamW.
            # shellcheck disable=SC2086
            part quickstart "$T_QUICK" "$PYTHON" examples/quickstart.py --batch-size 64 --fused ${QUICK_ARGS:-}
            tail -n 32 "$OUT/logs/quickstart$TAG.log" ;;
        train)
            # One child process per (model, mode); the RESULTS.md block is rewritten after each, so that a cut run
            # keeps what it measured.
            traces=()
            [ "${TRACES:-0}" = 1 ] && traces=(--trace-dir "$OUT/traces")
            # shellcheck disable=SC2086
            part train_step "$T_TRAIN" "$PYTHON" benchmarks/train_step.py --device "$DEVICE" --models "$MODELS" \
                --modes "$MODES" --dtypes "$DTYPES" --steps "$STEPS" --warmup "$WARMUP" --repeats 1 \
                --timeout "$T_CHILD" --fused --profile ${traces[@]+"${traces[@]}"} --results "$RESULTS" ${TRAIN_ARGS:-}
            [ -f "$RESULTS" ] && [ "$(realpath "$RESULTS")" != "$(realpath -m "$OUT/RESULTS$TAG.md")" ] \
                && cp "$RESULTS" "$OUT/RESULTS$TAG.md"
            # This run's blocks alone (without their raw JSON), also into the call's output.
            for dtype in ${DTYPES//,/ }; do
                sed -n "/<!-- benchmark: $DEVICE $dtype -->/,/<!-- end benchmark: $DEVICE $dtype -->/p" "$RESULTS"
            done | sed '/<details>/,/<\/details>/d' | tee "$OUT/train_step_block$TAG.md"
            grep -i "error\|Traceback" "$OUT/logs/train_step$TAG.log" | tail -n 10 ;;
        *) echo "unknown part $p (info, tests, quickstart, train)" ;;
    esac
done
echo "=== all parts: $((SECONDS - started)) s; logs in $OUT/logs"
