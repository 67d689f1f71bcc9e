"""agentrl.client at the HTTP boundary (respx), with the gateway's wire shapes (docs/gateway.md, /v1/groups).

A real socket is used for "gateway down" (nothing listens on the port). The client against a real gateway
process is in tests/agentrl/test_client_gateway.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from agentrl import client as client_mod
from agentrl.client import (AsyncGateway, Gateway, GatewayError, GatewayUnavailable, SessionNotActive)
from tests.conftest import free_port

URL = "http://gw.test"
MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "agentrl"}]}


def groups_answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    gid = body.get("group_id", "g")
    return httpx.Response(200, json={"group_id": gid, "size": body["size"], "sessions": [
        {"session_id": f"s{i}", "api_key": f"k{i}", "base_url": f"/sessions/s{i}/v1"}
        for i in range(body["size"])]})


@pytest.fixture
def waits(monkeypatch):
    """Record the client's back-off waits instead of sleeping them."""
    got: list[float] = []

    async def fake_async_sleep(s: float) -> None:
        got.append(s)

    monkeypatch.setattr(client_mod.asyncio, "sleep", fake_async_sleep)
    monkeypatch.setattr(client_mod.time, "sleep", got.append)
    return got


@pytest.fixture
def gw_mock():
    with respx.mock(base_url=URL, assert_all_called=False) as mock:
        mock.get("/v1/models").respond(200, json=MODELS)
        yield mock


async def test_group_is_one_request_and_episodes_are_bound(gw_mock):
    route = gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    async with AsyncGateway(URL, "admin") as gw:
        group = await gw.group("task-1", size=3, metadata={"agent": "mine"})
    assert route.call_count == 1
    sent = json.loads(route.calls[0].request.content)
    assert sent["size"] == 3 and sent["task_id"] == "task-1" and sent["metadata"] == {"agent": "mine"}
    assert sent["group_id"].startswith("task-1-")
    assert route.calls[0].request.headers["authorization"] == "Bearer admin"
    assert [e.session_id for e in group] == ["s0", "s1", "s2"]
    assert group[1].base_url == f"{URL}/sessions/s1/v1" and group[1].api_key == "k1"
    assert group[0].model == "tiny" and group.group_id == sent["group_id"] and group[2].task_id == "task-1"


async def test_eval_group_is_marked(gw_mock):
    route = gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    async with AsyncGateway(URL, "admin") as gw:
        await gw.group("t", size=1, eval=True)
    assert json.loads(route.calls[0].request.content)["metadata"] == {"eval": True}


async def test_429_waits_retry_after_then_admits(gw_mock, waits):
    route = gw_mock.post("/v1/groups").mock(side_effect=[
        httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"message": "budget full", "type": "x",
                                                                          "param": None, "code": "rate_limited"}}),
        httpx.Response(429, headers={"Retry-After": "0.5"}, json={"error": {"message": "budget full"}}),
        groups_answer(httpx.Request("POST", URL, json={"size": 2, "group_id": "g"})),
    ])
    async with AsyncGateway(URL, "admin") as gw:
        group = await gw.group("t", size=2, group_id="g")
        assert gw.counters.backoffs_429 == 2
    assert waits == [3.0, 0.5]  # exactly what the gateway asked for
    assert route.call_count == 3 and len(group) == 2


async def test_429_for_longer_than_admission_wait_gives_up(gw_mock, waits):
    gw_mock.post("/v1/groups").respond(429, headers={"Retry-After": "30"}, json={"error": {"message": "full"}})
    async with AsyncGateway(URL, "admin", admission_wait_s=100) as gw:
        with pytest.raises(GatewayUnavailable, match="429 full") as info:
            await gw.group("t", size=4)
    assert info.value.status == 429
    assert waits == [30.0, 30.0, 30.0]  # a fourth wait would pass 100 s


def test_429_sync_honours_retry_after(gw_mock, waits):
    gw_mock.post("/v1/groups").mock(side_effect=[
        httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "full"}}),
        groups_answer(httpx.Request("POST", URL, json={"size": 1, "group_id": "g"})),
    ])
    with Gateway(URL, "admin") as gw:
        group = gw.group("t", size=1, group_id="g")
    assert waits == [2.0] and group[0].session_id == "s0"


def test_gateway_down_raises_unavailable_after_wait(waits):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a real connection refused
    with Gateway(url, "admin", down_wait_s=5) as gw:
        with pytest.raises(GatewayUnavailable, match="ConnectError"):
            gw.group("t", size=2)
        assert gw.counters.gateway_retries >= 2
    assert waits and sum(waits) <= 5


async def test_gateway_down_async_real_socket(waits):
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncGateway(url, "admin", down_wait_s=3) as gw:
        with pytest.raises(GatewayUnavailable) as info:
            await gw.group("t", size=2)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


async def test_502_is_retried_then_succeeds(gw_mock, waits):
    gw_mock.post("/v1/groups").mock(side_effect=[
        httpx.Response(502, text="bad gateway"), httpx.ConnectError("refused"),
        groups_answer(httpx.Request("POST", URL, json={"size": 1, "group_id": "g"}))])
    async with AsyncGateway(URL, "admin") as gw:
        await gw.group("t", size=1, group_id="g")
        assert gw.counters.gateway_retries == 2
    assert len(waits) == 2


async def test_reward_on_finished_session_is_session_not_active(gw_mock, waits):
    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    gw_mock.post("/reward").respond(409, json={"error": {"message": "session s0 is finished", "type":
                                                         "invalid_request_error", "param": None,
                                                         "code": "session_not_active"}})
    async with AsyncGateway(URL, "admin") as gw:
        group = await gw.group("t", size=1)
        with pytest.raises(SessionNotActive, match="is finished") as info:
            await group[0].reward(1.0)
    assert info.value.status == 409 and info.value.code == "session_not_active"
    assert group[0].rewards == [] and waits == []  # not retried


