#!/usr/bin/env bash
# The GPU checks CI cannot run (no CI runner has a GPU): on a CUDA machine, from the repo root,
#   bash scripts/gpu_check.sh
# 1. tests/engine/test_runner_gpu.py: the GPU runner (Triton kernels, CUDA graphs) against CPU;
# 2. tests/engine/test_kernels.py + test_lora_kernel.py compiled on CUDA (KVGATE_TRITON_DEVICE=cuda);
# 3. bench/engine_gpu.py: decode tok/s and HBM bandwidth, 1b and 8b shapes (target >= 60% at batch 64);
# 4. bench/lora_kernel.py: the LoRA kernels against the grouped torch path;
# 5. the two kernel test files as CI runs them (TRITON_INTERPRET=1, CPU). Known: on the H200
#    image (triton 3.6, numpy 2.5.2) 28 of 40 fail inside Triton's interpreter ("only
#    0-dimensional arrays can be converted to Python scalars": its tensor __index__ calls int() on
#    a 1-element array, which numpy 2.5 refuses); CI's triton 3.9 squeezes first and passes.
# Needs no install: python3 with torch, triton, transformers, numpy, safetensors, tokenizers,
# pyyaml, pytest. kvgate is put on PYTHONPATH through a folder of links mapping the component
# folders into the `kvgate` namespace (what setup.py does). Wheels in .whl/ (git-ignored), if any,
# are installed into /tmp/site first, for a machine that cannot reach a package index.
# Output: everything to stdout, and gpu_check.log, summary.txt and the benches' JSON files into
# $OUT (or a fresh temp folder). Each step is bounded by `timeout`, and all of them together by
# GPU_CHECK_BUDGET_S (default 390 s): a step that would start past it is skipped, not run.
# Exit status: 0 when every step that ran passed; CUDA absent: the GPU steps skip or exit 2.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
: >"$LOG"
: >"$SUMMARY"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-390}))
FAILED=0

WORK=$(mktemp -d /tmp/gpu_check_src.XXXXXX)
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl || exit 1
fi
# kvgate.<name> -> <name>/ as setup.py maps it; -P below keeps the repo root (operator/) off sys.path.
mkdir -p "$WORK/src/kvgate"
for f in kvgate/*; do ln -s "$ROOT/$f" "$WORK/src/kvgate/"; done
for d in api engine epp operator; do ln -s "$ROOT/$d" "$WORK/src/kvgate/$d"; done
export PYTHONPATH="$WORK/src:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

# step NAME BOUND_S CMD...: runs CMD under timeout, logs it, records its status in summary.txt.
step() {
    local name=$1 bound=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    if ((left < 20)); then
        echo "SKIP $name: the ${GPU_CHECK_BUDGET_S:-390} s budget is spent" | tee -a "$SUMMARY" "$LOG"
        return
    fi
    ((bound > left)) && bound=$left
    local shown="$*"
    echo "=== $name (at most ${bound} s): ${shown:0:200}" | tee -a "$LOG"
    local t0=$SECONDS rc
    timeout -k 10 "$bound" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local verdict=ok
    if ((rc == 124 || rc == 137)); then verdict=TIMEOUT; elif ((rc != 0)); then verdict=FAILED; fi
    [[ $verdict == ok ]] || FAILED=1
    echo "$verdict $name rc=$rc $((SECONDS - t0)) s" | tee -a "$SUMMARY" "$LOG"
}

PYTEST=("$PY" -P -m pytest -q -rs --tb=short -p no:cacheprovider)
KERNEL_TESTS=(tests/engine/test_kernels.py tests/engine/test_lora_kernel.py)

INFO_PY='
import sys, torch, triton, transformers
import kvgate.engine
print("kvgate.engine from", kvgate.engine.__path__[0])
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
    # The copy ceiling to read the bandwidth figures against (bytes read + written / time).
    x = torch.empty(2**30, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    print(f"device-to-device copy: {2 * x.nbytes * 10 / (a.elapsed_time(b) / 1e3) / 1e12:.2f} TB/s")
else:
    print("no CUDA GPU")
'
if command -v nvidia-smi >/dev/null; then
    step nvidia_smi 30 nvidia-smi -L
    step nvidia_smi_query 30 nvidia-smi --format=csv \
        --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem
fi
step versions 60 "$PY" -P -c "$INFO_PY"
HAS_CUDA=$("$PY" -P -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# gpu_step: a step that needs CUDA; without it, recorded as skipped.
gpu_step() {
    if [[ $HAS_CUDA == 1 ]]; then
        step "$@"
    else
        echo "SKIP $1: no CUDA GPU" | tee -a "$SUMMARY" "$LOG"
    fi
}

step test_runner_gpu 150 "${PYTEST[@]}" tests/engine/test_runner_gpu.py
gpu_step kernels_compiled_cuda 120 env KVGATE_TRITON_DEVICE=cuda "${PYTEST[@]}" "${KERNEL_TESTS[@]}"
gpu_step engine_gpu_1b 90 "$PY" -P bench/engine_gpu.py --shape 1b --batches 1,16,64,256 --json "$OUT/engine_gpu_1b.json"
gpu_step engine_gpu_8b 120 "$PY" -P bench/engine_gpu.py --shape 8b --batches 1,16,64,256 --json "$OUT/engine_gpu_8b.json"
gpu_step lora_kernel 60 "$PY" -P bench/lora_kernel.py --json "$OUT/lora_kernel.json"
step kernels_interpreted_cpu 60 "${PYTEST[@]}" "${KERNEL_TESTS[@]}"

echo "--- summary ($SECONDS s; files in $OUT)"
cat "$SUMMARY"
rm -rf "$WORK"
exit "$FAILED"
