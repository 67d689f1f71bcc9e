"""agentrl.client against a real gateway process (over the shared tiny engine): a group's episodes talk to
the model through the real `openai` SDK, rewards land, the staleness budget's 429 + Retry-After is waited
out, and a finished / trained-on session is refused as it should be."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from agentrl.client import AsyncGateway, Gateway, SessionNotActive
from agentrl.trajectory import LEASE_HEADER
from tests.gateway.conftest import engine_url, gateway_factory  # noqa: F401  (fixtures used here)

HELLO = [{"role": "user", "content": "What is 2 + 2?"}]


def admin(gw) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, headers={"Authorization": f"Bearer {gw.admin_key}"}, timeout=60)


async def test_group_runs_rewards_and_finishes_through_a_real_gateway(gateway_factory, caplog):  # noqa: F811
    gw = gateway_factory()
    async with AsyncGateway(gw.base_url, gw.admin_key) as client:
        async with client.group("task-a", size=2) as group:
            async def one(episode):
                async with episode:
                    sdk = episode.async_openai(max_retries=0)
                    reply = await sdk.chat.completions.create(model=episode.model, messages=HELLO, max_tokens=4)
                    await episode.reward(0.25, response_id=reply.id)
                    await episode.reward(1.0)
                    return reply.id
            ids = await asyncio.gather(*(one(e) for e in group))
    with admin(gw) as http:
        for episode, response_id in zip(group, ids):
            tree = http.get(f"/v1/sessions/{episode.session_id}").json()
            session = tree["session"]
            assert session["status"] in ("finished", "consumed") and session["group_id"] == group.group_id
            assert session["task_id"] == "task-a" and session["reward"] == 1.0
            assert [(n["id"], n["reward"]) for n in tree["roots"]] == [(response_id, 0.25)]
    assert [e.status for e in group] == ["finished", "finished"]
    assert "no POST /v1/groups" not in caplog.text  # reserved whole, not one session at a time
    with admin(gw) as http:
        described = http.get(f"/v1/groups/{group.group_id}").json()
    assert described["size"] == 2 and sorted(s["session_id"] for s in described["sessions"]) == \
        sorted(e.session_id for e in group)

    # a finished session's model calls are refused (409), through the episode's own SDK client
    with pytest.raises(openai.ConflictError):
        await group[0].async_openai(max_retries=0).chat.completions.create(
            model=group[0].model, messages=HELLO, max_tokens=2)


def test_budget_429_is_waited_out_and_a_trained_session_refuses_rewards(gateway_factory, caplog):  # noqa: F811
    gw = gateway_factory(extra_args=["--retry-after-s", "1"])
    with admin(gw) as http, Gateway(gw.base_url, gw.admin_key, admission_wait_s=120) as client:
        # budget: (k + v + 1) x B x G = (0 + 0 + 1) x 1 x 2 = 2 sessions
        r = http.post("/admin/trainer", json={"version": 0, "batch_size": 1, "staleness_bound": 0, "group_size": 2})
        assert r.status_code == 200 and r.json()["trainer"]["limit"] == 2, r.text
        first = client.group("t1", size=2)
        for episode in first:
            reply = episode.openai(max_retries=0).chat.completions.create(model=episode.model, messages=HELLO,
                                                                            max_tokens=2)
            episode.reward(1.0, response_id=reply.id)
        first.finish()

        # the next group is refused (budget full) until the trainer moves on: the client waits

        def trainer_steps() -> None:
            while client.counters.backoffs_429 == 0:
                threading.Event().wait(0.2)
            # one step on (k = 1 keeps the first group's version-0 tokens leasable)
            http.post("/admin/trainer", json={"version": 1, "batch_size": 1, "staleness_bound": 1, "group_size": 2})

        stepper = threading.Thread(target=trainer_steps)
        stepper.start()
        second = client.group("t2", size=2)
        stepper.join()
        assert client.counters.backoffs_429 >= 1 and len(second) == 2
        assert "no POST /v1/groups" not in caplog.text

        # the first group is trained on (leased and acknowledged): its sessions take no more rewards
        resp = http.get("/v1/trajectories", params={"max_groups": 1, "wait_s": 20}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert http.post("/v1/trajectories/ack", json={"lease_id": resp.headers[LEASE_HEADER]}).status_code == 200
        with pytest.raises(SessionNotActive) as info:
            first[0].reward(0.5)
        assert info.value.status == 409


async def test_an_error_in_the_block_abandons_the_group_on_the_gateway(gateway_factory):  # noqa: F811
    gw = gateway_factory()
    async with AsyncGateway(gw.base_url, gw.admin_key) as client:
        with pytest.raises(RuntimeError, match="agent crashed"):
            async with client.group("task-b", size=3) as group:
                async with group[0]:
                    pass  # finished
                raise RuntimeError("agent crashed")
        described = await client.group_status(group.group_id)
    statuses = {s["session_id"]: s["status"] for s in described["sessions"]}
    assert statuses[group[1].session_id] == statuses[group[2].session_id] == "abandoned"
    assert [e.status for e in group] == ["finished", "abandoned", "abandoned"]


async def test_an_episode_function_run_shows_a_progress_bar_and_reports_rewards_only(gateway_factory, capsys):  # noqa: F811
    """`agentrl up --agent module:function` and `agentrl eval` run episodes through run_episodes: a progress
    bar of episodes (there was none for 200 s on 2026-12-04) and a summary without accuracy fields."""
    from agentrl.episodes import run_episodes

    async def episode(client, task):
        reply = await client.async_openai(max_retries=0).chat.completions.create(
            model=client.model, messages=HELLO, max_tokens=2, temperature=client.temperature)
        return 1.0 if reply.id else 0.0

    gw = gateway_factory()
    summary = await run_episodes(episode, [{"id": "t-1"}, {"id": "t-2"}], gateway=gw.base_url, key=gw.admin_key,
                                 group_size=2, eval=True, temperature=0.0, progress=True)
    assert summary["episodes"] == 4 and summary["failed"] == 0 and summary["mean_reward"] == 1.0
    assert not any(key.startswith("accuracy") for key in summary)
    bar = capsys.readouterr().err
    assert "eval: 100%" in bar and "4/4" in bar and "reward=1.000" in bar


async def test_a_sub_agent_from_episode_child_is_a_thread_of_the_episode(gateway_factory):  # noqa: F811
    """``episode.child(response_id)`` hands a sub-agent its own SDK client on the episode's session: its turns
    are recorded in that session as a thread ``spawned_by`` the main turn (GET /v1/sessions/{id}/threads), and
    a compacted window (``link="compaction"``) as ``compacted_from`` it; the main thread is left as it was."""
    gw = gateway_factory()
    async with AsyncGateway(gw.base_url, gw.admin_key) as client:
        async with client.group("task-child", size=1) as group:
            (episode,) = list(group)
            async with episode:
                main = await episode.async_openai(max_retries=0).chat.completions.create(
                    model=episode.model, messages=HELLO, max_tokens=4)
                helper = episode.child(main.id).async_openai(max_retries=0)
                sub = await helper.chat.completions.create(
                    model=episode.model, max_tokens=4,
                    messages=[{"role": "system", "content": "You are a helper."}, {"role": "user", "content": "Add."}])
                window = await episode.child(main.id, link="compaction").async_openai(
                    max_retries=0).chat.completions.create(
                    model=episode.model, max_tokens=4, messages=[{"role": "user", "content": "Summary: 2 + 2 asked."}])
                await episode.reward(1.0)
    with admin(gw) as http:
        listing = http.get(f"/v1/sessions/{episode.session_id}/threads").json()
    edges = {(t["edge"], t["from_turn"], t["status"]) for t in listing["threads"]}
    assert ("spawned_by", main.id, "confirmed") in edges and ("compacted_from", main.id, "confirmed") in edges
    assert listing["turns"][sub.id]["thread"] != listing["turns"].get(main.id, {}).get("thread", "main")
    assert window.id in listing["turns"]
    with pytest.raises(ValueError, match="link"):
        episode.child(main.id, link="merge")
    with pytest.raises(ValueError, match="response id"):
        episode.child("")
