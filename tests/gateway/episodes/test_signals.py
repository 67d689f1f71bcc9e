"""The episode signals of the captured requests (``agent_traffic/``): every request of each run, read by
``gateway.episodes.signals.read_signals`` exactly as the gateway reads it."""

from __future__ import annotations

import json

from gateway.episodes.signals import MAIN, Confirmation, read_signals, spawn_calls
from tests.gateway.episodes.replay import api_of, load


def signals_of(name: str) -> list:
    out = []
    for row in load(name):
        headers = dict(row["headers"])
        if "headers_parsed" in row and row["headers_parsed"].get("x-codex-turn-metadata"):
            headers["x-codex-turn-metadata"] = json.dumps(row["headers_parsed"]["x-codex-turn-metadata"])
        out.append(read_signals(headers, row["body"], api_of(row)))
    return out


def test_claude_subagent_thread_task_text_and_confirmation() -> None:
    main1, sub1, sub2, main2 = signals_of("A1_claude_subagent.jsonl")
    assert {s.client for s in (main1, sub1, sub2, main2)} == {"claude_code"}
    assert len({s.episode for s in (main1, sub1, sub2, main2)}) == 1
    assert (main1.thread, main2.thread) == (MAIN, MAIN)
    assert sub1.thread == sub2.thread == "a4f6bcd597e6e9a35"
    assert sub1.spawn_text.startswith("SUBTASK-7f3a: create a file hello.txt")
    assert main1.confirmations == [] and sub1.confirmations == []
    assert main2.confirmations == [Confirmation("toolu_b6352ad590f244ff941a26de", "a4f6bcd597e6e9a35")]
    assert {s.role for s in (main1, sub1, sub2, main2)} == {"turn"}


def test_claude_parallel_and_background_agents() -> None:
    parallel = signals_of("A1b_claude_subagent_parallel.jsonl")
    subs = {s.thread for s in parallel if s.thread != MAIN}
    assert len(subs) == 2
    last = [s for s in parallel if s.thread == MAIN][-1]
    assert {c.thread for c in last.confirmations} == subs
    background = signals_of("A1c_claude_subagent_background.jsonl")
    named = [c for s in background for c in s.confirmations]
    # the immediate "Async agent launched" result and the later <task-notification> name the same pair
    assert named and len({(c.call_id, c.thread) for c in named}) == 1


def test_claude_compaction_summarizer_and_new_segment() -> None:
    sigs = signals_of("B2_claude_autocompact_env_window.jsonl")
    roles = [s.role for s in sigs]
    assert roles.count("summarizer") == 1
    at = roles.index("summarizer")
    assert all(s.segment == "0" for s in sigs[: at + 1])
    after = {s.segment for s in sigs[at + 1:]}
    assert len(after) == 1 and after != {"0"}


def test_codex_spawn_parent_thread_and_turn() -> None:
    sigs = signals_of("A2_codex_subagent.jsonl")
    parent = [s for s in sigs if s.parent_thread is None]
    child = [s for s in sigs if s.parent_thread is not None]
    assert parent and child and all(s.client == "codex" for s in sigs)
    assert {s.thread for s in parent} == {parent[0].episode}
    assert {s.parent_thread for s in child} == {parent[0].episode}
    assert {s.parent_turn for s in child} == {parent[0].client_turn}
    assert child[0].spawn_text.startswith("SUBTASK-7f3a")
    confirmed = [c for s in parent for c in s.confirmations]
    assert confirmed and {c.thread for c in confirmed} == {child[0].thread}


def test_codex_local_and_remote_compaction() -> None:
    local = signals_of("B1_codex_compact_local_midturn.jsonl")
    assert [s.role for s in local].count("summarizer") == 1
    summarizer = next(s for s in local if s.role == "summarizer")
    assert summarizer.segment == "0" and {s.segment for s in local[local.index(summarizer) + 1:]} == {"1"}
    remote = signals_of("B1c_codex_compact_remote_v2_openai_provider.jsonl")
    trigger = [s for s in remote if s.role == "compaction_trigger"]
    assert len(trigger) == 1 and trigger[0].segment == "0"
    assert remote[-1].segment == "1"


def test_header_client_and_bad_values() -> None:
    sig = read_signals({"X-AgentRL-Parent-Response": "chatcmpl-1"}, {"messages": []}, "messages")
    assert (sig.client, sig.parent_response, sig.link, sig.thread) == ("header", "chatcmpl-1", "spawn",
                                                                       "child-of-chatcmpl-1")
    bad = read_signals({"X-AgentRL-Parent-Response": "r", "X-AgentRL-Link": "merge"}, {}, "responses")
    assert bad.link == "spawn" and bad.problems
    codex = read_signals({"session-id": "S", "thread-id": "S", "x-codex-turn-metadata": "{not json"},
                         {"input": "hi"}, "responses")
    assert codex.client == "codex" and codex.problems and codex.segment == "0"
    assert read_signals({}, {"messages": []}, "messages").client is None


def test_spawn_calls_of_an_answer() -> None:
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "Agent", "arguments": '{"prompt": "do x"}'}},
        {"id": "t2", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
        {"id": "t3", "type": "function", "function": {"name": "spawn_agent", "arguments": '{"message": "do y"}'}},
        {"id": "t4", "type": "function", "function": {"name": "Agent", "arguments": "not json"}}]}
    assert spawn_calls(message) == [("t1", "do x"), ("t3", "do y")]
