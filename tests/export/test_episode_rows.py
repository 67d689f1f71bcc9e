"""Rows of an episode of several threads (``agentrl.trajectory.episode_reward``): one reward for all."""

from __future__ import annotations

from agentrl.trajectory import Turn, export_session, thread_of


def turn(tid: str, parent: str | None, thread: str, reward: float | None = None, t: float = 0.0) -> Turn:
    return Turn(id=tid, parent_id=parent, prompt_ids=[1, 2], output_ids=[3], logprobs=[-0.5], versions=[0],
                reward=reward, created_at=t, thread=thread)


def test_thread_label_of_a_recorded_request() -> None:
    assert thread_of({"episode": {"thread": "a1", "segment": "0"}}) == "a1#0"
    assert thread_of({"messages": []}) == "" and thread_of(None) == ""


def test_every_row_of_a_threaded_episode_carries_its_reward() -> None:
    # main: m1 -> m2; sub-agent: s1 -> s2; a compacted window: c1
    turns = [turn("m1", None, "main#0", t=1), turn("s1", None, "a#0", t=2), turn("s2", "s1", "a#0", t=3),
             turn("m2", "m1", "main#0", t=4), turn("c1", None, "main#c", t=5)]
    rows = export_session(turns, gamma=0.5, session_reward=2.0, session_id="s", group_id="g")
    assert [r.leaf_id for r in rows] == ["s2", "m2", "c1"]
    assert [r.reward for r in rows] == [2.0, 2.0, 2.0]
    # per-turn rewards and discounted returns are unchanged: the leaf has the session reward
    assert rows[0].turn_rewards.tolist() == [0.0, 2.0] and rows[0].turn_returns.tolist() == [1.0, 2.0]
    # without a session reward: the mean of the rows' own rewards (each row's return)
    unrewarded = [turn("m1", None, "main#0", reward=1.0), turn("s1", None, "a#0", reward=0.0)]
    assert [r.reward for r in export_session(unrewarded, gamma=1.0)] == [0.5, 0.5]


def test_a_session_of_one_thread_keeps_per_row_rewards() -> None:
    turns = [turn("a", None, "main#0", t=1), turn("b", "a", "main#0", t=2), turn("c", "a", "main#0", reward=0.0, t=3)]
    rows = export_session(turns, gamma=0.5, session_reward=2.0)
    assert [r.reward for r in rows] == [1.0, 0.0]  # discounted along each path, as before
    unlabelled = [turn("x", None, ""), turn("y", None, "")]
    assert [r.reward for r in export_session(unlabelled, gamma=0.5, session_reward=2.0)] == [2.0, 2.0]
