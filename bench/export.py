"""Benchmark: exporting, encoding and leasing 1,024 trajectories of ~1k tokens.

Stages, each timed on its own:

1. ``export``: the pure concat export of every session (two turns, ~1k tokens) to rows.
2. ``encode`` / ``decode``: the binary batch format against the in-run baseline, JSON lists of numbers
   (``json.dumps`` of the same rows, and ``json.loads`` + ``numpy.asarray`` back), with the ratios.
3. ``store -> queue``: the gateway's lifecycle pass over a real store (SQLite file, or ``--db``): reading
   every finished session's turns, exporting, encoding, marking sessions consumed and queueing groups.
4. ``lease + ack``: leasing the whole queue in batches of ``--lease-groups`` groups, decoding each batch,
   acknowledging it (SQL queue, or the Redis stream with ``--redis``).

    python bench/export.py [--sessions 1024] [--tokens 1000] [--group-size 4] [--redis redis://...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentrl.trajectory import Row, Turn, decode_batch, encode_batch, export_concat, rows_to_json  # noqa: E402


def synthetic_sessions(n: int, tokens: int, seed: int = 0) -> list[list[Turn]]:
    """Two-turn sessions (prompt, answer, feedback, answer) of about ``tokens`` tokens each."""
    rng = np.random.default_rng(seed)
    p0, o0, p1 = int(tokens * 0.3), int(tokens * 0.2), int(tokens * 0.1)
    o1 = tokens - p0 - o0 - p1
    out = []
    for i in range(n):
        def ids(k: int) -> np.ndarray:
            return rng.integers(0, 49_152, k, dtype=np.int32)

        a = Turn(id=f"s{i}-a", parent_id=None, prompt_ids=ids(p0), output_ids=ids(o0),
                 logprobs=-rng.random(o0, dtype=np.float32), versions=np.zeros(o0, np.int32), reward=0.0,
                 request_hash=f"r{i}-a", created_at=1.0)
        b = Turn(id=f"s{i}-b", parent_id=a.id, prompt_ids=ids(p1), output_ids=ids(o1),
                 logprobs=-rng.random(o1, dtype=np.float32), versions=np.ones(o1, np.int32), reward=1.0,
                 request_hash=f"r{i}-b", created_at=2.0)
        out.append([a, b])
    return out


def timed(fn, repeat: int = 3):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def json_decode(blob: bytes) -> list[dict]:
    rows = json.loads(blob)["rows"]
    for r in rows:
        for name in ("input_ids", "loss_mask", "versions", "turn_ids"):
            r[name] = np.asarray(r[name], dtype=np.int32)
        r["logprobs"] = np.asarray(r["logprobs"], dtype=np.float32)
    return rows


async def through_gateway(sessions: list[list[Turn]], group_size: int, lease_groups: int, db: str | None,
                          redis: str | None) -> dict[str, float]:
    """Record the sessions in a real store, then time the lifecycle's export pass and the leasing."""
    from gateway.lifecycle import ExportSettings, TrajectoryService
    from gateway.store import Interaction, Store

    tmp = tempfile.TemporaryDirectory()
    prefix = f"agentrl-bench:{time.time_ns()}:"
    store = await Store.open(db or f"sqlite+aiosqlite:///{tmp.name}/bench.db", redis_url=redis, redis_prefix=prefix)
    service = TrajectoryService(store, ExportSettings(group_size=group_size, lease_timeout_s=600))
    try:
        for g in range(0, len(sessions), group_size):
            records = [await store.create_session(group_id=f"grp-{g}") for _ in sessions[g : g + group_size]]
            for rec, turns in zip(records, sessions[g : g + group_size]):
                parent = None
                for t in turns:
                    tid = f"{rec.id}-{t.id}"
                    await store.record_interactions([Interaction(
                        id=tid, session_id=rec.id, parent_id=parent, request={}, response_message={},
                        prompt_ids=t.prompt_ids.tolist(), output_ids=t.output_ids.tolist(),
                        output_logprobs=t.logprobs.tolist(), output_versions=t.versions.tolist(),
                        finish_reason="stop", chain_hash=tid, request_hash=tid, reward=t.reward)])
                    parent = tid
                await store.finish_session(session_id=rec.id)
        t0 = time.perf_counter()
        await service.tick()
        t_export = time.perf_counter() - t0
        rows = 0
        nbytes = 0
        t0 = time.perf_counter()
        while True:
            got = await service.lease_batch(lease_groups, 0.0)
            if got is None:
                break
            lease_id, batch = got
            decoded, _ = decode_batch(batch)
            rows += len(decoded)
            nbytes += len(batch)
            await service.ack(lease_id)
        t_lease = time.perf_counter() - t0
    finally:
        await service.stop()
        if store.redis is not None:  # leave nothing behind in a shared Redis
            async for key in store.redis.scan_iter(match=prefix + "*"):
                await store.redis.delete(key)
        await store.close()
        tmp.cleanup()
    return {"export_s": t_export, "lease_s": t_lease, "rows": rows, "bytes": nbytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1024, help="trajectories to export")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per trajectory")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per GRPO group")
    parser.add_argument("--lease-groups", type=int, default=32, help="groups per lease")
    parser.add_argument("--db", default=None, help="store URL (default: a temporary SQLite file)")
    parser.add_argument("--redis", default=None, help="Redis URL: lease from the Redis stream queue")
    parser.add_argument("--skip-gateway", action="store_true", help="only the pure stages (no store)")
    args = parser.parse_args()

    sessions = synthetic_sessions(args.sessions, args.tokens)
    t_export, rows = timed(lambda: [r for s in sessions for r in export_concat(s, gamma=0.9)])
    rows: list[Row]
    n_rows = len(rows)
    n_tokens = sum(r.num_tokens for r in rows)
    t_bin, blob = timed(lambda: encode_batch(rows, {"bench": True}))
    t_json, jblob = timed(lambda: rows_to_json(rows, {"bench": True}))
    t_bin_dec, _ = timed(lambda: decode_batch(blob))
    t_json_dec, _ = timed(lambda: json_decode(jblob), repeat=1)
    mb = len(blob) / 1e6
    print(f"{n_rows} rows, {n_tokens} tokens ({n_tokens / n_rows:.0f} per row)")
    print(f"{'stage':<28}{'seconds':>10}{'rows/s':>12}{'MB/s':>10}{'size MB':>10}")

    def line(name: str, seconds: float, size_mb: float | None = None) -> None:
        rate = f"{size_mb / seconds:>10.0f}" if size_mb is not None else f"{'':>10}"
        size = f"{size_mb:>10.1f}" if size_mb is not None else ""
        print(f"{name:<28}{seconds:>10.3f}{n_rows / seconds:>12.0f}{rate}{size}")

    line("export (concat)", t_export)
    line("encode binary", t_bin, mb)
    line("encode JSON lists", t_json, len(jblob) / 1e6)
    line("decode binary", t_bin_dec, mb)
    line("decode JSON lists", t_json_dec, len(jblob) / 1e6)
    print(f"binary vs JSON: {len(jblob) / len(blob):.1f}x smaller, encode {t_json / t_bin:.0f}x faster, "
          f"decode {t_json_dec / t_bin_dec:.0f}x faster")
    if not args.skip_gateway:
        res = asyncio.run(through_gateway(sessions, args.group_size, args.lease_groups, args.db, args.redis))
        assert res["rows"] == n_rows, f"leased {res['rows']} rows, exported {n_rows}"
        backend = "Redis stream" if args.redis else "SQL queue"
        line("store -> queue (lifecycle)", res["export_s"], res["bytes"] / 1e6)
        line(f"lease+decode+ack ({backend})", res["lease_s"], res["bytes"] / 1e6)
        total = res["export_s"] + res["lease_s"]
        line("end to end", total, res["bytes"] / 1e6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
