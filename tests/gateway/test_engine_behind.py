"""An engine that restarted on older weights is taken out of rotation until a push brings it up (issue 36's
chaos leftovers: a restarted engine served the base weights as version 0 while the gateway believed a later
version, for everyone).

Real processes: two tiny engines and a gateway; one engine is killed with SIGKILL and started again on the same
port (it reports version 0). The gateway's health check reads each engine's weight version
(``/model_info``): while the other engine serves the gateway's version, the restarted one serves nothing;
it comes back once it reports that version again (what the trainer's next push does). With no engine at the
current version, the one behind stays in rotation (refusing everything would also stop the data the trainer
needs to push again). Everything waits on the gateway's ``GET /admin/engines``, bounded by a hang guard."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import openai

from agentrl.procs import Child, Processes
from tests.conftest import free_port
from tests.engine_hooks import wait_for
from tests.gateway.conftest import gateway_starter

HANG_GUARD_S = 180.0


def start_engine(procs: Processes, port: int) -> Child:
    child = procs.start(f"engine-{port}-{len(procs.children)}", [
        sys.executable, "-m", "agentrl", "engine", "--model", "tiny", "--port", str(port), "--test-hooks"])
    procs.wait_healthy(child, f"http://127.0.0.1:{port}/health", timeout_s=HANG_GUARD_S)
    return child


def label(url: str, version: int) -> None:
    """What a push (or a skipped step's relabel) does to the engine's reported version."""
    resp = httpx.post(f"{url}/update_weight_version", json={"new_version": str(version), "abort_all_requests": False},
                      timeout=60)
    assert resp.status_code == 200, resp.text


def wait_engines(admin: httpx.Client, what: str, ok: Any) -> dict[str, dict]:
    """Until ``ok(engines by URL)`` holds for the gateway's ``GET /admin/engines`` (``wait_for``'s hang guard)."""
    def check() -> dict[str, dict] | None:
        engines = {e["url"]: e for e in admin.get("/admin/engines").json()["engines"]}
        return engines if ok(engines) else None

    return wait_for(check, f"the gateway's engines: {what}", poll_s=0.1)


def ask(session: dict, n: int) -> None:
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=120)
    for i in range(n):
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Count to {i}."}],
                                               max_tokens=4)
        assert reply.choices[0].message.content is not None


def test_a_restarted_engine_behind_the_gateways_version_serves_nothing_until_it_catches_up(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with Processes(tmp_path / "logs") as procs:
        engines = [start_engine(procs, p) for p in ports]
        for url in urls:
            label(url, 3)
        gw = gateway_starter(procs, tmp_path, urls)()
        with gw.admin() as admin:
            assert admin.post("/admin/resume", json={"weight_version": 3}).status_code == 200
            wait_engines(admin, "both in rotation at v3", lambda e: all(e[u]["healthy"] and e[u]["behind"] is None
                                                                        for u in urls))

            engines[1].proc.send_signal(signal.SIGKILL)  # the restart: base weights, version 0
            engines[1].proc.wait()
            start_engine(procs, ports[1])
            seen = wait_engines(admin, "the restarted engine out of rotation",
                                lambda e: e[urls[1]]["behind"] == 0 and not e[urls[1]]["healthy"])
            assert "below the gateway's 3" in seen[urls[1]]["last_error"]
            assert seen[urls[0]]["healthy"]
            served = seen[urls[1]]["served"]

            session = gw.create_session()
            ask(session, 4)  # all on the engine at v3
            after = {e["url"]: e for e in admin.get("/admin/engines").json()["engines"]}
            assert after[urls[1]]["served"] == served and after[urls[0]]["served"] >= 4

            label(urls[1], 3)  # the trainer's push reaches it
            wait_engines(admin, "the engine back in rotation", lambda e: e[urls[1]]["healthy"]
                         and e[urls[1]]["behind"] is None)

            # alone and behind: kept in rotation (nothing else could serve, and the trainer needs data)
            engines[0].proc.send_signal(signal.SIGKILL)
            engines[0].proc.wait()
            label(urls[1], 0)
            wait_engines(admin, "the one engine left kept in rotation while behind",
                         lambda e: not e[urls[0]]["healthy"] and e[urls[1]]["behind"] == 0 and e[urls[1]]["healthy"])
            ask(gw.create_session(), 1)
