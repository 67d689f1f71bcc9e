"""bench/chaos_check.py on hand-made histories: a clean one passes, and each kind of violation is found (and
only it), so that a chaos run's "0 violations" means something."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("chaos_check", REPO / "bench" / "chaos_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["chaos_check"] = module
    spec.loader.exec_module(module)
    return module


chaos_check = _load()


def clean() -> list[dict[str, Any]]:
    """Two groups of one session each, two turns in g1 (generated at v0, then across the push to v1), a
    fault on the trainer and a step after it comes back; read back as acknowledged."""
    return [
        {"k": "weights", "t": 0.0, "engine": "engine-0", "version": 0},
        {"k": "weights", "t": 0.0, "engine": "engine-1", "version": 0},
        {"k": "http", "t": 1.0, "method": "POST", "path": "/v1/groups", "status": 200},
        {"k": "http", "t": 1.1, "method": "POST", "path": "/x/chat/completions", "status": 503, "retry_after": "1"},
        {"k": "http", "t": 1.2, "method": "POST", "path": "/x/chat/completions", "status": 200},
        {"k": "turn", "t": 1.2, "t0": 1.0, "id": "a", "session": "s1", "group": "g1", "parent": None, "content": "hi"},
        {"k": "fault", "t": 1.5, "target": "trainer", "mode": "kill"},
        {"k": "recover", "t": 2.0, "target": "trainer"},
        {"k": "weights", "t": 2.5, "engine": "engine-0", "version": 1},
        {"k": "turn", "t": 3.0, "t0": 2.2, "id": "b", "session": "s1", "group": "g1", "parent": "a", "content": "yo"},
        {"k": "turn", "t": 3.1, "t0": 3.0, "id": "c", "session": "s2", "group": "g2", "parent": None, "content": "x"},
        {"k": "reward", "t": 3.2, "session": "s1", "response_id": "b", "value": 1.0},
        {"k": "export", "t": 4.0, "group": "g1", "entry": "1-0", "epoch": 0},
        {"k": "export", "t": 4.0, "group": "g1", "entry": "9-0", "epoch": 1},  # re-published after a Redis restart
        {"k": "train", "t": 5.0, "step": 1, "version": 1, "groups": ["g1"]},
        {"k": "db_turn", "t": 9.0, "id": "a", "session": "s1", "parent": None, "content": "hi", "output_versions": [0, 0]},
        {"k": "db_turn", "t": 9.0, "id": "b", "session": "s1", "parent": "a", "content": "yo", "output_versions": [0, 1]},
        {"k": "db_turn", "t": 9.0, "id": "c", "session": "s2", "parent": None, "content": "x", "output_versions": [1]},
        {"k": "db_session", "t": 9.0, "id": "s1", "group": "g1", "status": "consumed", "reward": 1.0,
         "last_activity_at": 1000.0},
        {"k": "db_session", "t": 9.0, "id": "s2", "group": "g2", "status": "finished", "reward": 0.0,
         "last_activity_at": 1000.0},
        {"k": "queued", "t": 9.0, "group": "g2", "reason": "sql:outbox"},
        {"k": "end", "t": 9.0, "t_wall": 1010.0, "idle_timeout_s": 5.0, "marker_ttl_s": 30.0},
    ]


def _find(history: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any]:
    return next(e for e in history if e["k"] == kind and all(e.get(k) == v for k, v in match.items()))


def test_a_clean_history_passes_and_is_summarised() -> None:
    assert chaos_check.check(clean()) == []
    summary = chaos_check.summary(clean())
    assert summary["turns_acked"] == 3 and summary["groups_trained"] == 1 and summary["steps"] == 1
    assert summary["answers"] == {"200": 2, "503": 1} and summary["faults"] == {"trainer:kill": 1}


def _broken(change: Any) -> list[str]:
    history = copy.deepcopy(clean())
    change(history)
    return sorted({v.invariant for v in chaos_check.check(history)})


def _drop(history: list[dict[str, Any]], event: dict[str, Any]) -> None:
    history.remove(event)


CASES = {
    "acked_turn_missing": lambda h: _drop(h, _find(h, "db_turn", id="b")),
    "acked_turn_changed": lambda h: _find(h, "db_turn", id="b").update(content="something else"),
    "http_500": lambda h: h.append({"k": "http", "t": 2.0, "method": "POST", "path": "/reward", "status": 500}),
    "503_without_retry_after": lambda h: _find(h, "http", status=503).pop("retry_after"),
    "exported_twice": lambda h: h.append({"k": "export", "t": 4.1, "group": "g1", "entry": "2-0", "epoch": 0}),
    "trained_twice": lambda h: h.append({"k": "train", "t": 6.0, "step": 2, "version": 2, "groups": ["g1"]}),
    "group_lost": lambda h: _drop(h, _find(h, "queued", group="g2")),
    "session_stuck": lambda h: _find(h, "db_session", id="s2").update(status="active", last_activity_at=900.0),
    "token_version_not_served": lambda h: _find(h, "db_turn", id="a").update(output_versions=[0, 1]),
    "token_version_decreases": lambda h: _find(h, "db_turn", id="b").update(output_versions=[1, 0]),
    "version_stalled": lambda h: _find(h, "recover").update(t=5.5),
    "history_incomplete": lambda h: _drop(h, _find(h, "end")),
}


@pytest.mark.parametrize("invariant", sorted(CASES))
def test_each_violation_is_detected_alone(invariant: str) -> None:
    assert _broken(CASES[invariant]) == [invariant]


def test_accounted_groups_and_stale_holds_are_not_lost() -> None:
    """A group held back as too stale (then dropped), or waiting for a sibling still running, is
    accounted for; one that is neither is lost."""
    def held(h: list[dict[str, Any]]) -> None:
        _drop(h, _find(h, "queued", group="g2"))
        h.append({"k": "held", "t": 8.0, "group": "g2", "epoch": 0})
    assert _broken(held) == []

    def sibling_running(h: list[dict[str, Any]]) -> None:
        _drop(h, _find(h, "queued", group="g2"))
        h.append({"k": "db_session", "t": 9.0, "id": "s3", "group": "g2", "status": "active", "reward": None,
                  "last_activity_at": 1009.0})
    assert _broken(sibling_running) == []


def test_the_command_line_reads_a_history_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in clean()))
    assert chaos_check.main([str(path)]) == 0
    assert "0 violation(s)" in capsys.readouterr().out
    bad = clean()
    bad.append({"k": "http", "t": 2.0, "method": "GET", "path": "/v1/models", "status": 500})
    path.write_text("".join(json.dumps(e) + "\n" for e in bad))
    assert chaos_check.main([str(path)]) == 1
    assert "VIOLATION http_500" in capsys.readouterr().out


def test_a_version_seen_after_the_answer_counts_from_the_poll_before() -> None:
    """The engines are polled: a switch to v1 seen at t=3.5 may have happened just after the poll before it
    (``since``); a turn answered in between may carry v1. Without ``since`` it could not."""
    history = clean()
    _find(history, "weights", version=1).update(t=3.5, since=0.9)
    assert chaos_check.check(history) == []
    _find(history, "weights", version=1).pop("since")
    assert sorted({v.invariant for v in chaos_check.check(history)}) == ["token_version_not_served"]


def test_an_engine_going_back_a_version_is_reported_unless_it_restarted() -> None:
    history = clean()
    history.append({"k": "weights", "t": 6.0, "engine": "engine-0", "version": 0, "start": None})
    assert chaos_check.summary(history)["weight_regressions"] == ["engine-0 v1 -> v0 at t=6.0"]
    history[-1]["start"] = 2  # a restarted engine serves its base weights: not a regression
    assert chaos_check.summary(history)["weight_regressions"] == []
