#!/usr/bin/env bash
# One call on the lent H100 (2026-11-26): the planner's calibration on a real GPU, then new
# out-of-sample records for it. Run from the project root on the GPU machine, with .gpu-wheels/
# beside it (../shared/gpu/make-wheelhouse.sh) and OUT set to a folder that comes back:
#
#   OUT=/some/dir bash benchmarks/gpu/h100_session.sh
#
#   1. python -m pipeline calibrate benchmarks/gpu/h100-session/h100-1b.yaml --local --require-gpu
#      (the 1B benchmark cases' shapes; a CPU fallback is refused)       -> OUT/calibration-h100.json
#   2. python -m pipeline plan on the same file, with and without that calibration
#   3. benchmarks/gpu_bench.py run: memory cases no record has (ZeRO-1; DPO, live reference, micro
#      batch 2; SFT micro batch 2), then mem-sft-z2 again as a control against its 2026-11-22
#      record, within what is left of SESSION_LIMIT_S
#   4. a short summary, last
#
# The lent machine brings back at most 8 files, so everything small goes into OUT/results.tgz
# (re-packed after each step: a call cut short still returns what was done). Each step runs
# under `timeout`; the whole stays within SESSION_LIMIT_S (default 480 s) of wall time.
set -u -o pipefail

OUT=${OUT:?set OUT to the folder that comes back}
LIMIT_S=${SESSION_LIMIT_S:-480}
CASES=${SESSION_CASES:-env,mem-sft-z1,mem-dpo-live-mb2,mem-sft-mb2,mem-sft-z2}
CONFIG=benchmarks/gpu/h100-session/h100-1b.yaml
# For trying the script's logic on a CPU first (the calibration then writes cpu.json's content):
#   SESSION_ENV_SH=my-env.sh SESSION_DEVICE=cpu SESSION_REQUIRE_GPU= SESSION_BENCH_ARGS="--shape tiny"
ENV_SH=${SESSION_ENV_SH:-.gpu-wheels/env.sh}
DEVICE=${SESSION_DEVICE:-cuda}
REQUIRE_GPU=${SESSION_REQUIRE_GPU---require-gpu}
BENCH_ARGS=${SESSION_BENCH_ARGS:-}
W=$(mktemp -d /tmp/h100-session.XXXX)   # small results, packed into OUT/results.tgz
BENCH_WORK=/tmp/h100-bench-work           # the 1B model, data, run folders (large, left behind)
# shellcheck source=benchmarks/gpu/session_common.sh
. "$(dirname "$0")/session_common.sh"   # START, the log, elapsed / left / step / pack / timing

step "environment"
echo "project commit: $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$W/nvidia-smi.txt"
nproc; free -g | head -2
# shellcheck disable=SC1091
. "$ENV_SH" || { echo "$ENV_SH failed"; pack; exit 1; }
# The image says 9.0a; DeepSpeed 0.19.8's JIT builder cannot parse the 'a' (../shared/GPU.md).
export TORCH_CUDA_ARCH_LIST=9.0
echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR"
cp "$CONFIG" "$W/"

step "1. calibrate (--local --require-gpu)"
t0=$(date +%s)
timeout -k 10 240 python3 -m pipeline calibrate "$CONFIG" --local $REQUIRE_GPU \
    --out "$OUT/calibration-h100.json" 2>&1 | tee "$W/calibrate.log"
rc=$?; timing calibrate $rc $(( $(date +%s) - t0 ))
[ -f "$OUT/calibration-h100.json" ] && cp "$OUT/calibration-h100.json" "$W/"
pack

step "2. plan, with the calibration and without"
t0=$(date +%s)
if [ -f "$OUT/calibration-h100.json" ]; then
    timeout -k 5 60 python3 -m pipeline plan "$CONFIG" --calibration "$OUT/calibration-h100.json" \
        > "$W/plan-calibrated.txt" 2>&1; timing plan-calibrated $? $(( $(date +%s) - t0 ))
    timeout -k 5 60 python3 -m pipeline plan "$CONFIG" --calibration "$OUT/calibration-h100.json" --json \
        > "$W/plan-calibrated.json" 2>"$W/plan-calibrated.err"
