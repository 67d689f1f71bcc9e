#!/usr/bin/env bash
# The docker-compose.yml topology without Docker, on this machine: the embedded engine (in place of SGLang),
# the gateway on the machine's PostgreSQL and Redis, the GRPO trainer and the example math agent.
#
#   scripts/topology.sh                       # short run: tiny model, 2 groups of 2 sessions, 1 trainer step
#   MODEL=smollm2 LIMIT=64 GROUP_SIZE=4 TRAIN_STEPS=8 scripts/topology.sh
#
# It runs each service as its own process (exactly the commands docs/deployment.md lists), waits for each
# to be healthy, drives the agent over the dataset, waits for the trainer to finish TRAIN_STEPS steps,
# writes $RUN_DIR/summary.json (weight versions seen by the gateway and the engine, the agent's summary)
# and stops everything it started (also on error or Ctrl-C). Logs: $RUN_DIR/<service>.log.
#
# Settings (environment variables; defaults in brackets):
#   MODEL [tiny]            smollm2, tiny or a Hugging Face model directory (engine, tokenizer and trainer)
#   DEVICE [cpu]            engine device (cpu or cuda); TRAIN_DEVICE [cpu] the trainer's
#   ENGINE_PORT [30000]     GATEWAY_PORT [8000]
#   DB_URL [postgresql+asyncpg://postgres@127.0.0.1:5432/agentrl]   created if it does not exist
#   REDIS_URL [redis://127.0.0.1:6379/0]    REDIS_PREFIX [agentrl:]   (REDIS_URL=none: no Redis)
#   ADMIN_KEY [admin-local]  AGENT_KEY [agent-local]
#   DATASET [synthetic:1]   (gsm8k:../shared/data/gsm8k for GSM8K)   LIMIT [2]   GROUP_SIZE [2]
#   CONCURRENCY [4]  MAX_TOKENS [24]  MAX_TURNS [2]
#   TRAIN_STEPS [1] (0: no trainer)  BATCH_GROUPS [2]  SYNC_MODE [disk]  TRAIN_TIMEOUT_S [600]
#   TRAIN_NPROC [0]         0: `agentrl train`; N: `torchrun --standalone --nproc-per-node N -m trainer` (as in Compose)
#   RUN_DIR [runs/topology]  PYTHON [python]
set -euo pipefail

MODEL=${MODEL:-tiny}
DEVICE=${DEVICE:-cpu}
TRAIN_DEVICE=${TRAIN_DEVICE:-cpu}
ENGINE_PORT=${ENGINE_PORT:-30000}
GATEWAY_PORT=${GATEWAY_PORT:-8000}
DB_URL=${DB_URL:-postgresql+asyncpg://postgres@127.0.0.1:5432/agentrl}
REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
REDIS_PREFIX=${REDIS_PREFIX:-agentrl:}
ADMIN_KEY=${ADMIN_KEY:-admin-local}
AGENT_KEY=${AGENT_KEY:-agent-local}
DATASET=${DATASET:-synthetic:1}
LIMIT=${LIMIT:-2}
GROUP_SIZE=${GROUP_SIZE:-2}
CONCURRENCY=${CONCURRENCY:-4}
MAX_TOKENS=${MAX_TOKENS:-24}
MAX_TURNS=${MAX_TURNS:-2}
TRAIN_STEPS=${TRAIN_STEPS:-1}
BATCH_GROUPS=${BATCH_GROUPS:-2}
SYNC_MODE=${SYNC_MODE:-disk}
TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-600}
TRAIN_NPROC=${TRAIN_NPROC:-0}
RUN_DIR=${RUN_DIR:-runs/topology}
PYTHON=${PYTHON:-python}

ENGINE_URL="http://127.0.0.1:${ENGINE_PORT}"
GATEWAY_URL="http://127.0.0.1:${GATEWAY_PORT}"
mkdir -p "$RUN_DIR"
RUN_DIR=$(cd "$RUN_DIR" && pwd)
PIDS=()

log() { echo "topology $(date +%T): $*" >&2; }

# http_get URL [BEARER]: print the body of a 200 answer, fail otherwise (Python, so that curl is not needed)
http_get() {
    "$PYTHON" - "$@" <<'PY'
import sys, urllib.request
req = urllib.request.Request(sys.argv[1])
if len(sys.argv) > 2:
    req.add_header("Authorization", f"Bearer {sys.argv[2]}")
try:
    with urllib.request.urlopen(req, timeout=5) as r:
        sys.stdout.write(r.read().decode())
except Exception:
    sys.exit(1)
PY
}

stop_all() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null || true   # each service runs in its own process group
    done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 1 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL -- "-$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    PIDS=()
}
trap 'stop_all' EXIT
trap 'exit 130' INT TERM

# start NAME COMMAND...: run a service in its own process group, output in $RUN_DIR/NAME.log
start() {
    local name=$1
    shift
    setsid "$@" >"$RUN_DIR/$name.log" 2>&1 &
    PIDS+=("$!")
    eval "PID_$name=$!"
    log "$name started (pid $!): $*"
}

# wait_healthy NAME URL TIMEOUT_S
wait_healthy() {
    local name=$1 url=$2 timeout=$3 pid
    pid=$(eval echo "\$PID_$name")
    for _ in $(seq 1 $((timeout * 2))); do
        if http_get "$url" >/dev/null; then
            log "$name is healthy ($url)"
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            log "$name exited; last lines of $RUN_DIR/$name.log:"
            tail -n 30 "$RUN_DIR/$name.log" >&2
            return 1
        fi
        sleep 0.5
    done
    log "$name not healthy after ${timeout}s; last lines of $RUN_DIR/$name.log:"
    tail -n 30 "$RUN_DIR/$name.log" >&2
    return 1
}

