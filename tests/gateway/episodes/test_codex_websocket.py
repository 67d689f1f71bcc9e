"""Codex 0.171.0's Responses WebSocket, against this gateway, with the real CLI (npm).

Codex can send its turns over a WebSocket (``GET /v1/responses`` with ``Upgrade: websocket`` and
``openai-beta: responses_websockets=…``) instead of ``POST /v1/responses``. The gateway serves no WebSocket:
it answers the handshake ``426 Upgrade Required`` with an OpenAI-shaped error
(``gateway/episodes/routes.py``). Whether Codex tries, and what it does then, depends on its provider:

* the built-in ``openai`` provider pointed at the gateway (``openai_base_url``): tries the WebSocket once
  (its prewarm), takes the 426 as "use HTTP" and sends every turn by ``POST``; the run completes. (Refused
  the way uvicorn refuses a WebSocket no route takes, 403, it made 7 handshakes over some 6 s before going
  over to HTTP: 9.6 s for this run against 3.0 s with the 426.)
* a custom provider (``[model_providers.X]``, as ``docs/coding-agents.md`` configures it): no WebSocket
  attempt, with or without ``supports_websockets = false``.

Each run is one ``agentrl group`` attempt over the gateway on a real socket (``served``), a middleware
around the gateway noting every HTTP request and WebSocket handshake it got; the task is one
``exec_command`` writing ``hello.txt``, then done, checked by the reward command.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import websockets

from agentrl.cli import build_parser
from agentrl.group import GroupRun, check
from tests.gateway.episodes.clis import (GATEWAY_PROVIDER, OPENAI_ENV, OPENAI_PROVIDER, ByPrompt, call, clis_or_skip,
                                         codex_command, served, standin_of)
from tests.gateway.episodes.conftest import ADMIN

PROMPT = "Create a file named hello.txt in the current directory containing exactly the word hi, then reply done."
PROVIDERS = {
    "openai": OPENAI_PROVIDER,
    "custom": GATEWAY_PROVIDER,  # supports_websockets = false, as the capture kit ran it
    "custom-as-documented": ('model_provider = "gateway"\n[model_providers.gateway]\nname = "gateway"\n'
                             'base_url = "$OPENAI_BASE_URL"\nenv_key = "OPENAI_API_KEY"\nwire_api = "responses"\n'),
}

ENV = {"openai": OPENAI_ENV, "custom": "", "custom-as-documented": ""}


class Watch:
    """ASGI middleware: every HTTP request (method, path, status) and WebSocket handshake (path, headers, how
    it was answered) that reached the gateway."""

    def __init__(self, app: Any) -> None:
        self.app, self.seen = app, []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        entry = {"type": scope["type"], "method": scope.get("method", "GET"), "path": scope["path"], "answer": None,
                 "headers": {k.decode().lower(): v.decode() for k, v in scope["headers"]}}
        self.seen.append(entry)

        async def watched(message: dict[str, Any]) -> None:
            if entry["answer"] is None:
                if message["type"] == "http.response.start":
                    entry["answer"] = message["status"]
                elif message["type"] == "websocket.http.response.start":  # a handshake answered by HTTP
                    entry["answer"] = message["status"]
                elif message["type"].startswith("websocket."):
                    entry["answer"] = message["type"]
            await send(message)

        return await self.app(scope, receive, watched)


def script(prompt: str) -> str:
    return "Done." if prompt.count("<|im_start|>assistant") > 1 \
        else call("exec_command", {"cmd": "printf 'hi\\n' > hello.txt"})


@pytest.mark.parametrize("provider", list(PROVIDERS))
async def test_codex_transport_against_the_gateway(provider: str, tiny_model_dir: Path, tokenizer: Any,
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clis = await clis_or_skip()
    make = standin_of(tiny_model_dir, tokenizer)

    watch: list[Watch] = []

    def wrap(app: Any) -> Watch:
        watch.append(Watch(app))
        return watch[0]

    engine = ByPrompt({"done": make("Done.")}, tokenizer, script, make)
    async with served(tiny_model_dir, tokenizer, tmp_path, engine, wrap) as (base, app, _):
        args = build_parser().parse_args([
            "group", "--gateway", base, "--admin-key", ADMIN, "--size", "1", "--keep", "--timeout-s", "180",
            "--reward-cmd", "grep -qx hi hello.txt && echo 1 || echo 0", "--",
            *codex_command(clis["codex"], PROMPT, provider=PROVIDERS[provider], env=ENV[provider])])
        status = await GroupRun(args, check(args)).run()
        out = capsys.readouterr().out.strip().splitlines()
        (attempt,) = [json.loads(line) for line in out[:-1]]
        logs = Path(json.loads(out[-1])["attempts_dir"])
        seen = watch[0].seen
        assert status == 0 and attempt["reward"] == 1.0, (attempt, [p.read_text()[-3000:] for p in logs.rglob("*.log")])
        turns = await app.state.services.store.session_interactions(session_id=attempt["session_id"])
        assert len(turns) == 2  # the exec_command turn and the final one, recorded in the attempt's session
    responses = f"/sessions/{attempt['session_id']}/v1/responses"
    sockets = [e for e in seen if e["type"] == "websocket"]
    posts = [i for i, e in enumerate(seen) if e["type"] == "http" and e["path"] == responses]
    assert [seen[i]["method"] for i in posts] == ["POST", "POST"] and all(seen[i]["answer"] == 200 for i in posts)
    if provider != "openai":
        assert sockets == [], sockets  # a custom provider never tries the WebSocket
    else:
        # the WebSocket once (its prewarm), answered 426, then HTTP at once
        assert len(sockets) == 1 and sockets[0]["path"] == responses and sockets[0]["answer"] == 426, sockets
        assert "responses_websockets=" in sockets[0]["headers"]["openai-beta"]
        assert json.loads(sockets[0]["headers"]["x-codex-turn-metadata"])["request_kind"] == "prewarm"
        assert seen.index(sockets[0]) < posts[0]  # and it stays on HTTP for the rest of the run
    shutil.rmtree(logs)


async def test_a_responses_websocket_is_answered_426(tiny_model_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    """The handshake, plain and bound to a session by URL, over a real socket with the ``websockets`` client:
    426 and an OpenAI-shaped error naming the HTTP route."""
    async with served(tiny_model_dir, tokenizer, tmp_path) as (base, _, _):
        for path in ("/v1/responses", "/sessions/sess-x/v1/responses"):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with websockets.connect(base.replace("http://", "ws://") + path,
                                              additional_headers={"Authorization": f"Bearer {ADMIN}"}):
                    pass
            answer = refused.value.response
            assert answer.status_code == 426, answer
            error = json.loads(answer.body)["error"]
            assert error["code"] == "websocket_not_supported" and "POST /v1/responses" in error["message"]
