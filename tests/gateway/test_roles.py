"""Keys only reach what they own: agent keys their own implicit sessions; the runner key sessions, groups and
rewards but no engine control, leasing or trainer version; the admin key everything."""

from __future__ import annotations

from typing import Any

from tests.gateway.test_openai_inprocess import ADMIN, AGENT, make_gw, tokenizer  # noqa: F401 (fixtures)

RUNNER, OTHER_AGENT = "runner-k", "agent-k2"
HI = [{"role": "user", "content": "hi"}]


async def test_agent_keys_reach_only_their_own_implicit_sessions(make_gw: Any) -> None:
    async with make_gw(["a"], agent_key=[AGENT, OTHER_AGENT], runner_key=[RUNNER]) as gw:
        mine = await gw.sdk(AGENT).chat.completions.create(model="m", messages=HI, max_tokens=2)
        sid = (await gw.store.get_interaction(interaction_id=mine.id)).session_id
        explicit = (await gw.post("/v1/sessions", {}, key=RUNNER)).json()
        assert explicit["session_id"]

        for key, status in ((AGENT, 200), (OTHER_AGENT, 403), (RUNNER, 200)):
            resp = await gw.http.get(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == status, (key, resp.text)
        assert (await gw.post("/reward", {"response_id": mine.id, "reward": 1.0}, key=OTHER_AGENT)).status_code == 403
        assert (await gw.post("/reward", {"response_id": mine.id, "reward": 1.0}, key=AGENT)).status_code == 200
        # an agent key cannot read, reward, finish or generate in an explicit session
        esid = explicit["session_id"]
        assert (await gw.http.get(f"/v1/sessions/{esid}", headers={"Authorization": f"Bearer {AGENT}"})
                ).status_code == 403
        assert (await gw.post("/reward", {"session_id": esid, "reward": 1.0}, key=AGENT)).status_code == 403
        assert (await gw.post(f"/v1/sessions/{esid}/finish", {}, key=AGENT)).status_code == 403
        assert (await gw.post(f"/v1/sessions/{esid}/abandon", {}, key=AGENT)).status_code == 403
        chat = await gw.post(f"/sessions/{esid}/v1/chat/completions", {"messages": HI, "max_tokens": 2}, key=AGENT)
        assert chat.status_code == 403
        # the other agent key sending the same follow-up starts its own episode instead of joining mine
        follow = HI + [mine.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        theirs = await gw.sdk(OTHER_AGENT).chat.completions.create(model="m", messages=follow, max_tokens=2)
        assert (await gw.store.get_interaction(interaction_id=theirs.id)).session_id != sid
        again = await gw.sdk(AGENT).chat.completions.create(model="m", messages=follow, max_tokens=2)
        assert (await gw.store.get_interaction(interaction_id=again.id)).session_id == sid
        assert (await gw.post(f"/v1/sessions/{sid}/finish", {}, key=AGENT)).status_code == 200


async def test_the_runner_key_manages_sessions_but_not_engines_leases_or_the_trainer(make_gw: Any) -> None:
    async with make_gw(["a"], runner_key=[RUNNER]) as gw:
        created = await gw.post("/v1/sessions", {"group_id": "g"}, key=RUNNER)
        assert created.status_code == 200
        sid = created.json()["session_id"]
        assert (await gw.http.get("/v1/sessions", headers={"Authorization": f"Bearer {RUNNER}"})).status_code == 200
        assert (await gw.post("/reward", {"session_id": sid, "reward": 0.5}, key=RUNNER)).status_code == 200
        assert (await gw.post(f"/v1/sessions/{sid}/finish", {}, key=RUNNER)).status_code == 200
        denied = [
            await gw.post("/admin/pause", {}, key=RUNNER),
            await gw.post("/admin/resume", {"weight_version": 1}, key=RUNNER),
            await gw.post("/admin/trainer", {"version": 1, "batch_size": 1, "staleness_bound": 1}, key=RUNNER),
            await gw.http.get("/v1/trajectories", headers={"Authorization": f"Bearer {RUNNER}"}),
            await gw.post("/v1/trajectories/ack", {"lease_id": "x"}, key=RUNNER),
            await gw.post("/v1/sessions", {}, key=AGENT),
        ]
        assert [r.status_code for r in denied] == [403] * len(denied)
        assert not gw.svc.router.paused
