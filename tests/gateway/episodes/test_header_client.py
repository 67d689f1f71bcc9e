"""Any other client links its threads with ``X-AgentRL-Parent-Response`` (and ``X-AgentRL-Link``,
``X-AgentRL-Thread``), here the real ``openai`` SDK on chat completions in implicit mode (agent key)."""

from __future__ import annotations

from typing import Any

import openai

from gateway.episodes import table
from tests.gateway.episodes.conftest import AGENT


async def test_a_sub_agent_and_a_compaction_named_by_header(episode_gw: Any) -> None:
    async with episode_gw(["Delegating.", "Sub-task done.", "Checked.", "Continuing from the summary."]) as gw:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=AGENT, http_client=gw.http, max_retries=0)
        main_msgs = [{"role": "user", "content": "Write the report."}]
        main = await client.chat.completions.create(model="m", messages=main_msgs, max_tokens=16)
        spawn = {"X-AgentRL-Parent-Response": main.id}
        sub_msgs = [{"role": "system", "content": "You are a helper."}, {"role": "user", "content": "Find the data."}]
        sub1 = await client.chat.completions.create(model="m", messages=sub_msgs, max_tokens=16, extra_headers=spawn)
        sub_msgs += [{"role": "assistant", "content": sub1.choices[0].message.content},
                     {"role": "user", "content": "Check it."}]
        sub2 = await client.chat.completions.create(model="m", messages=sub_msgs, max_tokens=16, extra_headers=spawn)
        window = await client.chat.completions.create(
            model="m", max_tokens=16, messages=[{"role": "user", "content": "Summary: the report is half done."}],
            extra_headers={"X-AgentRL-Parent-Response": main.id, "X-AgentRL-Link": "compaction"})
        turns = {r.id: await gw.store.get_interaction(interaction_id=r.id) for r in (main, sub1, sub2, window)}
        sessions = {t.session_id for t in turns.values()}
        assert len(sessions) == 1  # one episode
        sid = sessions.pop()
        assert (turns[sub1.id].parent_id, turns[sub2.id].parent_id, turns[window.id].parent_id) == (None, sub1.id, None)
        rows = {(r.thread, r.segment): r for r in await table.session_threads(gw.store, sid)}
        sub = rows[(f"child-of-{main.id}", "0")]
        assert (sub.kind, sub.edge, sub.from_turn, sub.status, sub.first_turn) == \
            ("subagent", "spawned_by", main.id, "confirmed", sub1.id)
        comp = rows[("main", f"after-{main.id}")]
        assert (comp.edge, comp.from_turn, comp.from_thread, comp.status) == ("compacted_from", main.id, "main", "confirmed")
        assert len(rows) == 2  # the main thread's requests carried no episode header: no row of its own


async def test_a_parent_response_that_does_not_exist_is_shown_not_guessed(episode_gw: Any) -> None:
    async with episode_gw(["Hello."]) as gw:
        client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key=AGENT, http_client=gw.http, max_retries=0)
        reply = await client.chat.completions.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
            extra_headers={"X-AgentRL-Parent-Response": "chatcmpl-nope", "X-AgentRL-Link": "merge"})
        turn = await gw.store.get_interaction(interaction_id=reply.id)
        notes = turn.request["episode"]["notes"]
        assert any("not a recorded response" in n for n in notes) and any("merge" in n for n in notes)
        (row,) = await table.session_threads(gw.store, turn.session_id)
        assert (row.edge, row.status, row.from_turn) == ("spawned_by", "unlinked", None)
        assert "not a turn of this session" in row.detail["reason"]
        metrics = (await gw.http.get("/metrics")).text
        assert 'agentrl_gateway_episode_links_total{client="header",edge="spawned_by",outcome="unlinked"} 1.0' in metrics
        assert 'outcome="bad_signal"} 1.0' in metrics
