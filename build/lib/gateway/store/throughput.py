"""Measure group-commit throughput: turns/s recorded by concurrent callers, batched vs one per transaction.

    python -m gateway.store.throughput --db sqlite+aiosqlite:////tmp/tp.db --calls 2000 --concurrency 64
    python -m gateway.store.throughput --db postgresql+asyncpg://postgres@127.0.0.1/tp --redis redis://127.0.0.1:6379/0

Each call records one turn (a child of the caller's previous turn: ``--prompt`` delta tokens, ``--output``
tokens) and awaits its commit, like the gateway does before answering. "unbatched" caps a transaction at
one row (``max_batch_rows=1``); "batched" is the default writer. The database must be empty or new.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid

from gateway.store.api import Store
from gateway.store.records import Interaction


async def _run(db: str, redis: str | None, *, calls: int, concurrency: int, prompt: int, output: int,
               max_batch_rows: int) -> dict[str, float]:
    prefix = f"agentrl-tp:{uuid.uuid4().hex[:8]}:"
    store = await Store.open(db, redis_url=redis, redis_prefix=prefix, max_batch_rows=max_batch_rows)
    try:
        sessions = [await store.create_session() for _ in range(concurrency)]
        rng = random.Random(0)
        per_worker = calls // concurrency
        # token arrays are made up front so that the measurement is the store's work, not the RNG's
        prompts = [[rng.randrange(50_000) for _ in range(prompt)] for _ in range(16)]
        outputs = [[rng.randrange(50_000) for _ in range(output)] for _ in range(16)]

        async def worker(session_id: str) -> None:
            parent = None
            for k in range(per_worker):
                turn = Interaction(
                    id=f"tp-{uuid.uuid4().hex}", session_id=session_id, parent_id=parent,
                    request={"messages": [{"role": "user", "content": "x" * 200}]},
                    response_message={"role": "assistant", "content": "y" * 200},
                    prompt_ids=prompts[k % 16], output_ids=outputs[k % 16],
                    output_logprobs=[-1.0] * output, output_versions=[0] * output,
                    finish_reason="stop", chain_hash=uuid.uuid4().hex, request_hash=uuid.uuid4().hex,
                    root_reason=None if parent else "first_turn",
                )
                await store.record_interactions([turn])
                parent = turn.id

        before = store.commit_stats
        start = time.perf_counter()
        await asyncio.gather(*[worker(s.id) for s in sessions])
        elapsed = time.perf_counter() - start
        stats = store.commit_stats
        rows = stats.rows - before.rows
        return {"rows": rows, "seconds": elapsed, "rows_per_s": rows / elapsed,
                "transactions": stats.transactions - before.transactions}
    finally:
        if store.redis is not None:  # leave nothing behind in a shared Redis
            keys = [key async for key in store.redis.scan_iter(match=prefix + "*")]
            for start in range(0, len(keys), 1000):
                await store.redis.delete(*keys[start:start + 1000])
        await store.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", required=True, help="database URL (a fresh/empty database)")
    parser.add_argument("--redis", default=None, help="Redis URL (optional)")
    parser.add_argument("--calls", type=int, default=2000, help="turns recorded per mode")
    parser.add_argument("--concurrency", type=int, default=64, help="concurrent callers")
    parser.add_argument("--prompt", type=int, default=200, help="prompt delta tokens per turn")
    parser.add_argument("--output", type=int, default=200, help="output tokens per turn")
    args = parser.parse_args(argv)
    results = {}
    for mode, max_rows in (("unbatched", 1), ("batched", 256)):
        results[mode] = asyncio.run(_run(args.db, args.redis, calls=args.calls, concurrency=args.concurrency,
                                         prompt=args.prompt, output=args.output, max_batch_rows=max_rows))
        r = results[mode]
        print(f"{mode:>10}: {r['rows']:.0f} turns in {r['seconds']:.2f} s = {r['rows_per_s']:.0f} turns/s, "
              f"{r['transactions']:.0f} transactions ({r['rows'] / r['transactions']:.1f} turns/transaction)")
    print(f"speed-up from group commit: {results['batched']['rows_per_s'] / results['unbatched']['rows_per_s']:.1f}x")


if __name__ == "__main__":
    main()
