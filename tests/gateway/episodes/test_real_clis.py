"""End to end with the real CLIs (npm): Claude Code with a sub-agent, four attempts as one GRPO group run by
``agentrl group``, rewarded by a check of the file the sub-agent wrote, exported with every episode whole;
Codex with a spawned agent (``spawn_agent`` / ``wait_agent``), four attempts the same way; and Codex
compacting its context in the middle of a task (``model_auto_compact_token_limit``), still one episode.

The gateway runs in-process on a real socket (the CLIs are separate processes), over scripted stand-ins
chosen by the prompt (``tests/gateway/episodes/clis.py``): the main agent's task gets an ``Agent`` call,
the sub-agent's task a ``Bash`` call writing ``hello.txt`` (``hi`` for attempts 1 and 3, ``bye`` for 2 and
4, so that the group has a reward spread), and a tool result a final text. Skips, saying why, where npm
cannot install the CLIs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentrl.trajectory import decode_batch
from gateway.episodes import table
from gateway.episodes.compaction import TRIGGER_PROMPT
from tests.gateway.episodes.clis import (CLAUDE_HOME, CONTEXT, OPENAI_ENV, OPENAI_PROVIDER, TASK,
                                         ByPrompt, assert_one_compaction, attempt_logs, call, claude_command,
                                         claude_run, clis_or_skip, codex_command, run_group, served, standin_of)
from tests.gateway.episodes.conftest import ADMIN, tokenizer  # noqa: F401 (fixture)


async def test_claude_code_with_a_sub_agent_four_attempts_as_a_group(tiny_model_dir: Path, tokenizer: Any,  # noqa: F811
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    clis = await clis_or_skip()
    async with served(tiny_model_dir, tokenizer, tmp_path) as (base, app, engine):
        status, attempts, summary = await run_group(base, capsys, 4, "grep -qx hi hello.txt && echo 1 || echo 0",
                                                    claude_command(clis["claude"]))
        logs = Path(summary["attempts_dir"])
        assert status == 0, [(a, (logs / f"attempt-{a['index']}.log").read_text()[-2000:]) for a in attempts]
        assert [a["exit_code"] for a in attempts] == [0, 0, 0, 0]
        assert sorted(summary["rewards"]) == [0.0, 0.0, 1.0, 1.0]
        store = app.state.services.store
        for a in attempts:  # each attempt one episode: its main thread and the sub-agent it spawned
            rows = await table.session_threads(store, a["session_id"])
            kinds = sorted((r.kind, r.edge, r.status) for r in rows)
            assert kinds == [("main", None, "root"), ("subagent", "spawned_by", "confirmed")], kinds
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            resp = await http.get("/v1/trajectories", params={"max_groups": 1, "wait_s": 30},
                                  headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        batch, meta = decode_batch(resp.content)
        assert meta["groups"][0]["group_id"] == summary["group_id"] and meta["groups"][0]["complete"] is True
        by_session: dict[str, set[float]] = {}
        for row in batch:
            by_session.setdefault(row.session_id, set()).add(row.reward)
        assert len(by_session) == 4 and len(batch) >= 8  # at least the main thread and the sub-agent each
        rewards = {a["session_id"]: a["reward"] for a in attempts}
        assert all(got == {rewards[sid]} for sid, got in by_session.items())  # one reward per episode
        shutil.rmtree(logs)  # kept (--keep) only to show a failed attempt's output


CLAUDE_SUMMARIZER = "CRITICAL: Respond with TEXT ONLY"  # Claude Code's compaction instruction
FIRST = "FIRST-TASK-c41: create first.txt, then reply done."
SECOND = "SECOND-TASK-9e2: create second.txt, then reply done."


def claude_compact_script(prompt: str) -> str:
    """Claude Code over two tasks with a ``/compact`` between: the summarizer request writes a summary; a
    task's first turn runs ``Bash`` (``touch``), its second (after the tool result) is done."""
    if CLAUDE_SUMMARIZER in prompt.split("<|im_start|>user")[-1]:
        return "<analysis>One task done.</analysis>\n<summary>SUMMARY-c41: first.txt was created.</summary>"
    task = SECOND if SECOND in prompt else FIRST
    if prompt.split(task)[-1].count("<|im_start|>assistant") > 1:
        return "Done."
    return call("Bash", {"command": f"touch {'second' if task == SECOND else 'first'}.txt", "description": "Touch"})


