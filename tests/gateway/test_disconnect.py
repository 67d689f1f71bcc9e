"""A client that goes away mid-generation aborts its engine request (live embedded engine, SGLang-native API,
real gateway process, real openai SDK): streamed and non-streamed, the engine's running count drops to 0
with the request counted as aborted long before ``max_tokens`` would be reached, and nothing of the turn is
recorded (a disconnected turn leaves no row; its session stays as it was and serves the next turn)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.engine_hooks import held_decoding, wait_for, wait_held
from tests.gateway.conftest import GatewayProc

MAX_TOKENS = 1800  # forced (min_tokens): a full generation takes many seconds on the tiny model
HOLD_AT = 8  # the engine (--test-hooks) holds the story here until the abort is seen: it runs when the client goes


def _engine_state(engine: str) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(engine + "/get_server_info", timeout=30).json()["internal_states"][0]
    return state


def _wait_idle(engine: str) -> dict[str, Any]:
    """The engine's state once nothing runs (bounded by how long a full generation would take and more)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state = _engine_state(engine)
        if not state["num_running_reqs"] and not state["num_waiting_reqs"]:
            return state
        time.sleep(0.05)
    raise AssertionError("the engine kept running the request")


def _turns(gw: GatewayProc, session_id: str) -> int:
    with gw.admin() as admin:
        tree = admin.get(f"/v1/sessions/{session_id}").json()
    return int(tree["num_interactions"])


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_a_client_that_disconnects_aborts_the_engine_request_and_records_nothing(
        gateway_factory: Callable[..., GatewayProc], stream: bool) -> None:
    gw = gateway_factory()
    engine = gw.engine_urls[0]
    session = gw.create_session(group_id="gone")
    before = _engine_state(engine)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me everything"}],
            "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS}
    # The story is held at HOLD_AT tokens while the client leaves and until the engine has aborted it: it is
    # provably running when the client goes, however fast the machine (released if the abort never comes,
    # and then it would run to MAX_TOKENS: the assertions below fail).
    with held_decoding(engine, HOLD_AT):
        if stream:
            client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=session["api_key"], max_retries=0,
                                   timeout=120)
            chunks = client.chat.completions.create(model="tiny", messages=body["messages"],
                                                    max_tokens=MAX_TOKENS, stream=True,
                                                    extra_body={"min_tokens": MAX_TOKENS})
            next(iter(chunks))
            wait_held(engine)
            chunks.close()  # the agent goes away mid-stream
        else:  # the agent gives up once the engine works on its request: it closes the connection
            payload = json.dumps(body).encode()
            host, port = gw.base_url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                             f"{session['api_key']}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                wait_held(engine)
        wait_for(lambda: _engine_state(engine)["aborted_requests"] > before["aborted_requests"],
                 "the engine request aborted after its client left")
    after = _wait_idle(engine)
    generated = after["generated_tokens"] - before["generated_tokens"]
    assert after["aborted_requests"] == before["aborted_requests"] + 1, (before, after)
    assert 0 < generated < MAX_TOKENS / 2, generated  # (the gateway's health probes add a token each)
    assert _turns(gw, session["session_id"]) == 0  # nothing partial recorded

    # the session serves its next turn as if nothing happened
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=session["api_key"], max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=3)
    assert reply.choices[0].message.role == "assistant"
    assert _turns(gw, session["session_id"]) == 1


def _held(gw: GatewayProc) -> float:
    text = httpx.get(gw.base_url + "/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("agentrl_gateway_held_generations "))


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_a_client_that_leaves_while_a_pause_holds_its_turn_drops_the_turn(
        gateway_factory: Callable[..., GatewayProc], stream: bool) -> None:
    """A turn held by a pause has sent nothing to the engine and, streamed, not even the response headers:
    when its client leaves, the held generation is dropped at once (it used to wait for the resume, then
    generate for nobody)."""
    gw = gateway_factory()
    session = gw.create_session(group_id="gone")
    payload = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                          "stream": stream}).encode()
    host, port = gw.base_url.removeprefix("http://").split(":")
    with gw.admin() as admin:
        assert admin.post("/admin/pause", json={}).status_code == 200
        try:
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                             f"{session['api_key']}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                deadline = time.monotonic() + 120
                while _held(gw) < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert _held(gw) == 1
            deadline = time.monotonic() + 60
            while _held(gw) > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _held(gw) == 0, "the held turn outlived its client"
        finally:
            assert admin.post("/admin/resume", json={"weight_version": 0}).status_code == 200
    _wait_idle(gw.engine_urls[0])
    assert _turns(gw, session["session_id"]) == 0
