"""The invariants of a chaos run, checked over its history (``bench/chaos.py`` writes it; any run's will do).

A history is a JSON-lines file of events, each with ``k`` (its kind) and ``t`` (the bench's clock, seconds).
What the bench saw while the faults were injected::

    http     one HTTP answer (or transport error) an agent got: status (0: no answer), retry_after, path
    turn     an acknowledged turn: id, session, group, parent (the previous acknowledged turn of the session
             or None), content (the returned text), t0 (sent) / t (answered)
    reward   a reward the gateway acknowledged: session, response_id, value
    fault    a kill -9 or SIGSTOP of ``target``; recover: it was started again (or continued)
    weights  an engine was seen serving ``version`` (polled; a restarted engine starts at its base weights)
    export   a group seen in the trajectory queue's stream: group, entry (the stream id), epoch (the Redis
             incarnation: a restarted Redis has an empty stream)
    held     a group staleness control held back (too old to lease; dropped after ``--stale-max-age-s``)
    train    one trainer step: step, version, groups (from the trainer's metrics.jsonl)

What was read back at the end, after the faults stopped and the idle timeout plus the marker lifetime
passed: ``db_turn`` (every acknowledged turn's stored row: session, parent, content, output_versions),
``db_session`` (status, reward, last_activity_at), ``queued`` (groups still in the queue, with why), and
``end`` (the time of the read and the two timeouts).

:func:`check` returns one :class:`Violation` per broken invariant instance; an empty list is a pass. The
invariants (issue 36): acknowledged turns are stored as acknowledged; no HTTP 500; every 503 carries
Retry-After; a group is in the queue at most once per Redis incarnation and trained at most once; every
group with a finished session is trained or accounted for; no rewarded session is left active past the idle
timeout plus the marker lifetime; every token's version is one some engine served while its turn was in
flight, and never decreases within the turn; the weight version moves on after every fault.

    python bench/chaos_check.py HISTORY.jsonl
"""

from __future__ import annotations

import bisect
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# answers that mean "not now" rather than "broken": a gateway in front of a dead engine answers 502/504
_DOWN = (502, 503, 504)


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def load(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _of(history: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in history if e.get("k") == kind]


def acked_turns(history: list[dict[str, Any]]) -> list[Violation]:
    """Every acknowledged turn is stored, in its session, under the turn acknowledged before it, with the
    text the agent got."""
    stored = {e["id"]: e for e in _of(history, "db_turn")}
    out = []
    for turn in _of(history, "turn"):
        row = stored.get(turn["id"])
        if row is None:
            out.append(Violation("acked_turn_missing", f"{turn['id']} (session {turn['session']})"))
            continue
        for field in ("session", "parent", "content"):
            if row.get(field) != turn.get(field):
                out.append(Violation("acked_turn_changed", f"{turn['id']}: {field} acknowledged "
                                     f"{str(turn.get(field))[:60]!r}, stored {str(row.get(field))[:60]!r}"))
    return out


def http_answers(history: list[dict[str, Any]]) -> list[Violation]:
    out = []
    for e in _of(history, "http"):
        status = e.get("status", 0)
        if status >= 500 and status not in _DOWN:
            out.append(Violation("http_500", f"{e.get('method')} {e.get('path')} -> {status} at t={e['t']:.2f}"))
        if status == 503 and not e.get("retry_after"):
            out.append(Violation("503_without_retry_after", f"{e.get('method')} {e.get('path')} at t={e['t']:.2f}"))
    return out


def exported_once(history: list[dict[str, Any]]) -> list[Violation]:
    """One queue entry per group per Redis incarnation (a restarted Redis starts with an empty stream, so a
    group re-published into it is a recovery, not a duplicate)."""
    entries: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in _of(history, "export"):
        entries[(e["group"], e.get("epoch", 0))].add(e["entry"])
    return [Violation("exported_twice", f"group {g} in stream epoch {epoch}: entries {sorted(ids)}")
            for (g, epoch), ids in entries.items() if len(ids) > 1]


def trained_once(history: list[dict[str, Any]]) -> list[Violation]:
    steps: dict[str, list[int]] = defaultdict(list)
    for e in _of(history, "train"):
        for g in e.get("groups", []):
            steps[g].append(e["step"])
    return [Violation("trained_twice", f"group {g} in steps {s}") for g, s in steps.items() if len(s) > 1]


def no_group_lost(history: list[dict[str, Any]]) -> list[Violation]:
    """A group one of whose sessions finished (``finished`` or ``consumed`` in the store) is trained, or
    accounted for: still queued (``queued``, with its reason), held back as too stale (``held``), or waiting for a sibling that is
    still active at the end."""
    trained = {g for e in _of(history, "train") for g in e.get("groups", [])}
    queued = {e["group"]: e.get("reason", "queued") for e in _of(history, "queued")}
    queued.update({e["group"]: "held_stale" for e in _of(history, "held")})  # held back, dropped when too old
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in _of(history, "db_session"):
        sessions[s["group"]].append(s)
    out = []
    for group, members in sessions.items():
        statuses = Counter(s["status"] for s in members)
        if not (statuses["finished"] or statuses["consumed"]) or group in trained or group in queued:
            continue
        if statuses["consumed"] == 0 and statuses["active"]:
            continue  # waiting for a sibling that is still running (the group timeout ends it)
        out.append(Violation("group_lost", f"group {group}: sessions {dict(statuses)}, never trained, not queued"))
    return out


def no_stuck_session(history: list[dict[str, Any]]) -> list[Violation]:
    end = _of(history, "end")
    if not end:
        return [Violation("history_incomplete", "no end event: the run did not read the store back")]
    limit = end[-1]["idle_timeout_s"] + end[-1]["marker_ttl_s"]
    read_at = end[-1]["t_wall"]
    return [Violation("session_stuck", f"session {s['id']} active with a reward, idle "
                      f"{read_at - s['last_activity_at']:.1f} s > {limit:.0f} s")
            for s in _of(history, "db_session")
            if s["status"] == "active" and s.get("reward") is not None and read_at - s["last_activity_at"] > limit]


def _served(history: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, int]]]:
    """Per engine: ``(since, seen, version)`` of each ``weights`` event: the version may have been served
    from ``since`` (the poll before, which saw the old one; ``seen`` when not recorded) on."""
    out: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for e in sorted(_of(history, "weights"), key=lambda e: e["t"]):
        out[e["engine"]].append((min(e.get("since", e["t"]), e["t"]), e["t"], int(e["version"])))
    return out


