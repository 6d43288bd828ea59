# Sourced by the one-call GPU session scripts (h100_session.sh, rl_session.sh) after they set OUT,
# LIMIT_S and W: the output folder, the log that comes back, and the step helpers.
START=$(date +%s)
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/session.log") 2>&1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( LIMIT_S - $(elapsed) )); }
step() { echo; echo "=== [$(elapsed) s] $*"; }
pack() { tar czf "$OUT/results.tgz.tmp" -C "$W" . && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
timing() { echo "$1 rc=$2 seconds=$3" | tee -a "$W/timings.txt"; }
