"""Pieces of `agentrl up --agent module:function` and `agentrl eval` that need no processes."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from agentrl.cli import build_parser
from agentrl.episodes import EpisodeFnError, load_episode_fn, load_tasks
from agentrl.evaluate import compare, mean_ci
from agentrl.settings import SettingsError, load
from agentrl.up import UpSettings


def test_load_tasks_ids_limit_offset_and_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": 7, "q": "a"}\n\n{"task_id": "x", "q": "b"}\n{"q": "c"}\n')
    tasks = load_tasks(path)
    assert [t["id"] for t in tasks] == ["7", "x", "t-4"] and tasks[1]["q"] == "b"
    assert [t["id"] for t in load_tasks(path, limit=2, offset=2)] == ["t-4", "7"]  # wraps around
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n[1, 2]\n')
    with pytest.raises(EpisodeFnError, match="bad.jsonl:2: a task must be a JSON object"):
        load_tasks(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"id": 1\n')
    with pytest.raises(EpisodeFnError, match="broken.jsonl:1: not JSON"):
        load_tasks(tmp_path / "broken.jsonl")


def test_load_episode_fn_says_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "agent_mod_for_test.py").write_text(
        "async def episode(client, task):\n    return 1.0\n\ndef plain(client, task):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert load_episode_fn("agent_mod_for_test:episode").__name__ == "episode"
    with pytest.raises(EpisodeFnError, match="must be an async function"):
        load_episode_fn("agent_mod_for_test:plain")
    with pytest.raises(EpisodeFnError, match="has no 'missing'"):
        load_episode_fn("agent_mod_for_test:missing")
    with pytest.raises(EpisodeFnError, match="cannot import 'no_such_module_x'"):
        load_episode_fn("no_such_module_x:episode")


def test_up_with_your_own_agent_needs_a_jsonl_dataset(tmp_path):
    with pytest.raises(SettingsError, match="pass --dataset FILE.jsonl"):
        load(UpSettings, env={}, agent="my_agent:episode")
    with pytest.raises(SettingsError, match="no such file"):
        load(UpSettings, env={}, agent="my_agent:episode", dataset=str(tmp_path / "none.jsonl"))
    (tmp_path / "t.jsonl").write_text('{"id": 1}\n')
    s = load(UpSettings, env={}, agent="my_agent:episode", dataset=str(tmp_path / "t.jsonl"), out_dir=str(tmp_path))
    assert s.eval_dataset == ""


def test_mean_ci_by_hand():
    r = mean_ci([0.0, 1.0, 1.0, 0.0])
    # mean 0.5, sample sd sqrt(1/3), half width 1.959964 * 0.57735 / 2 = 0.565794
    assert r["mean"] == 0.5 and r["ci95"] == pytest.approx([0.5 - 0.565794, 0.5 + 0.565794], abs=1e-5)
    assert mean_ci([0.3]) == {"n": 1, "mean": 0.3, "ci95": None}
    assert mean_ci([])["mean"] is None


def test_compare_pairs_by_task():
    base = {"a": [0.0, 0.0], "b": [1.0], "c": [0.0], "only-base": [1.0]}
    after = {"a": [1.0, 1.0], "b": [1.0], "c": [1.0]}
    d = compare(base, after)
    assert d["tasks_compared"] == 3 and d["mean"] == pytest.approx(2 / 3, abs=1e-6)
    half = 1.959964 * math.sqrt(1 / 3) / math.sqrt(3)
    assert d["ci95"] == pytest.approx([2 / 3 - half, 2 / 3 + half], abs=1e-5)
    assert d["significant"] is True  # [0.013, 1.32]: excludes 0, barely
    d = compare(base, {**after, "c": [0.0]})  # differences 1, 0, 0
    assert d["mean"] == pytest.approx(1 / 3, abs=1e-6) and d["ci95"][0] < 0 and d["significant"] is False
    same = compare({t: [1.0] for t in "abcdef"}, {t: [1.0] for t in "abcdef"})
    assert same["mean"] == 0.0 and not same["significant"]
    better = compare({t: [0.0] for t in "abcdef"}, {t: [1.0] for t in "abcdef"})
    assert better["significant"] is True


def test_eval_settings_are_checked(tmp_path):
    parser = build_parser()

    def run(*argv: str) -> int:
        args = parser.parse_args(["eval", *argv])
        return args.func(args)

    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a"}) + "\n")
    assert run("--agent", "m:f", "--checkpoint", str(tmp_path), "--dataset", str(tasks)) == 2  # no checkpoint
    assert run("--agent", "nocolon", "--checkpoint", "base", "--dataset", str(tasks)) == 2
    assert run("--agent", "m:f", "--checkpoint", "base", "--dataset", str(tmp_path / "no.jsonl")) == 2
    assert isinstance(parser, argparse.ArgumentParser)
