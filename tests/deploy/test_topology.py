"""The no-Docker topology (scripts/topology.sh) end to end on the machine's PostgreSQL and Redis.

Real processes over real HTTP: the embedded engine (tiny model), the gateway on a fresh PostgreSQL database
and an isolated Redis key prefix, the trainer (one GRPO step, weights pushed by disk) and the math agent
(2 prompts x 2 sessions). Checks that the data flowed: sessions and turns recorded token-exact in
PostgreSQL, groups exported and consumed, one trainer step, the new weight version on the gateway and the
engine, a checkpoint on disk, Redis used, and nothing left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import subprocess

import pytest

from tests.conftest import REDIS_URL, free_port
from tests.deploy.compose_file import REPO

pytestmark = [pytest.mark.services, pytest.mark.slow]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def unpack_int32(blob: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(blob) // 4}i", blob))


async def fetch(pg_url: str, sql: str) -> list:
    import asyncpg

    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        return await conn.fetch(sql)
    finally:
        await conn.close()


def test_topology_runs_engine_gateway_trainer_and_agent(pg_url, redis_prefix, tmp_path):
    import sys

    engine_port, gateway_port = free_port(), free_port()
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MODEL": "tiny",
        "DB_URL": pg_url,
        "REDIS_URL": REDIS_URL,
        "REDIS_PREFIX": redis_prefix,
        "ENGINE_PORT": str(engine_port),
        "GATEWAY_PORT": str(gateway_port),
        "RUN_DIR": str(tmp_path / "run"),
        "LIMIT": "2",
        "GROUP_SIZE": "2",
        "BATCH_GROUPS": "2",
        "TRAIN_STEPS": "1",
        "MAX_TOKENS": "16",
        "TRAIN_TIMEOUT_S": "200",
    }
    result = subprocess.run(["bash", str(REPO / "scripts" / "topology.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, f"topology.sh failed:\n{result.stderr[-4000:]}"

    # everything the script started is gone
    assert not port_open(engine_port) and not port_open(gateway_port)

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["agent"]["sessions"] == 4 and summary["agent"]["failed"] == 0
    # one trainer step pushed version 1 to the engine, and the gateway tags new tokens with it
    assert summary["gateway"]["weight_version"] == 1
    assert summary["engine"]["weight_version"] == "1"

    sessions = asyncio.run(fetch(pg_url, "SELECT id, group_id, status FROM sessions"))
    assert len(sessions) == 4
    assert len({s["group_id"] for s in sessions}) == 2
    assert {s["status"] for s in sessions} == {"consumed"}, "finished groups were exported to the trainer"
    turns = asyncio.run(fetch(pg_url, "SELECT session_id, prompt_ids, output_ids, output_logprobs, output_versions "
                                      "FROM interactions"))
    assert {t["session_id"] for t in turns} == {s["id"] for s in sessions}
    for t in turns:
        out = unpack_int32(t["output_ids"])
        assert out and len(unpack_int32(t["prompt_ids"])) > 0
        assert len(t["output_logprobs"]) == 4 * len(out)
        assert unpack_int32(t["output_versions"]) == [0] * len(out), "generated before the first weight push"

    metrics = [json.loads(line) for line in (tmp_path / "run" / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert metrics and metrics[-1]["step"] == 1
    checkpoints = list((tmp_path / "run" / "trainer").glob("step_*/model.safetensors"))
    assert checkpoints, "no Hugging Face checkpoint written"

    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert any(True for _ in client.scan_iter(match=redis_prefix + "*")), "the gateway left nothing in Redis"
    finally:
        client.close()
