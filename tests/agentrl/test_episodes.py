"""Pieces of `agentrl up --agent module:function` and `agentrl eval` that need no processes."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from agentrl.cli import build_parser
from agentrl.episodes import EpisodeFnError, load_episode_fn, load_tasks
from agentrl.evaluate import compare, format_report
from agentrl.settings import SettingsError, load
from agentrl.stats import mean_ci
from agentrl.up import UpSettings, take, training_tasks


def test_load_tasks_ids_limit_and_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": 7, "q": "a"}\n\n{"task_id": "x", "q": "b"}\n{"q": "c"}\n')
    tasks = load_tasks(path)
    assert [t["id"] for t in tasks] == ["7", "x", "t-4"] and tasks[1]["q"] == "b"
    assert [t["id"] for t in load_tasks(path, limit=2)] == ["7", "x"]
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


def test_training_tasks_are_shuffled_by_seed_unless_told_to_keep_file_order(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}"}) + "\n" for i in range(90)))

    def order(**kw):
        settings = load(UpSettings, env={}, agent="m:f", dataset=str(path), out_dir=str(tmp_path), **kw)
        return [t["id"] for t in training_tasks(settings)]

    in_file = [f"t{i}" for i in range(90)]
    assert order(keep_order=True) == in_file
    shuffled = order()
    assert sorted(shuffled) == sorted(in_file) and shuffled != in_file
    assert order() == shuffled and order(seed=0) == shuffled  # the default seed is 0: the same order every run
    assert order(seed=1) != shuffled
    # three steps of 4 groups draw 12 different tasks, not the file's first 12
    drawn = [t for step in range(3) for t in take(shuffled, step * 4, 4)]
    assert len(set(drawn)) == 12 and drawn != in_file[:12]
    assert take(["a", "b", "c"], 2, 2) == ["c", "a"] and take(["a"], 5, 3) == ["a"]  # wraps; never repeats in a step


def test_intervals_are_wilson_for_0_1_rewards_and_normal_otherwise():
    # 6 of 30: Wilson [0.095, 0.373] (the normal approximation gave [0.054418, 0.345582])
    r = mean_ci([1.0] * 6 + [0.0] * 24)
    assert r == {"n": 30, "mean": 0.2, "ci95": [0.095, 0.373], "method": "wilson"}
    # 2 of 4: centre 0.5, half width 1.959964 * sqrt(0.25/4 + 3.8415/64) / (1 + 3.8415/4) = 0.34996
    assert mean_ci([0.0, 1.0, 1.0, 0.0])["ci95"] == [0.15, 0.85]
    # not 0/1: mean 0.5, sample sd sqrt(0.2/3) = 0.258199, half width 1.959964 * 0.258199 / 2 = 0.253030
    r = mean_ci([0.2, 0.4, 0.6, 0.8])
    assert r["method"] == "normal" and r["ci95"] == [0.247, 0.753]
    assert mean_ci([0.3]) == {"n": 1, "mean": 0.3, "ci95": None, "method": "normal"}
    assert mean_ci([])["mean"] is None


def test_compare_pairs_by_task():
    base = {"a": [0.0, 0.0], "b": [1.0], "c": [0.0], "only-base": [1.0]}
    after = {"a": [1.0, 1.0], "b": [1.0], "c": [1.0]}
    d = compare(base, after)
    assert d["tasks_compared"] == 3 and d["mean"] == 0.667 and d["method"] == "normal"  # a difference: never Wilson
    half = 1.959964 * math.sqrt(1 / 3) / math.sqrt(3)
    assert d["ci95"] == [round(2 / 3 - half, 3), round(2 / 3 + half, 3)]
    assert d["significant"] is True  # [0.013, 1.32]: excludes 0, barely
    d = compare(base, {**after, "c": [0.0]})  # differences 1, 0, 0
    assert d["mean"] == 0.333 and d["ci95"][0] < 0 and d["significant"] is False
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


def test_eval_report_prints_three_digit_intervals_and_says_which():
    report = {"agent": "m:f", "dataset": "e.jsonl", "tasks": 30, "repeats": 1, "out_dir": "/tmp/x",
              "base": {"model": "smollm2", "failed": 0, "reward": mean_ci([1.0] * 6 + [0.0] * 24)},
              "checkpoint": {"model": "ckpt", "failed": 1, "reward": mean_ci([0.5, 0.25, 1.0])},
              "difference": {**compare({"a": [0.0], "b": [1.0]}, {"a": [1.0], "b": [1.0]})}}
    text = format_report(report)
    assert "mean reward 0.200  95% CI [0.095, 0.373] (Wilson)" in text
    # mean 0.58333, sample sd 0.38188, half width 1.959964 x 0.38188 / sqrt(3) = 0.43213
    assert "mean reward 0.583  95% CI [0.151, 1.015] (normal approx.)" in text
    assert "0.054418" not in text and "difference (checkpoint - base, paired by task): 0.500" in text


def test_up_refuses_an_unreadable_task_file_or_agent_before_starting_anything(tmp_path, capsys):
    from agentrl.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    assert main(["up", "--agent", "m:f", "--dataset", str(bad), "--out-dir", str(tmp_path / "a")]) == 2
    assert "bad.jsonl:1: a task must be a JSON object" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": "a"}\n')
    assert main(["up", "--agent", "no_such_module_y:f", "--dataset", str(good), "--out-dir", str(tmp_path / "b")]) == 2
    assert "cannot import 'no_such_module_y'" in capsys.readouterr().err
    assert not (tmp_path / "b" / "logs").exists()  # no process was started
