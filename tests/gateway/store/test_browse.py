"""Browsing sessions: keyset pages (ties included), filters, counts; the plans on PostgreSQL at 100k sessions."""

from __future__ import annotations

import json
import time
from typing import Any

import asyncpg
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from gateway.store import InvalidValue, Store
from gateway.store import schema
from gateway.store.browse import SessionFilter, decode_cursor, encode_cursor, page_query, sessions_page, status_counts


async def _insert(store: Store, rows: list[tuple[str, str, str, float, float | None]]) -> None:
    """Sessions (id, group, status, created_at, reward) with exact creation times (ties on purpose)."""
    async with store.write_transaction() as conn:
        await conn.execute(sa.insert(schema.sessions), [
            {"id": sid, "key_hash": f"h-{sid}", "group_id": group, "task_id": None, "meta": {}, "status": status,
             "is_eval": False, "reward": reward, "version": 0, "created_at": created, "finished_at": None,
             "last_activity_at": created}
            for sid, group, status, created, reward in rows])


ROWS = [("s1", "g1", "active", 100.0, None), ("s2", "g1", "finished", 200.0, 1.0), ("s3", "g2", "finished", 200.0, 0.0),
        ("s4", "g2", "active", 200.0, 0.5), ("s5", "g3", "consumed", 300.5, 2.0), ("s6", "g3", "abandoned", 400.0, None),
        ("s7", "g1", "finished", 1e9 + 0.123456789, -1.0)]


async def _all_pages(store: Store, filters: SessionFilter, limit: int) -> list[str]:
    out: list[str] = []
    cursor = None
    for _ in range(100):
        page = await sessions_page(store, filters=filters, limit=limit, cursor=cursor)
        assert len(page.sessions) <= limit
        out += [s.id for s in page.sessions]
        cursor = page.next_cursor
        if cursor is None:
            return out
    raise AssertionError("pagination did not end")


async def test_keyset_pages_cover_every_session_once_in_order(store: Store) -> None:
    await _insert(store, ROWS)
    newest_first = ["s7", "s6", "s5", "s4", "s3", "s2", "s1"]  # created_at desc, then id desc on ties
    for limit in (1, 2, 3, 7, 50):
        assert await _all_pages(store, SessionFilter(), limit) == newest_first
    assert await _all_pages(store, SessionFilter(status=("finished",)), 1) == ["s7", "s3", "s2"]
    assert await _all_pages(store, SessionFilter(status=("finished", "active")), 2) == ["s7", "s4", "s3", "s2", "s1"]
    assert await _all_pages(store, SessionFilter(group_id="g1"), 1) == ["s7", "s2", "s1"]
    assert await _all_pages(store, SessionFilter(created_from=200.0, created_to=400.0), 2) == ["s5", "s4", "s3", "s2"]
    assert await _all_pages(store, SessionFilter(min_reward=0.0, max_reward=1.0), 1) == ["s4", "s3", "s2"]
    page = await sessions_page(store, filters=SessionFilter(), limit=3)
    assert page.turns == {} and decode_cursor(page.next_cursor or "") == (300.5, "s5")
    counts = await status_counts(store, filters=SessionFilter(status=("active",), group_id="g1"))
    assert counts == {"active": 1, "finished": 2, "consumed": 0, "abandoned": 0}


async def test_bad_filters_and_cursors(store: Store) -> None:
    with pytest.raises(InvalidValue, match="status"):
        SessionFilter(status=("done",))
    with pytest.raises(InvalidValue, match="finite"):
        SessionFilter(min_reward=float("inf"))
    for cursor in ("", "x", "!!", encode_cursor(1.0, "a")[:-3], "WzEsMl0", "WyJuYW4iLCJhIl0"):
        with pytest.raises(InvalidValue, match="cursor"):
            await sessions_page(store, filters=SessionFilter(), limit=5, cursor=cursor or "=")
    with pytest.raises(InvalidValue, match="limit"):
        await sessions_page(store, filters=SessionFilter(), limit=0)
    assert decode_cursor(encode_cursor(1e9 + 0.123456789, "sess-x")) == (1e9 + 0.123456789, "sess-x")


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out += _plan_nodes(child)
    return out


@pytest.mark.services
async def test_postgres_plans_at_100k_sessions_use_the_indexes(pg_url: str) -> None:
    """EXPLAIN each page query over 100k sessions: an index range scan in the wanted order (no sort, no
    sequential scan), on the first page and deep into the table alike. Timings are printed, not asserted."""
    store = await Store.open(pg_url)
    try:
        async with store.write_transaction() as conn:
            await conn.execute(sa.text(
                """
                INSERT INTO sessions (id, key_hash, group_id, task_id, metadata, status, is_eval, reward, version,
                                      created_at, finished_at, last_activity_at)
                SELECT 'sess-' || lpad(g::text, 7, '0'), md5(g::text), 'grp-' || (g / 8)::text, NULL, '{}',
                       (ARRAY['active','finished','consumed','consumed','consumed','abandoned'])[1 + g % 6],
                       false, CASE WHEN g % 3 = 0 THEN NULL ELSE (g % 5) / 4.0 END, 0,
                       1.7e9 + g * 0.5, NULL, 1.7e9 + g * 0.5
                FROM generate_series(1, 100000) AS g
                """))
            await conn.execute(sa.text("ANALYZE sessions"))
        deep = encode_cursor(1.7e9 + 1000 * 0.5, "sess-0001000")  # the last pages of the table
        cases = {
            "first page": (SessionFilter(), None, "ix_sessions_created_id"),
            "deep page": (SessionFilter(), deep, "ix_sessions_created_id"),
            "status": (SessionFilter(status=("finished",)), None, "ix_sessions_status_created"),
            "status, deep": (SessionFilter(status=("finished",)), deep, "ix_sessions_status_created"),
            # a group holds few sessions: its index finds them and they are sorted (8 here)
            "group": (SessionFilter(group_id="grp-4242"), None, "ix_sessions_group_id"),
        }
        raw = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
        try:
            for name, (filters, cursor, index) in cases.items():
                sql = str(page_query(filters, limit=50, cursor=cursor).compile(
                    dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
                [[text]] = await raw.fetch("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
                [top] = json.loads(text)
                nodes = _plan_nodes(top["Plan"])
                types = [n["Node Type"] for n in nodes]
                assert "Seq Scan" not in types and (name == "group" or "Sort" not in types), (name, types)
                assert any(n.get("Index Name") == index for n in nodes), (name, nodes)
                print(f"{name}: {types} via {index}, {top['Execution Time']:.2f} ms")
            started = time.perf_counter()
            page = await sessions_page(store, filters=SessionFilter(status=("consumed",)), limit=50, cursor=deep)
            paged = time.perf_counter()
            counts = await status_counts(store, filters=SessionFilter())
            done = time.perf_counter()
            print(f"over 100k sessions: a deep page {(paged - started) * 1000:.1f} ms, "
                  f"counts per status {(done - paged) * 1000:.1f} ms")
            assert len(page.sessions) == 50 and page.sessions[0].id < "sess-0001000"
            assert counts["consumed"] == sum(g % 6 in (2, 3, 4) for g in range(1, 100_001))
            assert sum(counts.values()) == 100_000
        finally:
            await raw.close()
    finally:
        await store.close()
