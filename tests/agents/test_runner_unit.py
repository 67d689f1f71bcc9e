"""Runner pieces without a gateway: settings validation, the CLI flags, backoff on 429 and on a dead gateway."""

import argparse

import httpx
import pytest

from agentrl.settings import SettingsError, load
from agents.cli import register
from agents.runner import Counters, Gateway, GatewayError, GatewayUnavailable, RunnerSettings
from tests.conftest import free_port


def settings(**kw) -> RunnerSettings:
    return load(RunnerSettings, env={}, **{"admin_key": "k", **kw})


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_flags_map_to_settings():
    args = parse(["agent", "tools", "--gateway", "http://h:1/", "--admin-key", "a", "--dataset", "synthetic:3",
                  "--group-size", "2", "--concurrency", "3", "--limit", "5", "--eval", "--temperature", "0.5",
                  "--max-tokens", "64", "--split", "test"])
    s = load(RunnerSettings, args, env={}, agent=args.which)
    assert (s.agent, s.gateway, s.admin_key, s.dataset, s.group_size, s.concurrency, s.limit, s.eval) == \
        ("tools", "http://h:1", "a", "synthetic:3", 2, 3, 5, True)
    assert (s.temperature, s.max_tokens, s.split, s.max_turns) == (0.5, 64, "test", 4)  # tools default: 4 turns
    assert settings().max_turns == 2  # math default


@pytest.mark.parametrize("kw, message", [
    ({"admin_key": ""}, "--admin-key is required"),
    ({"gateway": "localhost:8000"}, "must be an http"),
    ({"gateway": "http://h/v1"}, "without /v1"),
    ({"group_size": 0}, "--group-size must be >= 1"),
    ({"temperature": 3.0}, "--temperature"),
    ({"agent": "chess"}, "agent must be one of"),
])
def test_bad_settings_say_how_to_fix(kw, message):
    with pytest.raises(SettingsError, match=message):
        settings(**kw)


async def test_429_backs_off_honouring_retry_after():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= 2:
            return httpx.Response(429, headers={"Retry-After": "0"},
                                  json={"error": {"message": "staleness budget", "type": "rate_limit"}})
        return httpx.Response(200, json={"session_id": "s1", "api_key": "sk", "base_url": "/sessions/s1/v1"})

    counters = Counters()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        gateway = Gateway(settings(gateway="http://gw:9"), http, counters)
        session = await gateway.create_session(group_id="g", task_id="t", metadata={"eval": True})
    assert session.base_url == "http://gw:9/sessions/s1/v1"  # relative base_url joined to the gateway
    assert counters.backoffs_429 == 2 and len(calls) == 3
    assert calls[0].headers["authorization"] == "Bearer k"


async def test_503_retried_then_4xx_is_an_error():
    statuses = iter([503, 400])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(statuses), json={"error": {"message": "bad reward", "type": "invalid_request"}})

    counters = Counters()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        gateway = Gateway(settings(), http, counters)
        with pytest.raises(GatewayError, match="400: bad reward"):
            await gateway.post_reward("chatcmpl-1", 1.0, "sk")
    assert counters.gateway_retries == 1


async def test_dead_gateway_gives_up_after_gateway_wait():
    counters = Counters()
    async with httpx.AsyncClient() as http:
        gateway = Gateway(settings(gateway=f"http://127.0.0.1:{free_port()}", gateway_wait_s=1.5), http, counters)
        with pytest.raises(GatewayUnavailable, match="still failing after"):
            await gateway.finish("s1")
    assert counters.gateway_retries >= 2


def test_cli_exit_codes(tmp_path, capsys):
    def main(argv: list[str]) -> int:
        args = parse(argv)
        return args.func(args)

    assert main(["agent", "math", "--admin-key", "k", "--dataset", f"gsm8k:{tmp_path}/missing.jsonl"]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert main(["agent", "math", "--dataset", "synthetic"]) == 2  # no admin key
    assert "--admin-key is required" in capsys.readouterr().err
    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["agent", "math", "--gateway", dead, "--admin-key", "k", "--limit", "1", "--no-progress",
                 "--gateway-wait-s", "1"]) == 3
    assert "gateway unavailable" in capsys.readouterr().err
