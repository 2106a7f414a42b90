#!/usr/bin/env bash
# One-shot GPU benchmark (one H200, under 10 minutes, installs nothing).
#
#   PYTHONPATH=. bash benchmarks/gpu.sh              # on the GPU machine
#   PYTHONPATH=. bash benchmarks/gpu.sh --cpu-smoke  # tiny sizes on CPU: every code path
#   bash benchmarks/gpu.sh --dry-run                 # print the GPU commands, run none
#   PYTHONPATH=. bash benchmarks/gpu.sh --vllm       # vLLM on CUDA (below)
#
# --vllm (needs the vllm extra, `pip install -e '.[vllm]'`, and the hub for the
# profiles' models and GSM8K, or HF_HUB_OFFLINE=1 over a filled cache): runs
# tests/vllm_cpu against vLLM's CUDA engine (the same tests CI runs on its CPU build),
# then `grpo-lab train` with the small-gpu and the gpu profile for 3 GRPO steps
# each (GPU_PROFILE_FLAGS adds flags to both), timed from their metrics; about 5
# minutes on one H100.
#
# The small-gpu cases train a randomly initialised model of Qwen2.5-0.5B's
# published config (no weights needed) as the small-gpu profile does on a 16 GB
# T4: float32 weights under float16 autocast with a dynamic loss scale, gradient
# checkpointing, a chunked head, microbatches of 2 sequences of 576 tokens, 64
# rollouts of 384 new tokens, once with full fine-tuning and once with rank-1
# LoRA, each under a 15 GiB cap (torch.cuda.set_per_process_memory_fraction).
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
DRY_RUN=0
VLLM=0
if [ "${1:-}" = "--cpu-smoke" ]; then
    SMOKE=1
elif [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
elif [ "${1:-}" = "--vllm" ]; then
    VLLM=1
fi
if [ $SMOKE -eq 0 ] && [ $DRY_RUN -eq 0 ] \
    && ! "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "no CUDA GPU visible to $PYTHON (torch.cuda.is_available() is False):" \
        "run this on the GPU machine, or use --cpu-smoke or --dry-run here" >&2
    exit 2
fi
if [ $VLLM -eq 1 ] && ! "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
    echo "--vllm needs vLLM in $PYTHON: pip install -e '.[vllm]'" >&2
    exit 2
fi

status=0
run() {  # run NAME TIMEOUT_SECONDS COMMAND...: log to $OUT_DIR/NAME.log, keep going
    local name=$1 limit=$2
    shift 2
    if [ $DRY_RUN -eq 1 ]; then
        echo "$name $limit $*"
        return
    fi
    echo "== $name: $*" | tee -a "$OUT_DIR/commands.txt"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local code=$?
    echo "== $name: exit $code after $((SECONDS - start)) s" | tee -a "$OUT_DIR/commands.txt"
    tail -n 25 "$OUT_DIR/$name.log"
    [ $code -eq 0 ] || status=1
}

if [ $DRY_RUN -eq 0 ]; then {
    date -u
    uptime
    nproc
    grep -m1 "model name" /proc/cpuinfo
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
    "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} >"$OUT_DIR/machine.txt" 2>&1
cat "$OUT_DIR/machine.txt"
fi

# The small-gpu profile's step on a T4 (see the top of this file), then its method.
SMALL_GPU=(--shape Qwen2.5-0.5B --dtype float32 --autocast float16
    --gradient-checkpointing --memory-cap-gib 15 --batch-size 32 --microbatch-size 2
    --seq-len 576 --prompt-len 192 --chunk-size 256 --rollout-batch 64
    --rollout-prompt-len 192 --new-tokens 384)
SMALL_GPU_SMOKE=(--quick --dtype float32 --autocast float16 --gradient-checkpointing
    --memory-cap-gib 15)

if [ $VLLM -eq 1 ]; then
    run vllm_tests 300 env GRPO_LAB_VLLM_TESTS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        GRPO_LAB_VLLM_DEVICE=cuda "$PYTHON" -m pytest -p no:cacheprovider \
        --durations=10 tests/vllm_cpu
    for profile in small-gpu gpu; do
        rm -rf "$OUT_DIR/run_$profile"
        # shellcheck disable=SC2086  # GPU_PROFILE_FLAGS is a list of flags
        run "profile_$profile" 300 "$PYTHON" -m grpo_lab.cli train --profile "$profile" \
            --steps 3 --eval-every 0 --checkpoint-every 0 --no-progress \
            --run-dir "$OUT_DIR/run_$profile" ${GPU_PROFILE_FLAGS:-}
        "$PYTHON" - "$OUT_DIR/run_$profile/metrics.jsonl" <<'PY' \
            | tee -a "$OUT_DIR/commands.txt"
import json, sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError as error:
    sys.exit(f"no metrics: {error}")
steps = [json.loads(line) for line in lines]
seconds = [r["time/step_seconds"] for r in steps if "time/step_seconds" in r]
print(sys.argv[1], "GRPO step seconds:", [round(s, 1) for s in seconds])
PY
    done
    exit $status
elif [ $SMOKE -eq 1 ]; then
    run logprob_memory 300 "$PYTHON" benchmarks/logprob_memory.py --quick --in-process \
        --out "$OUT_DIR/logprob_memory_gpu.json"
    run gpu_throughput 300 "$PYTHON" benchmarks/gpu_throughput.py --quick \
        --out "$OUT_DIR/gpu_throughput.json"
    for method in full lora; do
        run "gpu_throughput_small_gpu_$method" 300 "$PYTHON" benchmarks/gpu_throughput.py \
            "${SMALL_GPU_SMOKE[@]}" --method "$method" \
            --out "$OUT_DIR/gpu_throughput_small_gpu_$method.json"
    done
else
    # Qwen2's head: vocabulary 151,936, B=4 sequences of 1024 and 4096 tokens,
    # bfloat16, head frozen and trainable (24 cases, one process).
    run logprob_memory 180 "$PYTHON" benchmarks/logprob_memory.py --device cuda \
        --dtype bfloat16 --in-process --batch-size 4 --vocab-sizes 151936 \
        --seq-lens 1024 4096 --heads frozen trainable \
        --chunk-sizes 256 512 1024 2048 --out "$OUT_DIR/logprob_memory_gpu.json"
    run gpu_throughput 200 "$PYTHON" benchmarks/gpu_throughput.py --device cuda \
        --out "$OUT_DIR/gpu_throughput.json"
    for method in full lora; do
        run "gpu_throughput_small_gpu_$method" 150 "$PYTHON" benchmarks/gpu_throughput.py \
            --device cuda "${SMALL_GPU[@]}" --method "$method" --lora-rank 1 \
            --out "$OUT_DIR/gpu_throughput_small_gpu_$method.json"
    done
fi

[ $DRY_RUN -eq 1 ] && exit 0
run render 60 "$PYTHON" benchmarks/render_results.py "$OUT_DIR" --bare \
    --out "$OUT_DIR/GPU_RESULTS.md"
exit $status