def token_versions(history: list[dict[str, Any]]) -> list[Violation]:
    """Every generated token's version is one an engine served while the turn was in flight (the version
    each engine had when the turn was sent, or one it was seen switching to before the answer), and a
    turn's versions never go down (a push mid-turn moves them up)."""
    served = _served(history)
    sent = {e["id"]: (e["t0"], e["t"]) for e in _of(history, "turn")}
    out = []
    for row in _of(history, "db_turn"):
        versions = [int(v) for v in row.get("output_versions", [])]
        if any(b < a for a, b in zip(versions, versions[1:])):
            out.append(Violation("token_version_decreases", f"turn {row['id']}: {versions[:12]}"))
        if row["id"] not in sent or not served:
            continue
        t0, t1 = sent[row["id"]]
        possible: set[int] = set()
        for timeline in served.values():  # a version was possible from its since until the next was seen
            for i, (since, _, version) in enumerate(timeline):
                until = timeline[i + 1][1] if i + 1 < len(timeline) else float("inf")
                if since <= t1 and until >= t0:
                    possible.add(version)
        wrong = sorted(set(versions) - possible)
        if wrong:
            out.append(Violation("token_version_not_served", f"turn {row['id']}: versions {wrong} while the "
                                 f"engines served {sorted(possible)} between t={t0:.2f} and t={t1:.2f}"))
    return out


def version_moves(history: list[dict[str, Any]]) -> list[Violation]:
    """Training goes on between faults: after every fault's recovery the trainer takes another step."""
    steps = sorted(e["t"] for e in _of(history, "train"))
    out = []
    for e in _of(history, "recover"):
        if bisect.bisect_right(steps, e["t"]) == len(steps):
            out.append(Violation("version_stalled", f"no trainer step after {e['target']} came back at t={e['t']:.2f}"))
    return out


INVARIANTS = (acked_turns, http_answers, exported_once, trained_once, no_group_lost, no_stuck_session,
              token_versions, version_moves)


def check(history: list[dict[str, Any]]) -> list[Violation]:
    """Every violation of every invariant in ``history`` (empty: the run passed)."""
    return [v for invariant in INVARIANTS for v in invariant(history)]


def weight_regressions(history: list[dict[str, Any]]) -> list[str]:
    """Engines seen going back to a lower version without restarting: a push rolled back after it failed
    elsewhere, or a trainer that resumed from a checkpoint older than its last acknowledged step. Not a
    violation of the token check (each token keeps the label of what sampled it), but the version that comes
    next names other weights than the one served before: reported with the summary."""
    out = []
    for engine, timeline in sorted(_served(history).items()):
        starts = {e["t"]: e.get("start") for e in _of(history, "weights") if e["engine"] == engine}
        for (_, t_a, a), (_, t_b, b) in zip(timeline, timeline[1:]):
            if b < a and starts.get(t_a) == starts.get(t_b):
                out.append(f"{engine} v{a} -> v{b} at t={t_b:.1f}")
    return out


def summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures for the README: faults by kind, requests and answers, turns, groups, steps."""
    http = Counter(e.get("status", 0) for e in _of(history, "http"))
    faults = Counter(f"{e['target'].split('-')[0]}:{e['mode']}" for e in _of(history, "fault"))
    train = _of(history, "train")
    versions = [int(e["version"]) for e in train]
    return {
        "weight_regressions": weight_regressions(history),
        "faults": dict(sorted(faults.items())), "requests": sum(http.values()),
        "answers": {str(k): v for k, v in sorted(http.items())}, "turns_acked": len(_of(history, "turn")),
        "rewards": len(_of(history, "reward")), "groups_exported": len({e["group"] for e in _of(history, "export")}),
        "groups_trained": len({g for e in train for g in e.get("groups", [])}), "steps": len(train),
        "groups_held_stale": len({e["group"] for e in _of(history, "held")}),
        "restarts_after_exit": dict(Counter(e["target"] for e in _of(history, "exit"))),
        "versions": [min(versions), max(versions)] if versions else [],
    }


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    history = load(args[0])
    print(json.dumps(summary(history), indent=1))
    violations = check(history)
    for v in violations:
        print("VIOLATION", v)
    print(f"{len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
