"""RewardPool: timeouts, crashes (BrokenProcessPool) and errors are retried, counted, and end in 0.0."""

import asyncio
import time

import pytest

from agents.rewards import RewardPool, math_reward
from tests.agents.reward_fns import dies, dies_once, raises_once, returns_nan, sleeps_forever


@pytest.fixture
def pool():
    # none of its tests is about timeouts: the per-call timeout is only a hang guard for trivial calls
    pool = RewardPool(workers=1, timeout_s=60.0, retries=1)
    yield pool
    pool.close()


async def test_scores_in_a_worker(pool):
    assert await pool.score(math_reward, "#### 18", "18") == 1.0
    assert await pool.score(math_reward, "#### 17", "18") == 0.0
    assert pool.stats.calls == 2 and pool.stats.undecided == 0


async def test_timeout_gives_zero_and_the_pool_recovers():
    with RewardPool(workers=1, timeout_s=0.5, retries=0) as pool:
        started = time.monotonic()
        assert await pool.score(sleeps_forever, "x", "y") == 0.0
        # the function sleeps 60 s: back well before that, the timeout cut it (the figure also holds the
        # worker's start, which is not bounded by the call's timeout and takes seconds on a loaded machine)
        assert time.monotonic() - started < 50
        assert pool.stats.timeouts == 1 and pool.stats.undecided == 1
        # the hung worker was killed; a fresh pool answers the next call
        assert await pool.score(math_reward, "\\boxed{3/4}", "0.75") == 1.0


async def test_timeouts_are_retried():
    with RewardPool(workers=1, timeout_s=0.3, retries=1) as pool:
        assert await pool.score(sleeps_forever, "x", "y") == 0.0
        assert pool.stats.timeouts == 2 and pool.stats.retries == 1 and pool.stats.undecided == 1


async def test_crash_recovers_and_retry_succeeds(pool, tmp_path):
    marker = str(tmp_path / "crashed")
    assert await pool.score(dies_once, marker, "ref") == 1.0
    assert pool.stats.crashes == 1 and pool.stats.retries == 1 and pool.stats.undecided == 0


async def test_crash_every_time_gives_zero_then_recovers(pool):
    assert await pool.score(dies, "x", "y") == 0.0
    assert pool.stats.crashes == 2 and pool.stats.undecided == 1
    assert await pool.score(math_reward, "#### 5", "5") == 1.0


async def test_exception_is_retried(pool, tmp_path):
    assert await pool.score(raises_once, str(tmp_path / "raised"), "ref") == 0.5
    assert pool.stats.errors == 1 and pool.stats.retries == 1


async def test_non_number_counts_as_error(pool):
    assert await pool.score(returns_nan, "x", "y") == 0.0
    assert pool.stats.errors == 2 and pool.stats.undecided == 1


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        RewardPool(workers=0)


async def test_crash_beside_other_calls_is_counted_once_and_they_still_score(tmp_path):
    with RewardPool(workers=2, timeout_s=5.0, retries=1) as pool:
        results = await asyncio.gather(pool.score(dies_once, str(tmp_path / "m"), "ref"),
                                       *(pool.score(math_reward, f"#### {i}", str(i)) for i in range(10)))
    assert results == [1.0] * 11
    assert pool.stats.crashes == 1 and pool.stats.undecided == 0


async def test_lambda_is_refused_clearly(pool):
    with pytest.raises(ValueError, match="module-level function"):
        await pool.score(lambda c, r: 1.0, "x", "y")


async def test_workers_that_do_not_start_in_time_count_as_a_crash():
    with RewardPool(workers=1, timeout_s=5.0, retries=0, startup_timeout_s=0.001) as pool:
        assert await pool.score(math_reward, "#### 1", "1") == 0.0
        assert pool.stats.crashes == 1 and pool.stats.undecided == 1


def test_one_pool_serves_several_event_loops():
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        assert asyncio.run(pool.score(math_reward, "#### 2", "2")) == 1.0
        assert asyncio.run(pool.score(math_reward, "#### 3", "2")) == 0.0
        assert pool.stats.calls == 2 and pool.stats.undecided == 0
