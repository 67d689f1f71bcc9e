#!/usr/bin/env bash
# The GPU-speed measurements of issue 15 in one call on an offline GPU machine (docs/trainer.md), each part
# under its own time limit so that one stuck part leaves the others' results:
#   1. engine memory release/resume (bench/memory_occupation.py)
#   2. weight pushes, disk and tensor (bench/two_gpu.py --parts push; one GPU: the engine shares it)
#   3. the GPU tests (marked; skipped on CPU)
#   4. trainer throughput on the uniform batch, with a profile (bench/trainer.py)
# Needs the project's missing wheels installed (scripts/offline_gpu.sh receive PART_DIR, done here when a
# part directory is given; a PART_DIR/home folder is copied into $AGENTRL_HOME). Outputs (tables, JSON, logs) are packed into bench.tgz in $OUT (or $2): one file,
# because the device tool brings back at most 8.
#
#   scripts/gpu_bench.sh [PART_DIR] [OUT_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dest=${2:-${OUT:-/tmp/agentrl-gpu-bench}}
out=/tmp/agentrl-gpu-bench-work
rm -rf "$out" && mkdir -p "$out" "$dest"
trap 'tar czf "$dest/bench.tgz" -C "$out" . && ls -la "$out"' EXIT
if [ -n "${1:-}" ]; then bash "$here/scripts/offline_gpu.sh" receive "$1" || exit 1; fi
# SmolLM2's tokenizer (the bench models use it) before the model's last part has arrived: a copy of
# $AGENTRL_HOME/tokenizers/smollm2 from the packing machine, shipped as PART_DIR/home/tokenizers/smollm2
home=${AGENTRL_HOME:-$HOME/.cache/agentrl}
if [ -n "${1:-}" ] && [ -d "$1/home" ]; then mkdir -p "$home" && cp -r "$1/home/." "$home/"; fi
export PYTHONPATH="$here:${SITE:-/tmp/agentrl-site}" PYTHONUNBUFFERED=1
cd "$here"
part() {  # NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name exited $rc after $(( $(date +%s) - start ))s"
  tail -n 40 "$out/$name.log"
}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
git log --oneline -1 2>/dev/null | cut -c1-100
part memory "${MEMORY_S:-120}" python3 bench/memory_occupation.py --out "$out"
part push "${PUSH_S:-180}" python3 bench/two_gpu.py --parts push --pushes 3 --out "$out"
part gputests "${TESTS_S:-45}" python3 -m pytest -q -p no:cacheprovider -c /dev/null --rootdir . tests/trainer/test_safetensors_io.py \
  tests/engine/test_memory.py -k "cuda or gpu"
part trainer "${TRAINER_S:-210}" python3 bench/trainer.py --batches uniform --variants naive,ours,ours-layers \
  --steps 4 --profile --out "$out"
