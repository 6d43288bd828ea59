#!/usr/bin/env bash
# One call on the lent H100 (2026-11-26, after the calibration session): where ZeRO-1/2's optimizer
# step puts its new tensors. The 1B memory cases of benchmarks/gpu/cases.py run as they did for
# their records, with the probe benchmarks/gpu/stepmem/sitecustomize.py loaded into each stage
# process (STEPMEM_OUT): the allocator's figures at each phase of the first three optimizer
# steps, the layout of its segments, and its history through step 2. Run from the project root
# on the GPU machine with .gpu-wheels/ beside it and OUT set to a folder that comes back:
#
#   OUT=/some/dir bash benchmarks/gpu/stepmem_session.sh
#
# Everything small goes into OUT/results.tgz (re-packed after each step). The whole stays within
# SESSION_LIMIT_S (default 330 s) of wall time.
# For trying it on a CPU first:
#   SESSION_ENV_SH=my-env.sh SESSION_DEVICE=cpu SESSION_BENCH_ARGS="--shape tiny" STEPMEM_FAKE=1 OUT=... bash ...
set -u -o pipefail

OUT=${OUT:?set OUT to the folder that comes back}
LIMIT_S=${SESSION_LIMIT_S:-330}
CASES=${SESSION_CASES:-env,mem-sft-mb2,mem-sft-mb8,mem-sft-nockpt,mem-dpo-live,mem-sft-z2,mem-dpo-precompute}
ENV_SH=${SESSION_ENV_SH:-.gpu-wheels/env.sh}
DEVICE=${SESSION_DEVICE:-cuda}
BENCH_ARGS=${SESSION_BENCH_ARGS:-}
W=$(mktemp -d /tmp/stepmem-session.XXXX)
BENCH_WORK=${SESSION_WORK:-/tmp/stepmem-bench-work}
START=$(date +%s)
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/session.log") 2>&1

elapsed() { echo $(( $(date +%s) - START )); }
pack() { tar czf "$OUT/results.tgz.tmp" -C "$W" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }

echo "=== [$(elapsed) s] environment"
echo "project commit: $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$W/nvidia-smi.txt"
# shellcheck disable=SC1091
. "$ENV_SH" || { echo "$ENV_SH failed"; pack; exit 1; }
export TORCH_CUDA_ARCH_LIST=9.0
export STEPMEM_OUT="$W/stepmem" PYTHONPATH="$PWD/benchmarks/gpu/stepmem:$PYTHONPATH"
mkdir -p "$STEPMEM_OUT"

BUDGET=$(( LIMIT_S - $(elapsed) - 25 ))
echo "=== [$(elapsed) s] cases $CASES (budget ${BUDGET} s)"
timeout -k 15 $(( BUDGET + 20 )) python3 benchmarks/gpu_bench.py run --device "$DEVICE" --cases "$CASES" $BENCH_ARGS \
    --out "$W/bench" --work "$BENCH_WORK" --budget-s "$BUDGET" --no-report
echo "bench rc=$? at $(elapsed) s"
pack

echo "=== [$(elapsed) s] summary"
python3 -m benchmarks.gpu.stepmem_summary "$W/stepmem" --trace-step 2 > "$W/stepmem-summary.txt" 2>&1
cp "$W/stepmem-summary.txt" "$OUT/"
grep -E "^== |error|step begin|bf16 flattened g0|fp32 made g0|adam done g0|step end|after step" "$W/stepmem-summary.txt" \
    | grep -v "^     after" | head -120
echo "total $(elapsed) s"
pack
sleep 1
