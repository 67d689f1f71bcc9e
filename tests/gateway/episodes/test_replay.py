"""The captured Claude Code and Codex runs (``agent_traffic/``) replayed through the gateway: one episode
per run, its threads and segments joined by the right typed edges, and one token-exact row per segment.

Each run is replayed request by request with the CLI's own headers and bodies (the agent key in place of
the redacted one; implicit mode), over the scripted stand-in engine answering what the fake answered (see
``tests/gateway/episodes/replay.py``). In-process over ASGI here, over a real socket in one test, and on
PostgreSQL + Redis in another.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from agentrl.trajectory import export_session, turn_from_interaction
from gateway.episodes import compaction, table
from tests.conftest import REDIS_URL
from tests.gateway.episodes.conftest import ADMIN, AGENT, Gw
from tests.gateway.episodes.replay import Replayer, load, role_of, scripted_replies, sse_events
from tests.inprocess import serve


async def replay(gw: Gw, rows: list[dict[str, Any]], http: httpx.AsyncClient | None = None) -> Replayer:
    player = Replayer(http or gw.http, AGENT, rows)
    await player.run()
    return player


async def episode(gw: Gw, answers: list[str]) -> tuple[str, list[Any], dict[tuple[str, str], table.ThreadRow]]:
    """The one session every answer was recorded in, its turns and its thread rows."""
    turns = [await gw.store.get_interaction(interaction_id=a) for a in answers]
    sessions = {t.session_id for t in turns}
    assert len(sessions) == 1, f"one run must be one episode, got {len(sessions)} sessions"
    sid = sessions.pop()
    rows = {(r.thread, r.segment): r for r in await table.session_threads(gw.store, sid)}
    return sid, turns, rows


async def check_rows(gw: Gw, sid: str, turns: list[Any]) -> list[Any]:
    """Export the episode: one row per leaf, each within ONE thread segment (summarizer branches share
    their segment's prefix), token-exact against the store, all carrying the episode's reward."""
    stored = await gw.store.session_interactions(session_id=sid)
    rows = export_session([turn_from_interaction(t) for t in stored], gamma=0.9, session_reward=1.0,
                          session_id=sid, group_id="g")
    label = {t.id: (t.request["episode"]["thread"], t.request["episode"]["segment"]) for t in stored}
    leaves = {t.id for t in stored} - {t.parent_id for t in stored}
    assert {r.leaf_id for r in rows} == leaves
    for row in rows:
        assert len({label[i] for i in row.turn_interaction_ids}) == 1, "a row crossed a thread or segment"
        assert row.input_ids.tolist() == await gw.store.full_sequence(interaction_id=row.leaf_id)
        assert row.reward == 1.0 and row.session_id == sid
    return rows


def thread_rows(rows: dict[tuple[str, str], table.ThreadRow], kind: str) -> list[table.ThreadRow]:
    return sorted((r for r in rows.values() if r.kind == kind), key=lambda r: r.created_at)


def calls_of(turn: Any) -> list[str]:
    return [c["id"] for c in turn.response_message.get("tool_calls") or []]


# ---------------------------------------------------------------------------------------------- sub-agents


async def test_claude_subagent_is_a_thread_spawned_by_the_agent_call(episode_gw: Any) -> None:
    rows = load("A1_claude_subagent.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        player = await replay(gw, rows)
        sid, turns, threads = await episode(gw, player.answers)
        main1, sub1, sub2, main2 = turns
        (main,), (sub,) = thread_rows(threads, "main"), thread_rows(threads, "subagent")
        assert (main.status, main.edge, main.first_turn) == ("root", None, main1.id)
        assert main.episode_key == "claude_code:" + rows[0]["headers"]["X-Claude-Code-Session-Id"]
        assert sub.thread == rows[1]["headers"]["x-claude-code-agent-id"] and sub.first_turn == sub1.id
        assert (sub.edge, sub.from_turn, sub.from_call, sub.status) == ("spawned_by", main1.id, calls_of(main1)[0],
                                                                         "confirmed")
        # within each thread, stitching as usual; each thread its own root
        assert (sub1.parent_id, sub2.parent_id, main2.parent_id) == (None, sub1.id, main1.id)
        exported = await check_rows(gw, sid, turns)
        assert sorted(len(r.turn_interaction_ids) for r in exported) == [2, 2]
        metrics = (await gw.http.get("/metrics")).text
        assert 'agentrl_gateway_episode_links_total{client="claude_code",edge="spawned_by",outcome="linked"} 1.0' in metrics
        assert 'outcome="confirmed"} 1.0' in metrics


async def test_claude_parallel_subagents_link_to_their_own_calls(episode_gw: Any) -> None:
    rows = load("A1b_claude_subagent_parallel.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        player = await replay(gw, rows)
        sid, turns, threads = await episode(gw, player.answers)
        subs = thread_rows(threads, "subagent")
        spawner = turns[0]
        assert len(subs) == 2 and len(calls_of(spawner)) == 2
        # each sub-agent to the call whose prompt it was given, confirmed by the tool results' agentIds
        by_prompt = {json.loads(c["function"]["arguments"])["prompt"]: c["id"]
                     for c in spawner.response_message["tool_calls"]}
        for sub in subs:
            first = next(t for t in turns if t.id == sub.first_turn)
            prompt = first.request["messages"][-1]["content"] if first.request["messages"][-1]["role"] == "user" \
                else next(m["content"] for m in reversed(first.request["messages"]) if m["role"] == "user")
            assert sub.from_call == next(c for p, c in by_prompt.items() if prompt.endswith(p))
            assert (sub.from_turn, sub.status) == (spawner.id, "confirmed")
        await check_rows(gw, sid, turns)


async def test_claude_background_subagent_confirmed_by_its_result(episode_gw: Any) -> None:
    rows = load("A1c_claude_subagent_background.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        player = await replay(gw, rows)
        sid, turns, threads = await episode(gw, player.answers)
        (sub,) = thread_rows(threads, "subagent")
        assert (sub.edge, sub.from_turn, sub.status) == ("spawned_by", turns[0].id, "confirmed")
        assert sub.from_call == calls_of(turns[0])[0]
        await check_rows(gw, sid, turns)


async def test_codex_spawn_agent_child_thread(episode_gw: Any) -> None:
    for name in ("A2_codex_subagent.jsonl", "A2b_codex_subagent_fork_context.jsonl"):
        rows = load(name)
        async with episode_gw(scripted_replies(rows)) as gw:
            player = await replay(gw, rows)
            sid, turns, threads = await episode(gw, player.answers)
            (main,), (child,) = thread_rows(threads, "main"), thread_rows(threads, "subagent")
            parent_thread = rows[0]["headers"]["thread-id"]
            assert main.thread == parent_thread and child.from_thread == parent_thread
            spawner = next(t for t in turns if any(c["function"]["name"] == "spawn_agent"
                                                   for c in t.response_message.get("tool_calls") or []))
            assert (child.edge, child.from_turn, child.status) == ("spawned_by", spawner.id, "confirmed"), name
            assert child.from_call == calls_of(spawner)[0]
            # the gateway's answer carried the namespace Codex requires for spawn_agent
            assert spawner.request["namespaces"]["spawn_agent"] == "multi_agent_v1"
            await check_rows(gw, sid, turns)


# ---------------------------------------------------------------------------------------------- compaction


async def test_codex_local_compaction_is_a_new_segment(episode_gw: Any) -> None:
    for name in ("B1_codex_compact_local_midturn.jsonl", "B1b_codex_compact_local_preturn_resume.jsonl"):
        rows = load(name)
        async with episode_gw(scripted_replies(rows)) as gw:
            player = await replay(gw, rows)
            sid, turns, threads = await episode(gw, player.answers)
            at = next(i for i, r in enumerate(rows) if role_of(r) == "compaction_summarizer")
            summarizer, after = turns[at], turns[at + 1]
            assert summarizer.request["episode"]["role"] == "summarizer"
            thread = rows[0]["headers"]["thread-id"]
            window = threads[(thread, "1")]
            assert (window.edge, window.from_segment, window.from_turn, window.status) == \
                ("compacted_from", "0", summarizer.id, "confirmed"), name
            assert window.first_turn == after.id and after.parent_id is None
            assert window.detail["replaced_leaf"] == turns[at - 1].id
            await check_rows(gw, sid, turns)


async def test_codex_remote_compaction_v2_answers_one_compaction_item(episode_gw: Any) -> None:
    rows = load("B1c_codex_compact_remote_v2_openai_provider.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        player = Replayer(gw.http, AGENT, rows)
        at = next(i for i, r in enumerate(rows) if role_of(r) == "remote_compaction_v2")
        for index in range(len(rows)):
            resp = await player.send(index)
            if index == at:
                events = sse_events(resp.text)
                done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
                final = next(e for e in events if e["type"] == "response.completed")["response"]
                assert len(done) == 1 and done[0]["type"] == "compaction" and final["output"] == done
                turn_id, summary = compaction.expand(done[0]["encrypted_content"], "x")
                assert turn_id == player.answers[at]
        sid, turns, threads = await episode(gw, player.answers)
        trigger = turns[at]
        assert trigger.request["episode"]["role"] == "compaction_trigger"
        assert summary == trigger.response_message["content"] and summary
        # the trigger continued its thread token-exact; the window after it starts from the summary
        assert trigger.parent_id == turns[at - 1].id
        after = turns[at + 1]
        assert compaction.SUMMARY_PREFIX + summary in json.dumps(after.request["messages"], ensure_ascii=False) \
            .encode().decode("unicode_escape") or any(m.get("content") == compaction.SUMMARY_PREFIX + summary
                                                     for m in after.request["messages"])
        window = threads[(rows[0]["headers"]["thread-id"], "1")]
        assert (window.edge, window.from_turn, window.status) == ("compacted_from", trigger.id, "confirmed")
        await check_rows(gw, sid, turns)


async def test_claude_compaction_auto_reactive_and_manual(episode_gw: Any) -> None:
    for name in ("B2_claude_autocompact_env_window.jsonl", "B2b_claude_reactive_compact_prompt_too_long.jsonl",
                 "B2c_claude_manual_compact_resume.jsonl"):
        # the fake's "prompt is too long" 400 (B2b) is not a turn: Claude compacts and sends again
        rows = [r for r in load(name) if (r.get("fake_reply") or {}).get("status", 200) == 200]
        async with episode_gw(scripted_replies(rows)) as gw:
            player = await replay(gw, rows)
            sid, turns, threads = await episode(gw, player.answers)
            at = next(i for i, r in enumerate(rows) if role_of(r) == "compaction_summarizer")
            summarizer = turns[at]
            assert summarizer.request["episode"]["role"] == "summarizer"
            segments = [r for r in threads.values() if r.thread == "main"]
            assert len(segments) == 2
            window = next(r for r in segments if r.segment != "0")
            assert (window.edge, window.from_segment, window.from_turn, window.status) == \
                ("compacted_from", "0", summarizer.id, "confirmed"), name
            assert next(t for t in turns if t.id == window.first_turn).parent_id is None
            await check_rows(gw, sid, turns)


# ---------------------------------------------------------------------------------- a real socket, PG + Redis


async def test_replay_over_a_real_socket(episode_gw: Any) -> None:
    rows = load("A1b_claude_subagent_parallel.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        async with serve(gw.app) as base_url:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
                player = await replay(gw, rows, http)
        sid, turns, threads = await episode(gw, player.answers)
        assert sorted(r.status for r in threads.values()) == ["confirmed", "confirmed", "root"]


async def test_replay_on_postgres_and_redis(episode_gw: Any, pg_url: str, redis_prefix: str) -> None:
    rows = load("A2_codex_subagent.jsonl")
    async with episode_gw(scripted_replies(rows), db=pg_url, redis=REDIS_URL, redis_prefix=redis_prefix) as gw:
        player = await replay(gw, rows)
        sid, turns, threads = await episode(gw, player.answers)
        (child,) = thread_rows(threads, "subagent")
        assert (child.edge, child.status) == ("spawned_by", "confirmed")
        await check_rows(gw, sid, turns)


# ------------------------------------------------------------------------------------------ what is not linked


async def test_an_unlinkable_subagent_is_recorded_counted_and_shown(episode_gw: Any) -> None:
    """A sub-agent whose task no pending Agent call gave (here: the main agent's spawning turn is left out
    of the replay) is kept in the episode, as a root, with status unlinked and the reason."""
    rows = load("A1_claude_subagent.jsonl")
    replies = scripted_replies(rows)
    rows[0] = {**rows[0], "fake_reply": {}}  # the main agent answers without an Agent call
    async with episode_gw(["I will do it myself.", *replies[1:3]]) as gw:
        first = Replayer(gw.http, AGENT, rows)
        await first.send(0)
        await first.send(1)
        sid, _, threads = await episode(gw, first.answers)
        (sub,) = thread_rows(threads, "subagent")
        assert (sub.edge, sub.status, sub.from_turn) == ("spawned_by", "unlinked", None)
        assert "no pending spawn call" in sub.detail["reason"]
        metrics = (await gw.http.get("/metrics")).text
        assert 'edge="spawned_by",outcome="unlinked"} 1.0' in metrics


async def test_the_threads_of_a_session_are_shown(episode_gw: Any) -> None:
    rows = load("B2_claude_autocompact_env_window.jsonl")
    async with episode_gw(scripted_replies(rows)) as gw:
        player = await replay(gw, rows)
        sid, turns, threads = await episode(gw, player.answers)
        shown = await gw.admin("GET", f"/v1/sessions/{sid}/threads")
        assert [(t["thread"], t["edge"], t["status"]) for t in shown["threads"]] == \
            [("main", None, "root"), ("main", "compacted_from", "confirmed")]
        assert shown["unlinked"] == 0 and set(shown["turns"]) == {t.id for t in turns}
        assert {v["role"] for v in shown["turns"].values()} == {"turn", "summarizer"}
        # the agent key that made the episode may read it; another session's key may not
        resp = await gw.http.get(f"/v1/sessions/{sid}/threads", headers={"Authorization": f"Bearer {AGENT}"})
        assert resp.status_code == 200
        other = await gw.admin("POST", "/v1/sessions", {})
        resp = await gw.http.get(f"/v1/sessions/{sid}/threads", headers={"Authorization": f"Bearer {other['api_key']}"})
        assert resp.status_code in (403, 404)


async def test_the_session_page_draws_threads_and_both_edges(episode_gw: Any) -> None:
    """A Claude run with a sub-agent and a Codex run with a compaction, on the trace viewer's session page."""
    for name, edge in (("A1_claude_subagent.jsonl", "spawned_by"), ("B1_codex_compact_local_midturn.jsonl",
                                                                      "compacted_from")):
        rows = load(name)
        async with episode_gw(scripted_replies(rows)) as gw:
            player = await replay(gw, rows)
            sid, turns, threads = await episode(gw, player.answers)
            resp = await gw.http.get(f"/ui/sessions/{sid}", headers={"Authorization": f"Bearer {ADMIN}"})
            assert resp.status_code == 200, resp.text[:500]
            page = resp.text
            section = page[page.index('id="threads"'):page.index("Rows export will produce")]
            child = next(r for r in threads.values() if r.edge == edge)
            assert f'class="edge {edge}"' in section and f'data-thread="{child.thread}"' in section
            assert f'href="#turn-{child.from_turn}"' in section and 'link-confirmed' in section
            # the child segment is drawn inside its parent's list
            parent_at = section.index(f'data-thread="{child.from_thread}" data-segment="{child.from_segment}"')
            child_at = section.index(f'data-thread="{child.thread}" data-segment="{child.segment}"')
            assert parent_at < child_at and "<ul>" in section[parent_at:child_at]
            assert section.count("<li") == len(threads)
            assert page.count("thread-badge") == len(turns)
