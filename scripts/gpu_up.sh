#!/usr/bin/env bash
# The main job on one offline GPU machine, as run for the README (issue 16): receive the last model part
# (scripts/offline_gpu.sh), then `agentrl up --device cuda` with the given flags; summary.json,
# metrics.jsonl, the reward curve and the logs are copied to $OUT (or $2) even when the run fails.
#
#   scripts/gpu_up.sh PART_DIR [OUT_DIR] -- [agentrl up flags...]
set -uo pipefail
part=$1; shift
out=${OUT:-/tmp/agentrl-gpu-out}
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then out=$1; shift; fi
[ "${1:-}" = "--" ] && shift
here=$(cd "$(dirname "$0")/.." && pwd)
bash "$here/scripts/offline_gpu.sh" receive "$part" || exit 1
export PYTHONPATH="$here:${SITE:-/tmp/agentrl-site}" PYTHONUNBUFFERED=1
run=/tmp/agentrl-gpu-run
rm -rf "$run"
collect() {
  mkdir -p "$out"
  cp "$run"/summary.json "$run"/reward_curve.png "$run"/trainer/metrics.jsonl "$out"/ 2>/dev/null
  for f in engine gateway trainer; do tail -c 200000 "$run/logs/$f.log" > "$out/$f.log" 2>/dev/null; done
}
trap collect EXIT
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
start=$(date +%s)
python3 -m agentrl up --device cuda --out-dir "$run" "$@" 2>&1 | tee "$out/up.log"
rc=${PIPESTATUS[0]}
echo "agentrl up exited $rc after $(( $(date +%s) - start ))s"
exit "$rc"
