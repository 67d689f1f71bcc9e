#!/usr/bin/env bash
# The suite's proof that it does not depend on the machine's speed (issue 32): a fresh clone of a commit,
# `CI=true bash .ci/run` QUIET times in a row, then LOADED times while two busy loops keep both cores busy
# (started and stopped here, so the load is the proof's own, not an accident). One line per run, with its
# time and pytest's closing line, in $OUT/proof.log; each run's whole output beside it.
#
#   scripts/ci_proof.sh [COMMIT] [QUIET] [LOADED]     (defaults: HEAD 3 1)
#
# A run takes 15-25 minutes on the 2-core machine: the whole proof about 1.5 hours.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")"
quiet="${2:-3}"
loaded="${3:-1}"
out="${OUT:-$repo/runs/ci-proof-$(date -u +%Y%m%d-%H%M)}"
mkdir -p "$out"
busy=()
stop_busy() { for pid in "${busy[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done; busy=(); }
trap stop_busy EXIT

run_once() {  # $1: a label; a fresh clone each time, as CI makes one
  local label="$1" dir start end rc
  dir="$(mktemp -d /tmp/agentrl-ci-XXXX)"
  git clone -q "$repo" "$dir/clone" && git -C "$dir/clone" checkout -q "$commit"
  ln -s "$(cd "$repo/.." && pwd)/shared" "$dir/shared" 2>/dev/null || true  # ../shared, as beside a checkout
  load_before="$(cut -d' ' -f1 /proc/loadavg)"
  start=$(date +%s)
  set +e
  (cd "$dir/clone" && CI=true bash .ci/run) >"$out/$label.log" 2>&1 < /dev/null
  rc=$?
  set -e
  end=$(date +%s)
  printf '%s %s commit=%s rc=%d %dm%02ds load_before=%s load_after=%s | %s\n' "$(date -u +%FT%TZ)" "$label" \
    "${commit:0:7}" "$rc" $(((end - start) / 60)) $(((end - start) % 60)) "$load_before" "$(cut -d' ' -f1 /proc/loadavg)" \
    "$(grep -E '(passed|failed)' "$out/$label.log" | tail -1)" | tee -a "$out/proof.log"
  rm -rf "$dir"
  return "$rc"
}

status=0
for i in $(seq 1 "$quiet"); do
  run_once "quiet-$i" || status=1
done
for i in $(seq 1 "$loaded"); do
  python3 -c "while True: pass" & busy+=($!)
  python3 -c "while True: pass" & busy+=($!)
  run_once "loaded-$i" || status=1
  stop_busy
done
echo "proof: $out/proof.log"
exit "$status"
