#!/usr/bin/env bash
# One-shot GPU benchmark (one H200, under 8 minutes, installs nothing).
#
#   PYTHONPATH=. bash benchmarks/gpu.sh              # on the GPU machine
#   PYTHONPATH=. bash benchmarks/gpu.sh --cpu-smoke  # tiny sizes on CPU: every code path
#
# Writes result files and logs to $OUT if set, else benchmarks/out/gpu, and
# renders them into $OUT/GPU_RESULTS.md. To publish them, copy the JSON files
# into benchmarks/results/ and run benchmarks/render_results.py.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
# The first interpreter (or $PYTHON, if set) that imports torch and transformers.
PYTHON_FOUND=""
for candidate in ${PYTHON:-python python3 .venv/bin/python}; do
    if "$candidate" -c "import torch, transformers" >/dev/null 2>&1; then
        PYTHON_FOUND=$candidate
        break
    fi
done
if [ -z "$PYTHON_FOUND" ]; then
    echo "no python that imports torch and transformers (set PYTHON=...)" >&2
    exit 2
fi
PYTHON=$PYTHON_FOUND
OUT_DIR="${OUT:-benchmarks/out/gpu}"
mkdir -p "$OUT_DIR"

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then
    SMOKE=1
fi

status=0
run() {  # run NAME TIMEOUT_SECONDS COMMAND...: log to $OUT_DIR/NAME.log, keep going
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$OUT_DIR/commands.txt"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local code=$?
    echo "== $name: exit $code after $((SECONDS - start)) s" | tee -a "$OUT_DIR/commands.txt"
    tail -n 25 "$OUT_DIR/$name.log"
    [ $code -eq 0 ] || status=1
}

{
    date -u
    uptime
    nproc
    grep -m1 "model name" /proc/cpuinfo
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} >"$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"

if [ $SMOKE -eq 1 ]; then
    run logprob_memory 300 "$PYTHON" benchmarks/logprob_memory.py --quick --in-process \
        --out "$OUT_DIR/logprob_memory_gpu.json"
    run gpu_throughput 300 "$PYTHON" benchmarks/gpu_throughput.py --quick \
        --out "$OUT_DIR/gpu_throughput.json"
else
    # Qwen2's head: vocabulary 151,936, B=4 sequences of 1024 and 4096 tokens,
    # bfloat16, head frozen and trainable (24 cases, one process).
    run logprob_memory 180 "$PYTHON" benchmarks/logprob_memory.py --device cuda \
        --dtype bfloat16 --in-process --batch-size 4 --vocab-sizes 151936 \
        --seq-lens 1024 4096 --heads frozen trainable \
        --chunk-sizes 256 512 1024 2048 --out "$OUT_DIR/logprob_memory_gpu.json"
    run gpu_throughput 200 "$PYTHON" benchmarks/gpu_throughput.py --device cuda \
        --out "$OUT_DIR/gpu_throughput.json"
fi

run render 60 "$PYTHON" benchmarks/render_results.py "$OUT_DIR" --bare \
    --out "$OUT_DIR/GPU_RESULTS.md"
exit $status