async def test_claude_code_compacts_by_command_and_stays_one_episode(tiny_model_dir: Path, tokenizer: Any,  # noqa: F811
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """One attempt of three Claude Code runs on one kept session (``--session-id``, then ``--resume``): a
    task, ``/compact`` (Claude's summarizer request), and a second task, whose first request starts from the
    summary ("This session is being continued ..."). The gateway records them as one episode: the second
    window a segment ``compacted_from`` the first, confirmed, from the summarizer's turn."""
    clis = await clis_or_skip()
    make = standin_of(tiny_model_dir, tokenizer)

    small = ("--tools", "Bash", "--system-prompt", "You are a coding agent. Use your tools to do the task.")
    runs = [claude_run(clis["claude"], FIRST, *small) + ' --session-id "$SID"',
            claude_run(clis["claude"], "/compact", *small) + ' --resume "$SID"',
            claude_run(clis["claude"], SECOND, *small) + ' --resume "$SID"']
    command = ["sh", "-c", f"{CLAUDE_HOME} && SID=$(cat /proc/sys/kernel/random/uuid) && " + " && ".join(runs)]
    engine = ByPrompt({"done": make("Done.")}, tokenizer, claude_compact_script, make)
    async with served(tiny_model_dir, tokenizer, tmp_path, engine) as (base, app, _):
        status, (attempt,), summary = await run_group(
            base, capsys, 1, "test -f first.txt && test -f second.txt && echo 1 || echo 0", command)
        assert status == 0 and attempt["reward"] == 1.0, (attempt, attempt_logs(summary))
        await assert_one_compaction(app.state.services.store, attempt["session_id"])
    shutil.rmtree(summary["attempts_dir"])


CONTINUED = "This session is being continued from a previous conversation"
BIG_TASK = "BIG-TASK-5d0: show big1.txt, then big2.txt, then reply done."


def claude_reactive_script(prompt: str) -> str:
    """Claude Code reading two long files, one a turn, then done; the summarizer writes a summary, and the
    window after it (which starts from the summary) is done. Read by the files' end markers (``ByPrompt``
    sees only a prompt's last 4,000 tokens)."""
    if CLAUDE_SUMMARIZER in prompt.split("<|im_start|>user")[-1]:
        return "<analysis>Both files shown.</analysis>\n<summary>SUMMARY-5d0: big1.txt and big2.txt shown.</summary>"
    if CONTINUED in prompt or "END-OF-BIG2" in prompt:
        return "Done."
    return call("Bash", {"command": f"cat big{2 if 'END-OF-BIG1' in prompt else 1}.txt", "description": "Show"})


async def test_claude_code_compacts_on_prompt_too_long(tiny_model_dir: Path, tokenizer: Any,  # noqa: F811
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reactive compaction, live: a first run (the gateway's context large) measures the requests of a task
    that reads two long files; the second runs it with the gateway's context just under its last request,
    so that request is refused with Anthropic's "prompt is too long", Claude Code compacts (its summarizer
    request: the history less the last round, under the context) and sends again from the summary. One
    episode: the window after the summary ``compacted_from`` the first, confirmed."""
    clis = await clis_or_skip()
    make = standin_of(tiny_model_dir, tokenizer)

    small = ("--tools", "Bash", "--system-prompt", "You are a coding agent. Use your tools to do the task.")
    files = "(seq 1 1500; echo END-OF-BIG1) > big1.txt && (seq 2001 3500; echo END-OF-BIG2) > big2.txt"
    run = claude_run(clis["claude"], BIG_TASK, *small, "--max-turns", "8")  # a wrong answer cannot loop for ever
    command = ["sh", "-c", f"{CLAUDE_HOME} && {files} && {run}"]

    async def attempt(where: Path, context: int) -> list[int]:
        where.mkdir()
        engine = ByPrompt({"done": make("Done.")}, tokenizer, claude_reactive_script, make)
        async with served(tiny_model_dir, tokenizer, where, engine, context=context) as (base, app, _):
            status, (got,), summary = await run_group(base, capsys, 1, "echo 1", command)
            assert status == 0 and got["exit_code"] == 0, (got, attempt_logs(summary))
            shutil.rmtree(summary["attempts_dir"])
            store = app.state.services.store
            turns = sorted(await store.session_interactions(session_id=got["session_id"]), key=lambda t: t.created_at)
            sizes = [len(await store.full_sequence(interaction_id=t.id)) - len(t.output_ids) for t in turns]
            if context < CONTEXT:
                await assert_one_compaction(store, got["session_id"])
            return sizes

    sizes = await attempt(tmp_path / "probe", CONTEXT)
    assert len(sizes) == 3 and sizes[2] - sizes[1] > 2000, sizes  # the task's three requests; big2's output
    context = sizes[2] - 100
    sizes = await attempt(tmp_path / "tight", context)
    assert max(sizes) < context  # the refused request is not recorded; the summarizer's and the next fit


HUGE_TASK = "HUGE-TASK-b71: show huge1.txt, huge2.txt, ... one a turn, until told to stop."
HUGE_END = re.compile(r"END-OF-HUGE(\d)")


def claude_auto_script(prompt: str) -> str:
    """Claude Code showing files of some 28,000 tokens each, one a turn, until its context is compacted;
    the window after the summary is done."""
    if CLAUDE_SUMMARIZER in prompt.split("<|im_start|>user")[-1]:
        return "<analysis>Files shown.</analysis>\n<summary>SUMMARY-b71: the huge files were shown.</summary>"
    shown = [int(n) for n in HUGE_END.findall(prompt)]
    if CONTINUED in prompt or (shown and max(shown) >= 5):
        return "Done."
    return call("Bash", {"command": f"cat huge{max(shown, default=0) + 1}.txt", "description": "Show"})


async def test_claude_code_auto_compacts_with_a_configured_window(tiny_model_dir: Path, tokenizer: Any,  # noqa: F811
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Proactive auto-compaction, live: ``CLAUDE_CODE_AUTO_COMPACT_WINDOW=100000`` (its minimum) and tool
    results of some 28,000 tokens a turn, so that the usage the gateway reports (the real token counts)
    crosses Claude Code's threshold within five turns; it compacts and goes on from the summary, one
    episode."""
    clis = await clis_or_skip()
    make = standin_of(tiny_model_dir, tokenizer)

    small = ("--tools", "Bash", "--system-prompt", "You are a coding agent. Use your tools to do the task.",
             "--max-turns", "10")
    files = " && ".join(f"(seq {k}00000 {k}04000; echo END-OF-HUGE{k}) > huge{k}.txt" for k in range(1, 6))
    run = "CLAUDE_CODE_AUTO_COMPACT_WINDOW=100000 " + claude_run(clis["claude"], HUGE_TASK, *small)
    engine = ByPrompt({"done": make("Done.")}, tokenizer, claude_auto_script, make)
    async with served(tiny_model_dir, tokenizer, tmp_path, engine) as (base, app, _):
        status, (attempt,), summary = await run_group(
            base, capsys, 1, "echo 1", ["sh", "-c", f"{CLAUDE_HOME} && {files} && {run}"], timeout_s=300)
        assert status == 0 and attempt["exit_code"] == 0, (attempt, attempt_logs(summary))
        await assert_one_compaction(app.state.services.store, attempt["session_id"])
    shutil.rmtree(summary["attempts_dir"])


# ------------------------------------------------------------------------------------------------- Codex

AGENT_ID = re.compile(r'"agent_id":\s*"([^"]+)"')


def codex_script(prompt: str) -> str:
    """Codex: the parent spawns the child (``spawn_agent``), then waits for it (``wait_agent`` on the id the
    spawn's output gave), then is done; the child runs ``exec_command`` once, then is done."""
    answered = prompt.count("<|im_start|>assistant") - 1
    if answered == 0:
        return call("exec_command", {"cmd": "printf 'hi\\n' > hello.txt"}) if TASK in prompt \
            else call("spawn_agent", {"message": TASK})
    found = AGENT_ID.findall(prompt)
    if answered == 1 and found:
        return call("wait_agent", {"targets": [found[-1]], "timeout_ms": 60000})
    return "Done."


async def test_codex_with_a_spawned_agent_four_attempts_as_a_group(tiny_model_dir: Path, tokenizer: Any,  # noqa: F811
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    clis = await clis_or_skip()
    make = standin_of(tiny_model_dir, tokenizer)

    engine = ByPrompt({"done": make("Done.")}, tokenizer, codex_script, make)
    async with served(tiny_model_dir, tokenizer, tmp_path, engine) as (base, app, _):
        status, attempts, summary = await run_group(base, capsys, 4, "grep -qx hi hello.txt && echo 1 || echo 0",
                                                    codex_command(clis["codex"]))
        logs = Path(summary["attempts_dir"])
        assert status == 0 and [a["exit_code"] for a in attempts] == [0, 0, 0, 0], \
            [(a, (logs / f"attempt-{a['index']}" / f"attempt-{a['index']}.log").read_text()[-3000:]) for a in attempts]
        assert summary["rewards"] == [1.0, 1.0, 1.0, 1.0]
        store = app.state.services.store
        for a in attempts:
            rows = await table.session_threads(store, a["session_id"])
            kinds = sorted((r.kind, r.edge, r.status) for r in rows)
            assert kinds == [("main", None, "root"), ("subagent", "spawned_by", "confirmed")], kinds
        shutil.rmtree(logs)


STEPS_PROMPT = ("Create step1.txt, step2.txt and step3.txt, one command per turn, then reply done.")
COMPACT = "CONTEXT CHECKPOINT COMPACTION"
SUMMARY_STEPS = re.compile(r"SUMMARY: steps done: (\d+)")


def steps_script(prompt: str) -> str:
    """Codex making files one command a turn; its summarizer's summary says how many are done, so the
    window after a compaction goes on from there."""
    last_user = prompt.split("<|im_start|>user")[-1]
    window = prompt.split("<|im_start|>assistant")[1:-1]  # the turns answered in this window
    carried = SUMMARY_STEPS.findall(prompt)
    done = (int(carried[-1]) if carried else 0) + sum("exec_command" in turn for turn in window)
    if COMPACT in last_user or TRIGGER_PROMPT in last_user:  # Codex's summarizer, or the gateway's (remote v2)
        return f"SUMMARY: steps done: {done}"
    if done >= 3:
        return "Done."
    return call("exec_command", {"cmd": f"touch step{done + 1}.txt"})


@pytest.mark.parametrize("compaction", ["local", "remote-v2"])
async def test_codex_compacts_mid_task_and_stays_one_episode(compaction: str, tiny_model_dir: Path,
                                                             tokenizer: Any, tmp_path: Path,  # noqa: F811
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """``model_auto_compact_token_limit`` is set a little above the first prompt's size (measured by a first
    run), so that Codex compacts once the task's turns have grown the window, by the usage the gateway
    reports; the window after it is a new segment compacted_from the first, the summarizer turn in it.
    ``local``: a custom provider, Codex's own summarizer request (``request_kind: "compaction"``);
    ``remote-v2``: the built-in ``openai`` provider, a request ending in ``compaction_trigger`` that the
    gateway answers with one ``compaction`` item (the summary written by the model as a recorded turn), which
    the next window's input carries back."""
    clis = await clis_or_skip()
    make = standin_of(tiny_model_dir, tokenizer)

    engine = ByPrompt({"done": make("Done.")}, tokenizer, steps_script, make)
    async with served(tiny_model_dir, tokenizer, tmp_path, engine) as (base, app, _):
        store = app.state.services.store

        async def group(limit: int | None) -> list[dict[str, Any]]:
            extra = f"model_auto_compact_token_limit = {limit}\\n" if limit else ""
            command = codex_command(clis["codex"], STEPS_PROMPT, extra) if compaction == "local" else \
                codex_command(clis["codex"], STEPS_PROMPT, extra, provider=OPENAI_PROVIDER, env=OPENAI_ENV)
            status, attempts, summary = await run_group(base, capsys, 1, "test -f step3.txt && echo 1 || echo 0",
                                                        command)
            assert status == 0, (attempts, attempt_logs(summary))
            shutil.rmtree(summary["attempts_dir"])
            return attempts

        (probe,) = await group(None)
        first = min(await store.session_interactions(session_id=probe["session_id"]), key=lambda t: t.created_at)
        size = len(await store.full_sequence(interaction_id=first.id))
        (attempt,) = await group(size + 100)
        assert attempt["reward"] == 1.0 and attempt["exit_code"] == 0, attempt
        turns = await store.session_interactions(session_id=attempt["session_id"])
        rows = {(r.thread, r.segment): r for r in await table.session_threads(store, attempt["session_id"])}
        role = "summarizer" if compaction == "local" else "compaction_trigger"
        summarizers = [t for t in turns if t.request["episode"]["role"] == role]
        assert summarizers, [t.request["episode"] for t in turns]
        windows = sorted((r for r in rows.values() if r.edge == "compacted_from"), key=lambda r: r.created_at)
        assert windows and all(w.status == "confirmed" for w in windows), rows
        assert {w.from_turn for w in windows} <= {t.id for t in summarizers}
