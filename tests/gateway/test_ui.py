"""The trace viewer's JSON APIs and pages, in-process (``httpx.ASGITransport``) over a real SQLite store.

Sessions are recorded through the real ``openai`` SDK; the upstream is ``tests/standin.py`` (scripted
replies with the real tokenizer's ids, so that a turn can be a tool call). What the viewer shows is
checked against the store and the export code directly, and the GRPO advantages against hand-computed
numbers. The browser tests are in ``test_ui_browser.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentrl.trajectory import export_session, turn_from_interaction
from tests.inprocess import inprocess_gateway, tokenizer  # noqa: F401 (fixture)
from tests.standin import build_app
from gateway.store import Store
from gateway.ui.auth import COOKIE

ADMIN, AGENT = "admin-k", "agent-k"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Gw:
    def __init__(self, app: Any, http: httpx.AsyncClient) -> None:
        self.app, self.http = app, http

    @property
    def store(self) -> Store:
        return self.app.state.services.store  # type: ignore[no-any-return]

    def sdk(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=self.http, max_retries=0)

    async def get(self, path: str, key: str | None = ADMIN, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return await self.http.get(path, headers=headers, **kw)

    async def session(self, **body: Any) -> dict[str, Any]:
        resp = await self.http.post("/v1/sessions", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    async def reward(self, **body: Any) -> None:
        resp = await self.http.post("/reward", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text


@pytest.fixture
def make_gw(tmp_path: Path, tiny_model_dir: Path, tokenizer: Any) -> Callable[..., Any]:
    @asynccontextmanager
    async def make(replies: list[str], **overrides: Any) -> AsyncIterator[Gw]:
        engine = httpx.ASGITransport(app=build_app(str(tiny_model_dir), replies, tokenizer=tokenizer))
        async with inprocess_gateway(engine, tokenizer=tokenizer, **{
                "db": f"sqlite+aiosqlite:///{tmp_path}/gw.db", "admin_key": ADMIN, "agent_key": [AGENT],
                "gamma": 1.0, **overrides}) as (app, http):  # undiscounted: row rewards are the hand-set ones
            yield Gw(app, http)
    return make


def msg(m: Any) -> dict[str, Any]:
    return m.model_dump(exclude_none=True)  # type: ignore[no-any-return]


async def record(gw: Gw) -> dict[str, Any]:
    """Group g1 of two sessions. Session A: a tool call, its result, a retried follow-up (the first try is
    abandoned), then two branches from the answer. Session B: one turn. Rewards on turns and sessions."""
    a = await gw.session(group_id="g1", task_id="t1", metadata={"group_size": 2})
    b = await gw.session(group_id="g1", task_id="t1")
    ca = gw.sdk(a["api_key"])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."},
                                  {"role": "user", "content": "Weather in Paris?"}]
    r1 = await ca.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    call = r1.choices[0].message.tool_calls[0]
    msgs += [msg(r1.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    retry = await ca.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    r2 = await ca.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
    after = msgs + [msg(r2.choices[0].message)]
    r3 = await ca.chat.completions.create(model="m", messages=after + [{"role": "user", "content": "Thanks!"}],
                                          tools=TOOLS, max_tokens=64)
    r4 = await ca.chat.completions.create(model="m", messages=after + [{"role": "user", "content": "And Rome?"}],
                                          tools=TOOLS, max_tokens=3)
    rb = await gw.sdk(b["api_key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=64)
    await gw.reward(response_id=r3.id, reward=1.0)
    await gw.reward(response_id=r3.id, reward=0.5)  # replaced: the history keeps both
    await gw.reward(response_id=r4.id, reward=0.0)
    await gw.reward(session_id=b["session_id"], reward=2.0)
    return {"a": a, "b": b, "r1": r1.id, "retry": retry.id, "r2": r2.id, "r3": r3.id, "r4": r4.id, "rb": rb.id}


REPLIES = [CALL, "It is sunny.", "It is sunny in Paris.", "You are welcome!", "Rome is rainy today.", "Hi!"]


def nodes(tree: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node in tree:
        out[node["id"]] = node
        out.update(nodes(node["children"]))
    return out


async def test_session_tree_rows_and_tokens_match_the_store_and_export(make_gw: Any, tokenizer: Any) -> None:
    async with make_gw(REPLIES) as gw:
        ids = await record(gw)
        sid = ids["a"]["session_id"]
        resp = await gw.get(f"/ui/api/sessions/{sid}")
        assert resp.status_code == 200, resp.text
        data = resp.json()
        by_id = nodes(data["roots"])
        assert set(by_id) == {ids[k] for k in ("r1", "retry", "r2", "r3", "r4")}
        assert [r["id"] for r in data["roots"]] == [ids["r1"]]
        assert {c["id"] for c in by_id[ids["r1"]]["children"]} == {ids["retry"], ids["r2"]}
        assert {c["id"] for c in by_id[ids["r2"]]["children"]} == {ids["r3"], ids["r4"]}
        # the abandoned first try is marked dropped; the leaves that export keeps carry their rows
        assert data["dropped"] == [ids["retry"]] and by_id[ids["retry"]]["dropped"] is True
        assert not by_id[ids["retry"]]["exported"] and by_id[ids["r2"]]["exported"]
        turns = await gw.store.session_interactions(session_id=sid)
        assert gw.app.state.services.trajectories.settings.gamma == 1.0 and data["export"]["gamma"] == 1.0
        rows = export_session([turn_from_interaction(t) for t in turns], gamma=1.0, session_id=sid, group_id="g1")
        assert [r["leaf_id"] for r in data["rows"]] == [r.leaf_id for r in rows] == [ids["r3"], ids["r4"]]
        assert [r["reward"] for r in data["rows"]] == [0.5, 0.0]
        assert by_id[ids["r3"]]["row"]["turn_ids"] == [ids["r1"], ids["r2"], ids["r3"]]
        assert by_id[ids["r2"]]["row"] is None
        # messages as the agent sent them: the parent's path, its reply, then the new ones
        r3 = by_id[ids["r3"]]
        roles = [m["role"] for m in r3["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "user"] and r3["new_messages"] == 1
        assert r3["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert r3["messages"][3]["content"] == "sunny, 21 C" and r3["messages"][-1]["content"] == "Thanks!"
        assert by_id[ids["r1"]]["finish_reason"] == "tool_calls" and by_id[ids["r4"]]["finish_reason"] == "length"
        assert [h["reward"] for h in r3["reward_history"]] == [1.0, 0.5] and r3["reward"] == 0.5
        assert r3["versions"] == [0, 0] and r3["latency_ms"] > 0

        # the token view of a turn is its full sequence; only its own output is trained
        tok = (await gw.get(f"/ui/api/sessions/{sid}/turns/{ids['r3']}/tokens")).json()
        full = await gw.store.full_sequence(interaction_id=ids["r3"])
        t3 = next(t for t in turns if t.id == ids["r3"])
        tk = tok["tokens"]
        assert tk["ids"] == full and tok["path"] == [ids["r1"], ids["r2"], ids["r3"]]
        assert tk["loss_mask"] == [0] * (len(full) - len(t3.output_ids)) + [1] * len(t3.output_ids)
        assert tk["kind"].count("output") == len(t3.output_ids) and tk["kind"].count("prompt") == len(t3.prompt_ids)
        assert tk["logprobs"][-len(t3.output_ids):] == pytest.approx(t3.output_logprobs)
        assert tk["text"] == [tokenizer.decode([i]) for i in full]

        # the token view of a row is the exported row itself
        row = (await gw.get(f"/ui/api/sessions/{sid}/rows/{ids['r3']}/tokens")).json()
        assert row["row_id"] == rows[0].row_id
        assert row["tokens"]["ids"] == rows[0].input_ids.tolist()
        assert row["tokens"]["loss_mask"] == rows[0].loss_mask.tolist()
        assert row["tokens"]["versions"] == rows[0].versions.tolist()
        assert row["tokens"]["kind"].count("output") == int(rows[0].loss_mask.sum())
        assert (await gw.get(f"/ui/api/sessions/{sid}/rows/{ids['r2']}/tokens")).status_code == 404  # inner turn
        assert (await gw.get(f"/ui/api/sessions/{sid}/rows/{ids['retry']}/tokens")).status_code == 404  # dropped


async def test_bridge_tokens_are_labelled_and_individual_rows_shown(make_gw: Any) -> None:
    async with make_gw(["A long answer that gets cut off here.", "Ok."], export_mode="individual") as gw:
        s = await gw.session()
        client = gw.sdk(s["api_key"])
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Tell me"}]
        r1 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
        assert r1.choices[0].finish_reason == "length"
        msgs += [msg(r1.choices[0].message), {"role": "user", "content": "Go on"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs, max_tokens=20)
        t2 = await gw.store.get_interaction(interaction_id=r2.id)
        assert t2.parent_id == r1.id and t2.bridge_len > 0
        tk = (await gw.get(f"/ui/api/sessions/{s['session_id']}/turns/{r2.id}/tokens")).json()["tokens"]
        assert tk["kind"].count("bridge") == t2.bridge_len
        start = tk["kind"].index("bridge")
        assert tk["kind"][start - 1] == "context" and tk["kind"][start + t2.bridge_len] == "prompt"
        page = await gw.get(f"/ui/sessions/{s['session_id']}/turns/{r2.id}/tokens")
        assert page.text.count("k-bridge m0") >= t2.bridge_len
        # individual export: one row per turn, the inner turn included; only the row's own turn is trained
        detail = (await gw.get(f"/ui/api/sessions/{s['session_id']}")).json()
        assert detail["export"]["mode"] == "individual" and [r["leaf_id"] for r in detail["rows"]] == [r1.id, r2.id]
        t1 = await gw.store.get_interaction(interaction_id=r1.id)
        row = (await gw.get(f"/ui/api/sessions/{s['session_id']}/rows/{r2.id}/tokens")).json()
        assert row["tokens"]["ids"] == tk["ids"] and row["tokens"]["kind"] == [
            "prompt"] * len(t1.prompt_ids) + ["output"] * len(t1.output_ids) + tk["kind"][len(t1.prompt_ids) + len(t1.output_ids):]
        assert row["tokens"]["loss_mask"] == tk["loss_mask"] and row["row"]["turn_ids"] == [r2.id]
        inner = (await gw.get(f"/ui/api/sessions/{s['session_id']}/rows/{r1.id}/tokens")).json()
        assert sum(inner["tokens"]["loss_mask"]) == len(t1.output_ids) == inner["row"]["trained_tokens"]


async def test_sessions_list_filters_counts_and_keyset_pages(make_gw: Any) -> None:
    async with make_gw(REPLIES) as gw:
        ids = await record(gw)
        extra = [await gw.session(group_id="g2") for _ in range(3)]
        await gw.store.finish_session(session_id=extra[0]["session_id"])
        data = (await gw.get("/ui/api/sessions")).json()
        assert data["counts"] == {"active": 4, "finished": 1, "consumed": 0, "abandoned": 0} and data["total"] == 5
        listed = [s["id"] for s in data["sessions"]]
        assert listed[0] == extra[-1]["session_id"] and listed[-1] == ids["a"]["session_id"]  # newest first
        assert {s["id"]: s["turns"] for s in data["sessions"]}[ids["a"]["session_id"]] == 5
        assert data["next_cursor"] is None
        # keyset pages of 2 cover everything exactly once, in order
        seen: list[str] = []
        cursor = None
        while True:
            page = (await gw.get("/ui/api/sessions", params={"limit": 2, **({"cursor": cursor} if cursor else {})})).json()
            seen += [s["id"] for s in page["sessions"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == listed
        finished = (await gw.get("/ui/api/sessions?status=finished")).json()
        assert [s["id"] for s in finished["sessions"]] == [extra[0]["session_id"]] and finished["total"] == 1
        assert finished["counts"]["active"] == 4  # counts ignore the status filter
        g1 = (await gw.get("/ui/api/sessions?group=g1")).json()
        assert {s["id"] for s in g1["sessions"]} == {ids["a"]["session_id"], ids["b"]["session_id"]}
        rewarded = (await gw.get("/ui/api/sessions?min_reward=1.5")).json()
        assert [s["id"] for s in rewarded["sessions"]] == [ids["b"]["session_id"]]
        assert (await gw.get("/ui/api/sessions?max_reward=1")).json()["sessions"] == []
        b_created = next(s["created_at"] for s in data["sessions"] if s["id"] == ids["b"]["session_id"])
        newer = (await gw.get("/ui/api/sessions", params={"from": b_created})).json()
        assert ids["a"]["session_id"] not in {s["id"] for s in newer["sessions"]} and len(newer["sessions"]) == 4
        older = (await gw.get("/ui/api/sessions", params={"to": b_created})).json()
        assert [s["id"] for s in older["sessions"]] == [ids["a"]["session_id"]]
        iso = (await gw.get("/ui/api/sessions", params={"from": "2000-01-01T00:00:00"})).json()
        assert len(iso["sessions"]) == 5

        for params, param in (({"status": "bogus"}, "status"), ({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"),
                              ({"limit": "501"}, "limit"), ({"min_reward": "abc"}, "min_reward"),
                              ({"max_reward": "nan"}, "max_reward"), ({"from": "yesterday"}, "from"),
                              ({"cursor": "!!!"}, "cursor"), ({"cursor": "WzEsMl0"}, "cursor")):
            resp = await gw.get("/ui/api/sessions", params=params)
            assert resp.status_code == 400, (params, resp.text)
            assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error"
        page = await gw.get("/ui/sessions?limit=0")
        assert page.status_code == 400 and "limit must be" in page.text


async def test_group_advantages_are_the_trainers(make_gw: Any) -> None:
    async with make_gw(REPLIES) as gw:
        ids = await record(gw)
        data = (await gw.get("/ui/api/groups/g1")).json()
        [group] = data["grpo_groups"]
        assert group["size"] == 2 and group["complete"]
        a, b = group["sessions"]
        assert a["session"]["id"] == ids["a"]["session_id"] and b["session"]["id"] == ids["b"]["session_id"]
        # session A has two rows (0.5 and 0.0: counted once, as 0.25); session B one row (2.0)
        assert [r["reward"] for r in a["rows"]] == [0.5, 0.0] and a["reward"] == 0.25 and b["reward"] == 2.0
        std = math.sqrt(((0.25 - 1.125) ** 2 + (2.0 - 1.125) ** 2) / 1)  # unbiased, over sessions
        assert group["reward_mean"] == pytest.approx(1.125) and group["reward_std"] == pytest.approx(std)
        expected = [(0.5 - 1.125) / (std + 1e-6), (0.0 - 1.125) / (std + 1e-6), (2.0 - 1.125) / (std + 1e-6)]
        got = [r["advantage"] for r in a["rows"]] + [r["advantage"] for r in b["rows"]]
        assert got == pytest.approx(expected, rel=1e-5) and group["zero_variance"] is False
        dr = (await gw.get("/ui/api/groups/g1?estimator=dr_grpo")).json()["grpo_groups"][0]
        assert [r["advantage"] for r in dr["sessions"][1]["rows"]] == pytest.approx([0.875])
        bad = await gw.get("/ui/api/groups/g1?estimator=ppo")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "estimator"
        assert (await gw.get("/ui/api/groups/nope")).status_code == 404
        page = await gw.get("/ui/groups/g1")
        assert page.status_code == 200 and page.text.count('class="card session-card"') == 2


async def test_trainer_reports_are_charted(make_gw: Any) -> None:
    async with make_gw(REPLIES) as gw:
        empty = (await gw.get("/ui/api/trainer")).json()
        assert empty["reports"] == [] and empty["charts"][0]["n"] == 0 and empty["trainer"] is None
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for step, (reward, gap) in enumerate([(0.1, 1e-3), (0.4, 2e-3), (0.3, float("nan"))], start=1):
            body: dict[str, Any] = {"version": step, "batch_size": 2, "staleness_bound": 1,
                                    "metrics": {"step": step, "reward/mean": reward, "note": "text"}}
            if not math.isnan(gap):
                body["metrics"]["logprob_gap/mean"] = gap
            resp = await gw.http.post("/admin/trainer", json=body, headers=admin)
            assert resp.status_code == 200, resp.text
        data = (await gw.get("/ui/api/trainer")).json()
        assert [e["metrics"] for e in data["reports"]] == [
            {"step": 1.0, "reward/mean": 0.1, "logprob_gap/mean": 1e-3},
            {"step": 2.0, "reward/mean": 0.4, "logprob_gap/mean": 2e-3},
            {"step": 3.0, "reward/mean": 0.3}]
        reward_chart, gap_chart = data["charts"]
        assert reward_chart["n"] == 3 and gap_chart["n"] == 2 and reward_chart["last"] == 0.3
        assert data["trainer"]["version"] == 3 and data["trainer"]["staleness_bound"] == 1
        assert data["queue"]["ready"] == 0 and data["weight_version"] == 0
        page = await gw.get("/ui/trainer")
        assert page.status_code == 200 and page.text.count("<polyline") == 2


async def test_auth_read_only_and_unknown_ids(make_gw: Any) -> None:
    async with make_gw(REPLIES) as gw:
        ids = await record(gw)
        sid = ids["a"]["session_id"]
        for key, status, where in ((ADMIN, 303, "/ui/sessions"), (None, 303, "/ui/login"), (AGENT, 403, None),
                                   (ids["b"]["api_key"], 403, None)):
            for path in ("/ui", "/ui/"):
                resp = await gw.get(path, key=key)
                assert resp.status_code == status and resp.headers.get("location") == where, (path, key)
        pages = ["/ui/sessions", f"/ui/sessions/{sid}", f"/ui/sessions/{sid}/turns/{ids['r3']}/tokens",
                 f"/ui/sessions/{sid}/rows/{ids['r3']}/tokens", "/ui/groups/g1", "/ui/trainer"]
        apis = ["/ui/api" + p[3:] for p in pages]
        before = [(s.id, s.version, s.status, s.reward) for s in await gw.store.list_sessions()]
        for path in pages + apis:
            assert (await gw.get(path)).status_code == 200, path
            for key in (AGENT, ids["a"]["api_key"]):
                resp = await gw.get(path, key=key)
                assert resp.status_code == 403, (path, resp.status_code)
            assert (await gw.get(path, key="wrong")).status_code == (401 if "/api/" in path else 303)
        for path in apis:
            resp = await gw.get(path, key=None)
            assert resp.status_code == 401 and "login" in resp.json()["error"]["message"]
        for path in pages:
            resp = await gw.get(path, key=None)
            assert resp.status_code == 303 and resp.headers["location"] == "/ui/login"
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            for path in apis:
                resp = await gw.http.request(method, path, headers={"Authorization": f"Bearer {ADMIN}"})
                assert resp.status_code == 405, (method, path)
        after = [(s.id, s.version, s.status, s.reward) for s in await gw.store.list_sessions()]
        assert after == before

        for path in ("/ui/api/sessions/sess-nope", f"/ui/api/sessions/{sid}/turns/nope/tokens",
                     "/ui/api/sessions/sess-nope/turns/x/tokens", f"/ui/api/sessions/{sid}/rows/nope/tokens",
                     "/ui/api/groups/nope", "/ui/api/nothing"):
            assert (await gw.get(path)).status_code == 404, path
        page = await gw.get("/ui/sessions/sess-nope")
        assert page.status_code == 404 and "no session" in page.text

        # the header's search box: a session, a response id (-> its turn in the tree), a group
        for ident, kind, url in ((sid, "session", f"/ui/sessions/{sid}"),
                                 (ids["r3"], "turn", f"/ui/sessions/{sid}#turn-{ids['r3']}"),
                                 ("g1", "group", "/ui/groups/g1")):
            assert (await gw.get("/ui/api/find", params={"id": ident})).json() == {
                "kind": kind, **({"group_id": "g1"} if kind == "group" else {"session_id": sid}), "url": url}
            page = await gw.get("/ui/find", params={"id": ident})
            assert page.status_code == 303 and page.headers["location"] == url
        assert (await gw.get("/ui/api/find", params={"id": "nothing"})).status_code == 404
        assert (await gw.get("/ui/api/find")).status_code == 400
        assert (await gw.get("/ui/find", params={"id": "nothing"})).status_code == 404
        assert (await gw.get("/ui/api/find", params={"id": sid}, key=AGENT)).status_code == 403
        assert f'id="turn-{ids["r3"]}"' in (await gw.get(f"/ui/sessions/{sid}")).text

        # login: the form's key is checked like a bearer key; only the admin key gets the cookie
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        for key, status in ((AGENT, 403), (ids["a"]["api_key"], 403), ("wrong", 401), ("", 401)):
            resp = await gw.http.post("/ui/login", content=f"key={key}", headers=form)
            assert resp.status_code == status and COOKIE not in resp.cookies
        resp = await gw.http.post("/ui/login", content=f"key={ADMIN}", headers=form)
        assert resp.status_code == 303 and resp.headers["location"] == "/ui/sessions"
        cookie = resp.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        token = resp.cookies[COOKIE]
        gw.http.cookies.clear()
        assert ADMIN not in token and ADMIN not in cookie

        def jar(value: str) -> dict[str, str]:
            return {"Cookie": f"{COOKIE}={value}"}

        for path in pages + apis:
            assert (await gw.http.get(path, headers=jar(token))).status_code == 200, path
        assert (await gw.http.get("/v1/sessions/" + sid, headers=jar(token))).status_code == 401  # /ui only
        forged = re.sub(r"\.[0-9a-f]+$", ".00", token)
        assert (await gw.http.get("/ui/api/sessions", headers=jar(forged))).status_code == 401
        out = await gw.http.post("/ui/logout", headers=jar(token))
        assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]


async def test_recorded_text_cannot_inject_markup(make_gw: Any) -> None:
    """Messages, replies and ids are the agent's and the model's text: the pages escape them everywhere,
    token titles (attributes) included."""
    hostile = 'x" onmouseover="alert(1)" <script>alert(2)</script> & \'q\''
    async with make_gw([hostile]) as gw:
        s = await gw.session(group_id='g/"<b>?#')
        r = await gw.sdk(s["api_key"]).chat.completions.create(
            model="m", messages=[{"role": "user", "content": hostile}], max_tokens=64)
        for path in (f"/ui/sessions/{s['session_id']}", f"/ui/sessions/{s['session_id']}/turns/{r.id}/tokens",
                     f"/ui/sessions/{s['session_id']}/rows/{r.id}/tokens", "/ui/sessions"):
            html = (await gw.get(path)).text
            assert "<script>alert" not in html and 'onmouseover="alert' not in html, path
            assert "<b>?#" not in html
        html = (await gw.get(f"/ui/sessions/{s['session_id']}")).text
        assert "&lt;script&gt;alert(2)&lt;/script&gt;" in html  # shown, as text
        assert 'href="/ui/groups/g%2F%22%3Cb%3E%3F%23"' in html  # the group id as one path segment
        tokens = (await gw.get(f"/ui/sessions/{s['session_id']}/turns/{r.id}/tokens")).text
        assert re.search(r'title="#\d+ id \d+ &#34;[^"]*&#34;', tokens)  # JSON quotes escaped inside the attribute