# the PostgreSQL database of DB_URL, created if missing
if [[ "$DB_URL" == postgresql* ]]; then
    "$PYTHON" - "$DB_URL" <<'PY'
import asyncio, sys
from urllib.parse import urlsplit
import asyncpg
url = urlsplit(sys.argv[1].replace("+asyncpg", ""))
name = url.path.lstrip("/")
async def main():
    conn = await asyncpg.connect(url._replace(path="/postgres").geturl())
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(f'CREATE DATABASE "{name}"')
            print(f"topology: created database {name}", file=sys.stderr)
    finally:
        await conn.close()
asyncio.run(main())
PY
fi

# 1. engine (SGLang's native API; in production: SGLang itself)
start engine "$PYTHON" -m agentrl engine --model "$MODEL" --host 127.0.0.1 --port "$ENGINE_PORT" --device "$DEVICE"

# 2. gateway: applies the migrations to the database, waits for a healthy engine, then serves. Its GRPO group size (a setting read
#    from the environment only) must match the agent's --group-size, or groups never fill.
redis_args=()
if [[ "$REDIS_URL" != none ]]; then
    redis_args=(--redis "$REDIS_URL" --redis-prefix "$REDIS_PREFIX")
fi
start gateway env AGENTRL_GATEWAY_GROUP_SIZE="$GROUP_SIZE" "$PYTHON" -m agentrl gateway --engine-url "$ENGINE_URL" --db "$DB_URL" "${redis_args[@]}" \
    --host 127.0.0.1 --port "$GATEWAY_PORT" --admin-key "$ADMIN_KEY" --agent-key "$AGENT_KEY" --startup-timeout-s 300
wait_healthy engine "$ENGINE_URL/health" 300
wait_healthy gateway "$GATEWAY_URL/health" 300

# 3. trainer: leases finished groups, trains, pushes weights to the engine, bumps the gateway's version
if (( TRAIN_STEPS > 0 )); then
    if (( TRAIN_NPROC > 0 )); then
        trainer_cmd=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$TRAIN_NPROC" -m trainer)
    else
        trainer_cmd=("$PYTHON" -m agentrl train)
    fi
    start trainer "${trainer_cmd[@]}" --gateway "$GATEWAY_URL" --admin-key "$ADMIN_KEY" --model "$MODEL" \
        --device "$TRAIN_DEVICE" --steps "$TRAIN_STEPS" --group-size "$GROUP_SIZE" --batch-groups "$BATCH_GROUPS" \
        --sync-mode "$SYNC_MODE" --checkpoint-dir "$RUN_DIR/trainer" --no-resume
fi

# 4. agent: the example math agent over the dataset, in the foreground
log "agent: $LIMIT prompts x $GROUP_SIZE sessions"
"$PYTHON" -m agentrl agent math --gateway "$GATEWAY_URL" --admin-key "$ADMIN_KEY" --dataset "$DATASET" \
    --limit "$LIMIT" --group-size "$GROUP_SIZE" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
    --max-turns "$MAX_TURNS" --no-progress >"$RUN_DIR/agent.log" 2>&1 || {
    log "agent failed; last lines of $RUN_DIR/agent.log:"
    tail -n 30 "$RUN_DIR/agent.log" >&2
    exit 1
}
tail -n 1 "$RUN_DIR/agent.log" >"$RUN_DIR/agent_summary.json"
log "agent done: $(cat "$RUN_DIR/agent_summary.json")"

if (( TRAIN_STEPS > 0 )); then
    log "waiting for the trainer to finish $TRAIN_STEPS step(s)"
    for _ in $(seq 1 $((TRAIN_TIMEOUT_S * 2))); do
        kill -0 "$PID_trainer" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$PID_trainer" 2>/dev/null; then
        log "trainer still running after ${TRAIN_TIMEOUT_S}s; last lines of $RUN_DIR/trainer.log:"
        tail -n 30 "$RUN_DIR/trainer.log" >&2
        exit 1
    fi
    if ! wait "$PID_trainer"; then
        log "trainer failed; last lines of $RUN_DIR/trainer.log:"
        tail -n 30 "$RUN_DIR/trainer.log" >&2
        exit 1
    fi
    log "trainer done"
fi

# summary: what the gateway and the engine say now (before everything stops)
gateway_version=$(http_get "$GATEWAY_URL/admin/weight_version" "$ADMIN_KEY")
# the engine's weight version where it reports it: /model_info (SGLang 0.5.19 and 0.5.23), /get_model_info on the
# embedded engine (only the get_ names); SGLang has no /get_weight_version (404 in 0.5.19, gone in 0.5.23)
engine_info=$(http_get "$ENGINE_URL/model_info" || http_get "$ENGINE_URL/get_model_info")
engine_version=$(printf '%s' "$engine_info" | "$PYTHON" -c \
    'import json, sys; print(json.dumps({"weight_version": json.load(sys.stdin).get("weight_version")}))')
cat >"$RUN_DIR/summary.json" <<EOF
{"gateway": $gateway_version, "engine": $engine_version, "agent": $(cat "$RUN_DIR/agent_summary.json")}
EOF
log "summary: $(cat "$RUN_DIR/summary.json")"
