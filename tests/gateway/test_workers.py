"""`agentrl gateway --workers N`: worker processes on one port sharing PostgreSQL + Redis (gateway.workers).

Real processes throughout: the stand-in upstream (``tests/standin.py``), the gateway's supervisor and its
workers, the machine's PostgreSQL and Redis (own database and key prefix per test), the real ``openai``
SDK as the agent. Which worker answered is read from the ``x-agentrl-worker`` response header.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from agentrl.procs import Processes
from gateway.workers import check_port_free, is_listening, reuseport_socket
from tests.conftest import REDIS_URL, REPO, free_port
from tests.gateway.conftest import full_sequences
from tests.standin import COMMAND as STANDIN

ADMIN, AGENT = "workers-admin", "workers-agent"


def _gateway_argv(db: str, port: int, upstream: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "agentrl", "gateway", "--engine-url", upstream, "--db", db, "--port", str(port),
            "--admin-key", ADMIN, "--agent-key", AGENT, "--log-level", "warning", *extra]


def _refused(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_sqlite_refuses_several_workers(tmp_path: Path) -> None:
    got = _refused(_gateway_argv(f"sqlite+aiosqlite:///{tmp_path}/gw.db", free_port(), "http://127.0.0.1:9",
                                 "--workers", "2", "--redis", REDIS_URL))
    assert got.returncode != 0
    assert "--workers 2 needs PostgreSQL" in got.stderr and "one process write at a time" in got.stderr
    assert not (tmp_path / "gw.db").exists()  # refused before anything was opened


def test_several_workers_need_redis() -> None:
    got = _refused(_gateway_argv("postgresql+asyncpg://postgres@127.0.0.1:5432/test", free_port(),
                                 "http://127.0.0.1:9", "--workers", "2"))
    assert got.returncode != 0 and "needs --redis" in got.stderr


def test_reuseport_sockets_share_a_port_and_report_listening() -> None:
    port = free_port()
    a, b = reuseport_socket("127.0.0.1", port), reuseport_socket("127.0.0.1", port)
    try:
        assert not is_listening(a)
        check_port_free("127.0.0.1", port)  # bound but not listening: nothing serves it yet
        a.listen()
        b.listen()
        assert is_listening(a) and is_listening(b)
        with pytest.raises(OSError):  # a second gateway on the same port is refused, not silently merged
            check_port_free("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------------------------------ processes

def _worker_pids(parent: int) -> set[int]:
    try:
        return {int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()}
    except OSError:
        return set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _until(what: str, check: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _each_worker(url: str, headers: dict[str, str], workers: int = 2) -> dict[str, httpx.Response]:
    """One response from every worker: each request on a new connection (the kernel picks the worker by
    the connection's address hash), until every worker has answered."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(400):
        resp = httpx.get(url, headers=headers, timeout=30)
        resp.raise_for_status()
        seen.setdefault(resp.headers["x-agentrl-worker"], resp)
        if len(seen) == workers:
            return seen
    raise AssertionError(f"only workers {sorted(seen)} answered 400 new connections")


@pytest.mark.slow
@pytest.mark.services
def test_two_workers_one_session_one_leader_and_takeover(tmp_path: Path, tiny_model_dir: Path, pg_url: str,
                                                         redis_prefix: str) -> None:
    with Processes(tmp_path / "logs") as procs:
        up_port, port = free_port(), free_port()
        upstream, base = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{port}"
        child = procs.start("standin", [*STANDIN, "--port", str(up_port),
                                        "--tokenizer", str(tiny_model_dir), "--reply", "Four."])
        procs.wait_healthy(child, upstream + "/health", timeout_s=120)
        gw = procs.start("gateway", _gateway_argv(pg_url, port, upstream, "--workers", "2", "--redis", REDIS_URL,
                                                  "--redis-prefix", redis_prefix, "--tick-s", "0.2"))
        procs.wait_healthy(gw, base + "/health", timeout_s=180)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        _each_worker(base + "/health", {})
        workers = _until("two workers", lambda: len(_worker_pids(gw.proc.pid)) == 2 and _worker_pids(gw.proc.pid))

        # One multi-turn session; every turn on a new connection, until both workers have served turns.
        session = httpx.post(base + "/v1/sessions", json={}, headers=admin, timeout=30).json()
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 2?"}]
        served, ids = [], []
        for turn in range(40):
            with openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0,
                               http_client=httpx.Client(timeout=60)) as client:
                raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=8)
            completion = raw.parse()
            served.append(raw.headers["x-agentrl-worker"])
            ids.append(completion.id)
            messages += [{"role": "assistant", "content": completion.choices[0].message.content},
                         {"role": "user", "content": f"And plus {turn}?"}]
            if turn >= 3 and len(set(served)) == 2:
                break
        assert set(served) == {"0", "1"}, served

        # The turns form one chain, in order, whichever worker recorded them ...
        tree = httpx.get(f"{base}/v1/sessions/{session['session_id']}", headers=admin, timeout=30).json()
        assert tree["num_interactions"] == len(ids) and len(tree["roots"]) == 1
        chain, node = [], tree["roots"][0]
        while True:
            chain.append(node["id"])
            assert node["root_reason"] is None or node is tree["roots"][0]
            if not node["children"]:
                break
            assert len(node["children"]) == 1
            node = node["children"][0]
        assert chain == ids
        # ... and token-exact: each turn's prompt + output is the start of the next turn's prompt.
        sequences = full_sequences(pg_url, ids)
        for parent, child_seq in zip(sequences, sequences[1:]):
            assert len(child_seq) > len(parent) and child_seq[: len(parent)] == parent

        # Exactly one lifecycle leader among the workers: the lock holder, and the only one that ticks.
        r = redis.Redis.from_url(REDIS_URL)
        key = redis_prefix + "lifecycle:leader"
        holder = _until("a leader", lambda: r.get(key)).decode()
        leader_pid = int(holder.split(":")[1])
        assert leader_pid in workers
        def leader_ticked() -> dict[str, Any] | None:
            got = {w: resp.json() for w, resp in _each_worker(base + "/v1/trajectories/stats", admin).items()}
            return got if any(s["leader"]["leading"] and s["stats"]["ticks"] for s in got.values()) else None

        stats = _until("the leader's first tick", leader_ticked)
        leading = [s for s in stats.values() if s["leader"]["leading"]]
        assert len(leading) == 1 and leading[0]["leader"]["this_process"] == holder
        follower = next(s for s in stats.values() if not s["leader"]["leading"])
        assert follower["stats"]["ticks"] == 0 and leading[0]["stats"]["ticks"] > 0

        # kill -9 the leader: another worker takes the lock over (after it lapses), the supervisor starts
        # a replacement, and the new leader exports the session once it is finished and rewarded.
        os.kill(leader_pid, signal.SIGKILL)
        new_holder = _until("a new leader", lambda: (h := r.get(key)) and int(h.decode().split(":")[1]) != leader_pid
                            and h.decode(), timeout_s=120)
        assert int(new_holder.split(":")[1]) in _worker_pids(gw.proc.pid)
        replaced = _until("a replacement worker",
                          lambda: len(p := _worker_pids(gw.proc.pid)) == 2 and leader_pid not in p and p)
        _each_worker(base + "/health", {})  # both serve again
        httpx.post(base + "/reward", json={"session_id": session["session_id"], "reward": 1.0}, headers=admin,
                   timeout=30).raise_for_status()
        httpx.post(f"{base}/v1/sessions/{session['session_id']}/finish", headers=admin,
                   timeout=30).raise_for_status()
        lease = httpx.get(base + "/v1/trajectories", params={"max_groups": 1, "wait_s": 60}, headers=admin,
                          timeout=90)
        assert lease.status_code == 200, lease.text

        # The workers die with the supervisor, even when it is killed with SIGKILL (parent-death signal).
        os.kill(gw.proc.pid, signal.SIGKILL)
        gw.proc.wait()
        _until("the workers to exit", lambda: not any(_alive(p) for p in replaced), timeout_s=60)
        r.close()
