"""bench/gateway.py's helpers and its wrk script, against a real local HTTP server (no gateway needed).

The server records every body it receives, so the session scenario's growing history is checked on the
wire: turn k of a session carries k user messages and the k - 1 assistant replies in between.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("bench_gateway", REPO / "bench" / "gateway.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)  # bench/gateway.py (not the gateway package)
sys.modules["bench_gateway"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

SAMPLE = ('noise\nWRKJSON {"requests":200,"duration_us":2000000,"bytes":1,"connect_errors":0,"read_errors":1,'
          '"write_errors":0,"status_errors":3,"timeouts":2,"non200":3,"p50_us":1500.0,"p90_us":2000.0,'
          '"p99_us":9000.0,"mean_us":1700.0,"max_us":12000.0,"turn_p50_us":[1000.0,null],"turn_n":[5,0]}\n')


def test_parse_wrk_line() -> None:
    got = bench.parse_wrk(SAMPLE)
    assert got["rps"] == 100.0 and got["p50_ms"] == 1.5 and got["p99_ms"] == 9.0
    assert got["errors"] == 1 + 2 + 3  # read errors, timeouts, non-200 answers (status_errors are the same 3)
    assert got["turn_p50_ms"] == [1.0, None] and got["turn_n"] == [5, 0]
    with pytest.raises(ValueError, match="no WRKJSON"):
        bench.parse_wrk("Running 1s test\n")


def test_wrk_argv_one_thread_per_connection_in_session_mode() -> None:
    argv = bench.wrk_argv("http://h/x", concurrency=32, duration_s=5, mode="session", turns=20, stream=True,
                          key="k", tag="t")
    assert argv[argv.index("-t") + 1] == "32" and argv[argv.index("-c") + 1] == "32"
    assert argv[-5:] == ["session", "20", "1", "k", "t"]
    raw = bench.wrk_argv("http://h/x", concurrency=32, duration_s=5, mode="raw", turns=1, stream=False, key="k",
                         tag="t", body_file=Path("/b.json"))
    assert raw[raw.index("-t") + 1] == "2" and raw[-1] == "/b.json"
    long = bench.wrk_argv("http://h/x", concurrency=128, duration_s=12.8, mode="raw", turns=1, stream=False, key="k",
                          tag="t", body_file=Path("/b.json"))
    assert long[long.index("-d") + 1] == "13s"  # wrk refuses fractional seconds ("12.8s")


def test_table_ratios() -> None:
    def r(target: str, rps: float, p50: float, turns: list[float] | None = None) -> dict:
        return {"target": target, "scenario": "session" if turns else "single", "concurrency": 8, "rps": rps,
                "p50_ms": p50, "p99_ms": 2 * p50, "errors": 0, "turn_p50_ms": turns or [p50]}

    rows = bench.table([r("upstream-native", 1000, 1.0), r("ours-pg", 100, 3.0), r("ours-pg-w2", 170, 2.5),
                        r("litellm", 20, 40.0), r("ours-pg", 90, 4.0, [3.0, 3.5])], turns=2)
    ours = next(x for x in rows if x["target"] == "ours-pg" and x["scenario"] == "single")
    assert ours["vs_litellm"] == 5.0 and ours["added_p50_ms"] == 2.0
    assert next(x for x in rows if x["target"] == "ours-pg-w2")["workers2_vs_1"] == 1.7
    session = next(x for x in rows if x["scenario"] == "session")
    assert (session["turn1_ms"], session["turnN_ms"]) == (3.0, 3.5) and session["vs_litellm"] is None
    assert "| single | 8 | ours-pg | 100.0 |" in bench.markdown(rows, 2)


def test_table_with_rounds_takes_medians_and_the_median_of_each_rounds_ratio() -> None:
    """Round k of each target is compared with round k of the others: a machine twice as slow in round 1
    halves both sides, and the ratio stays; figures are medians over the rounds."""
    def r(target: str, k: int, rps: float, p50: float) -> dict:
        return {"target": target, "scenario": "single", "concurrency": 1, "round": k, "rps": rps, "p50_ms": p50,
                "p99_ms": 2 * p50, "errors": k, "turn_p50_ms": [p50]}

    results = [r("upstream-native", 0, 1000, 0.2), r("ours-pg", 0, 400, 2.0), r("litellm", 0, 80, 12.0),
               r("upstream-native", 1, 500, 0.4), r("ours-pg", 1, 200, 4.0), r("litellm", 1, 40, 24.0),
               r("upstream-native", 2, 1000, 0.2), r("ours-pg", 2, 300, 3.0), r("litellm", 2, 100, 10.0)]
    ours = next(x for x in bench.table(results, turns=1) if x["target"] == "ours-pg")
    assert ours["rounds"] == 3 and ours["rps"] == 300 and ours["p50_ms"] == 3.0 and ours["errors"] == 3
    assert ours["vs_litellm"] == 5.0  # rounds: 5.0, 5.0, 3.0 (the medians' ratio would be 300 / 80 = 3.75)
    assert ours["added_p50_ms"] == 2.8  # rounds: 1.8, 3.6, 2.8


@contextmanager
def chat_server(answer: Callable[[str, str, dict], bytes]) -> Iterator[str]:
    """A local HTTP server whose POSTs are answered 200 with ``answer(path, authorization, body)`` (called
    under one lock); yields the chat completions URL on it."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                out = answer(self.path, self.headers["Authorization"], body)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    finally:
        server.shutdown()


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)")
def test_wrk_session_script_grows_the_history() -> None:
    bodies: list[dict] = []

    def answer(_path: str, _auth: str, body: dict) -> bytes:
        bodies.append(body)
        return b'{"ok": true}'

    with chat_server(answer) as url:
        argv = bench.wrk_argv(url, concurrency=2, duration_s=1, mode="session", turns=3, stream=False,
                              key="k", tag="tg")
        got = bench.run_wrk(argv, timeout_s=60)
    assert got["errors"] == 0 and got["requests"] >= 6 and len(got["turn_p50_ms"]) == 3
    assert got["turn_n"][0] >= got["turn_n"][2] >= 1
    for body in bodies:
        msgs = body["messages"]
        users = [m for m in msgs if m["role"] == "user"]
        assistants = [m for m in msgs if m["role"] == "assistant"]
        assert msgs[0]["role"] == "system" and 1 <= len(users) <= 3 and len(assistants) == len(users) - 1
        assert all(m["content"] == "Hello! How can I help you today?" for m in assistants)
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * (len(users) - 1) + ["user"]
        assert users[0]["content"].startswith("Session tg-")
    # every session runs turns 1, 2, 3 in order on its connection
    firsts = {b["messages"][1]["content"] for b in bodies}
    assert len(firsts) < len(bodies)


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)")
def test_wrk_named_script_creates_each_session_and_sends_its_turns_with_its_key() -> None:
    """Named mode: every 3-turn session starts with POST /v1/sessions (the runner's key); its turns carry the
    key that answer gave, and requests/s counts the turns only."""
    seen: list[tuple[str, str, int]] = []  # (path, authorization, user messages)
    made = iter(range(1_000_000))

    def answer(path: str, auth: str, body: dict) -> bytes:
        seen.append((path, auth, sum(m["role"] == "user" for m in body.get("messages", []))))
        if path == "/v1/sessions":
            return json.dumps({"session_id": "s", "api_key": f"sk-{next(made)}"}).encode()
        return b'{"ok": true}'

    with chat_server(answer) as url:
        argv = bench.wrk_argv(url, concurrency=2, duration_s=1, mode="named", turns=3, stream=False,
                              key="runner", tag="tg")
        got = bench.run_wrk(argv, timeout_s=60, named=True)
    creations = [s for s in seen if s[0] == "/v1/sessions"]
    turns = [s for s in seen if s[0] == "/v1/chat/completions"]
    assert creations and all(auth == "Bearer runner" for _, auth, _ in creations)
    assert all(auth.startswith("Bearer sk-") for _, auth, _ in turns)
    keys: dict[str, list[int]] = {}
    for _, auth, users in turns:
        keys.setdefault(auth, []).append(users)
    assert all(users == list(range(1, len(users) + 1)) for users in keys.values()), keys  # one session per key
    # wrk counts the answers it got: the server also saw the turns in flight (one per connection) when it stopped
    assert got["errors"] == 0 and len(turns) - 2 <= got["requests"] <= len(turns)
    assert got["turn_n"][0] >= got["turn_n"][2] >= 1
