"""A coding CLI run once in implicit mode (agent key, no group) is one session of a group of the default
size; ``POST /v1/groups/{id}/close`` seals it as it stands, and it is exported at once, every row with the
episode's reward (nothing waits for the group timeout)."""

from __future__ import annotations

from typing import Any

import pytest

from agentrl.trajectory import decode_batch
from tests.gateway.episodes.conftest import ADMIN, AGENT
from tests.gateway.episodes.replay import Replayer, load, scripted_replies


@pytest.fixture(autouse=True)
def fast_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_GATEWAY_TICK_S", "0.05")
    monkeypatch.setenv("AGENTRL_GATEWAY_GROUP_SIZE", "4")


async def test_close_an_implicit_group_exports_the_run(episode_gw: Any) -> None:
    rows = load("A1_claude_subagent.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        player = Replayer(gw.http, AGENT, rows)
        await player.run()
        turn = await gw.store.get_interaction(interaction_id=player.answers[0])
        session = await gw.store.get_session(session_id=turn.session_id)
        agent = {"Authorization": f"Bearer {AGENT}"}
        admin = {"Authorization": f"Bearer {ADMIN}"}
        resp = await gw.http.post("/reward", json={"session_id": session.id, "reward": 1.0}, headers=agent)
        assert resp.status_code == 200, resp.text
        resp = await gw.http.post(f"/v1/sessions/{session.id}/finish", headers=agent)
        assert resp.status_code == 200, resp.text
        # a group of 4 with one session: nothing to lease until the group timeout ...
        resp = await gw.http.get("/v1/trajectories", params={"max_groups": 1, "wait_s": 0.5}, headers=admin)
        assert resp.status_code == 204
        # ... or until it is closed
        assert (await gw.http.post("/v1/groups/no-such-group/close", headers=admin)).status_code == 404
        resp = await gw.http.post(f"/v1/groups/{session.group_id}/close", headers=admin)
        assert resp.status_code == 200, resp.text
        assert resp.json()["status"] in ("finished", "exported")
        resp = await gw.http.get("/v1/trajectories", params={"max_groups": 1, "wait_s": 30}, headers=admin)
        assert resp.status_code == 200, resp.text
        batch, meta = decode_batch(resp.content)
        assert [g["group_id"] for g in meta["groups"]] == [session.group_id]
        # the main thread and the sub-agent: two rows of one episode, one reward
        assert len(batch) == 2 and {r.session_id for r in batch} == {session.id}
        assert [r.reward for r in batch] == [1.0, 1.0] and len({r.grpo_group for r in batch}) == 1
