"""Runner pieces without a gateway: settings validation, the CLI flags, group reservation and a dead gateway."""

import argparse

import httpx
import pytest

from agentrl.settings import SettingsError, load
from agents.cli import register
from agents.runner import GatewayUnavailable, RunnerSettings
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


async def test_runner_reserves_whole_groups_and_counts_the_clients_429s():
    """The runner reserves each prompt's group in one POST /v1/groups (agentrl.client; its failure paths
    are tested in tests/agentrl/test_client.py), waiting out 429s; the summary reports them."""
    from agents.runner import run_agents

    calls: list[httpx.Request] = []
    refused = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal refused
        calls.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        if refused < 1:
            refused += 1
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"message": "budget"}})
        return httpx.Response(503, json={"error": {"message": "down"}})

    import respx

    with respx.mock(base_url="http://gw:9", assert_all_called=False) as mock:
        mock.route().mock(side_effect=handler)
        with pytest.raises(GatewayUnavailable, match="503 down"):
            await run_agents(settings(gateway="http://gw:9", limit=1, group_size=3, progress=False,
                                      gateway_wait_s=0.5))
    posts = [c for c in calls if c.method == "POST"]
    assert {c.url.path for c in posts} == {"/v1/groups"}
    import json

    assert json.loads(posts[0].content)["size"] == 3


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