fi
t0=$(date +%s)
# --calibration names no file here: the plan takes its default place (runs/calibration/h100-80gb.json),
# absent on a fresh machine, so these are the built-in rates.
timeout -k 5 60 python3 -m pipeline plan "$CONFIG" > "$W/plan-builtin.txt" 2>&1
timing plan-builtin $? $(( $(date +%s) - t0 ))
timeout -k 5 60 python3 -m pipeline plan "$CONFIG" --json > "$W/plan-builtin.json" 2>"$W/plan-builtin.err"
grep -E "^== stage|optimizer step .* s \(|rates:|matmul [0-9]|GPU memory [0-9]" "$W/plan-calibrated.txt" "$W/plan-builtin.txt" 2>/dev/null
pack

BUDGET=$(( $(left) - 20 ))
step "3. benchmark cases $CASES (budget ${BUDGET} s)"
if [ "$BUDGET" -gt 90 ]; then
    t0=$(date +%s)
    timeout -k 20 $(( BUDGET + 30 )) python3 benchmarks/gpu_bench.py run --device "$DEVICE" --cases "$CASES" $BENCH_ARGS \
        --out "$W/bench" --work "$BENCH_WORK" --budget-s "$BUDGET" --no-report
    timing bench $? $(( $(date +%s) - t0 ))
else
    echo "not run: ${BUDGET} s left"
fi
pack

step "4. summary"
python3 - "$W" <<'PY' 2>&1 | tee "$W/summary.txt"
import glob, json, os, statistics, sys
w = sys.argv[1]
try:
    c = json.load(open(os.path.join(w, "calibration-h100.json")))
except OSError:
    c = None
    print("calibration: NO FILE (see calibrate.log)")
if c:
    g = c["gpu"] or {}
    print(f"calibration: {g.get('device_name')} ({g.get('catalogue')}), {c['cores_available']} cores, "
          f"versions {c['versions']}")
    for r in c["matmul"]:
        if not r["model"]:
            print(f"  matmul {r['dtype']} {r['m']}x{r['k']}x{r['n']}: {r['tflops']} TFLOP/s  (built-in H100: 708)")
    shaped = sorted(r["tflops"] for r in c["matmul"] if r["model"])
    if shaped:
        print(f"  matmul at the file's {len(shaped)} shapes: min {shaped[0]} / median {statistics.median(shaped)} "
              f"/ max {shaped[-1]} TFLOP/s")
    print(f"  GPU memory copy {c['memory_bandwidth_gbs']} GB/s (datasheet 3350); host->GPU {c['host_to_gpu_gbs']}, "
          f"GPU->host {c['gpu_to_host_gbs']} GB/s (datasheet 40)")
    a = c["cpu_adam"] or {}
    if a:
        print(f"  CPU Adam ({a['optimizer']}) {a['params_per_s']:.4g} params/s on {a['threads']} threads = "
              f"{a['params_per_s'] / a['threads']:.3g} per core (built-in 8.2e7 per core)")
    print(f"  collective {c['collective']}; seconds {c['seconds']}")
    for n in c["notes"]:
        print(f"  note: {n}")
print("cases (step s measured / planned on the machine, reserved GiB / planned peak GiB):")
for p in sorted(glob.glob(os.path.join(w, "bench", "*.json"))):
    d = json.load(open(p))
    if d.get("kind") != "project":
        continue
    f = lambda k, fmt="{:.3f}": fmt.format(d[k]) if isinstance(d.get(k), (int, float)) else "-"
    print(f"  {d['case']:<18} {d['status']:<8} {f('seconds', '{:.0f}')} s  step {f('step_s')} / {f('planner_step_s')}"
          f"  reserved {f('gpu_mem_reserved_gib', '{:.1f}')} / {f('planner_peak_gib', '{:.1f}')}"
          f"  {d.get('reason') or ''}")
print("timings:", open(os.path.join(w, "timings.txt")).read().replace("\n", "; "))
PY
echo "total $(elapsed) s"
pack
sleep 1  # tee's last lines
