#!/usr/bin/env bash
# One call on a lent GPU for issue 27: the RL engines and the GRPO step against TRL. Run from the
# project root on the GPU machine, with .gpu-wheels/ beside it (../shared/gpu/make-wheelhouse.sh
# trl==1.16.0) and OUT set to a folder that comes back:
#
#   OUT=/some/dir bash benchmarks/gpu/rl_session.sh
#
#   1. benchmarks/rl_generation.py --device cuda: padded (static cache, compiled step), padded-generate
#      and continuous on the built-in tiny Llama (random weights: every completion runs to the cap,
#      so this is per-step cost), 128 sequences x 64 new tokens             -> OUT/rlgen.json
#   2. benchmarks/gpu_bench.py run --cases rl: project-grpo and trl-grpo on the 1B shape, EOS raised
#      to 1/300 per step, 1,024 new tokens at most, within what is left of SESSION_LIMIT_S
#   3. a short summary, last
#
# Everything small goes into OUT/results.tgz (re-packed after each step). Each step runs under
# `timeout`; the whole stays within SESSION_LIMIT_S (default 480 s) of wall time.
# Trying the logic on a CPU first:
#   SESSION_ENV_SH=my-env.sh SESSION_DEVICE=cpu SESSION_BENCH_ARGS="--shape tiny" OUT=/tmp/x bash ...
set -u -o pipefail

OUT=${OUT:?set OUT to the folder that comes back}
LIMIT_S=${SESSION_LIMIT_S:-480}
ENV_SH=${SESSION_ENV_SH:-.gpu-wheels/env.sh}
DEVICE=${SESSION_DEVICE:-cuda}
BENCH_ARGS=${SESSION_BENCH_ARGS:-}
W=$(mktemp -d /tmp/rl-session.XXXX)
BENCH_WORK=/tmp/rl-bench-work
# shellcheck source=benchmarks/gpu/session_common.sh
. "$(dirname "$0")/session_common.sh"   # START, the log, elapsed / left / step / pack / timing

step "environment"
echo "project commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$W/nvidia-smi.txt"
# shellcheck disable=SC1091
. "$ENV_SH" || { echo "$ENV_SH failed"; pack; exit 1; }
export TORCH_CUDA_ARCH_LIST=9.0  # the image's 9.0a breaks DeepSpeed 0.19.8's JIT builder (../shared/GPU.md)
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__); \
import importlib.util as u; print('pynvml' if u.find_spec('pynvml') else 'no pynvml: GPU busy shares will be null')"

step "1. RL generation engines (tiny model)"
timeout -k 10 150 python3 benchmarks/rl_generation.py --device "$DEVICE" --rollouts 5 --max-new-tokens 64 \
    --out "$W/rlgen.json" 2>&1 | grep -v Warning | tail -20
echo "rc=$?"
cp "$W/rlgen.json" "$OUT/" 2>/dev/null
pack

BUDGET=$(( $(left) - 20 ))
step "2. make bench-gpu --cases rl (budget ${BUDGET} s)"
# shellcheck disable=SC2086
timeout -k 20 "$BUDGET" python3 benchmarks/gpu_bench.py run --device "$DEVICE" --cases rl --out "$W/bench" \
    --work "$BENCH_WORK" --budget-s $(( BUDGET - 30 )) $BENCH_ARGS 2>&1 | tail -15
echo "rc=$?"
pack

step "3. summary"
python3 - "$W" <<'EOF'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
rlgen = json.loads((w / "rlgen.json").read_text()) if (w / "rlgen.json").is_file() else {}
for name, g in rlgen.get("generation", {}).items():
    print(f"rlgen {name}: best {g['tokens_per_s_best']:,.0f} tok/s, first {g['seconds_first']:.2f} s")
for case in ("project-grpo", "trl-grpo"):
    path = w / "bench" / f"{case}.json"
    r = json.loads(path.read_text()) if path.is_file() else {}
    print(case, r.get("status"), {k: r.get(k) for k in ("rollout_s", "generate_s", "generate_tokens_per_s",
                                                       "generate_bandwidth_fraction", "gpu_busy_generate",
                                                       "response_length", "first_rollout_s")})
EOF
pack
echo "done in $(elapsed) s"