async def test_other_4xx_is_gateway_error_not_retried(gw_mock, waits):
    gw_mock.post("/v1/groups").respond(401, json={"error": {"message": "unknown key", "code": "invalid_api_key"}})
    async with AsyncGateway(URL, "wrong") as gw:
        with pytest.raises(GatewayError, match="401: unknown key") as info:
            await gw.group("t", size=1)
    assert not isinstance(info.value, GatewayUnavailable) and waits == []


async def test_rewards_by_response_id_and_by_episode(gw_mock):
    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    reward = gw_mock.post("/reward").respond(200, json={"ok": True})
    async with AsyncGateway(URL, "admin") as gw:
        group = await gw.group("t", size=1)
        await group[0].reward(0.5, response_id="chatcmpl-1")
        await group[0].reward(1)
        with pytest.raises(ValueError, match="finite"):
            await group[0].reward(float("nan"))
    bodies = [json.loads(c.request.content) for c in reward.calls]
    assert bodies == [{"response_id": "chatcmpl-1", "reward": 0.5}, {"session_id": "s0", "reward": 1.0}]
    assert all(c.request.headers["authorization"] == "Bearer k0" for c in reward.calls)  # the session's key
    assert group[0].rewards == [("chatcmpl-1", 0.5), (None, 1.0)]


async def test_group_exit_finishes_every_open_episode_once(gw_mock):
    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    finish = gw_mock.post(url__regex=r"/v1/sessions/s\d/finish$").respond(200, json={})
    abandon = gw_mock.post(url__regex=r"/abandon$").respond(200, json={})
    async with AsyncGateway(URL, "admin") as gw:
        async with gw.group("t", size=3) as group:
            await group[0].finish()  # finished early by the agent: not finished twice
    assert sorted(str(c.request.url).split("/")[-2] for c in finish.calls) == ["s0", "s1", "s2"]
    assert abandon.call_count == 0 and all(e.status == "finished" for e in group)


async def test_group_exception_abandons_the_group(gw_mock):
    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    finish = gw_mock.post(url__regex=r"/finish$").respond(200, json={})
    abandon = gw_mock.post(url__regex=r"/v1/groups/[^/]+/abandon$").respond(200, json={})
    async with AsyncGateway(URL, "admin") as gw:
        with pytest.raises(RuntimeError, match="agent bug"):
            async with gw.group("t", size=2, group_id="g1") as group:
                raise RuntimeError("agent bug")
    assert str(abandon.calls[0].request.url) == f"{URL}/v1/groups/g1/abandon"
    assert finish.call_count == 0 and [e.status for e in group] == ["abandoned", "abandoned"]


async def test_episode_exception_abandons_only_that_episode(gw_mock):
    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    finish = gw_mock.post(url__regex=r"/finish$").respond(200, json={})
    abandon = gw_mock.post(url__regex=r"/v1/sessions/s1/abandon$").respond(200, json={})
    async with AsyncGateway(URL, "admin") as gw:
        async with gw.group("t", size=2) as group:
            async with group[0]:
                pass
            with pytest.raises(KeyError):
                async with group[1]:
                    raise KeyError("parse failure")
    assert abandon.call_count == 1 and finish.call_count == 1
    assert [e.status for e in group] == ["finished", "abandoned"]


def test_sync_group_hands_out_sync_clients_and_refuses_async_ones(gw_mock):
    """The sync Gateway's episodes give openai.OpenAI; asking one for an AsyncOpenAI says to use AsyncGateway
    (it used to hand one out and later call its close() without awaiting: "coroutine was never awaited")."""
    import openai

    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    finish = gw_mock.post(url__regex=r"/finish$").respond(200, json={})
    with Gateway(URL, "admin") as gw:
        with gw.group("t", size=2) as group:
            sync_client = group[0].openai(max_retries=0)
            assert isinstance(sync_client, openai.OpenAI)
            assert str(sync_client.base_url) == f"{URL}/sessions/s0/v1/" and sync_client.api_key == "k0"
            with pytest.raises(TypeError, match="use AsyncGateway"):
                group[1].async_openai()
    assert finish.call_count == 2 and [e.status for e in group] == ["finished", "finished"]
    assert sync_client.is_closed()  # closed with its episode


async def test_async_group_hands_out_async_clients_closed_with_the_episode(gw_mock):
    import openai

    gw_mock.post("/v1/groups").mock(side_effect=groups_answer)
    gw_mock.post(url__regex=r"/finish$").respond(200, json={})
    async with AsyncGateway(URL, "admin") as gw:
        async with gw.group("t", size=2) as group:
            async_client = group[1].async_openai(max_retries=0)
            assert isinstance(async_client, openai.AsyncOpenAI) and async_client.max_retries == 0
            assert str(async_client.base_url) == f"{URL}/sessions/s1/v1/"
    assert async_client.is_closed()


def test_bad_urls_and_sizes():
    with pytest.raises(ValueError, match="without /v1"):
        Gateway("http://x:1/v1", "k")
    with pytest.raises(ValueError, match="http"):
        Gateway("x:1", "k")
    with Gateway(URL, "k") as gw, pytest.raises(ValueError, match="at least one"):
        gw.group("t", size=0)


async def test_unknown_group_is_a_gateway_error(gw_mock):
    gw_mock.get("/v1/groups/nope").respond(404, json={"error": {"message": "no group", "code": "not_found"}})
    async with AsyncGateway(URL, "admin") as gw:
        with pytest.raises(GatewayError, match="404: no group"):
            await gw.group_status("nope")
