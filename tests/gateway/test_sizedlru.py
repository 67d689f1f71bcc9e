"""gateway.sizedlru: the size-bounded LRU map behind the gateway's text caches."""

from __future__ import annotations

import threading

import pytest

from gateway.sizedlru import SizedLRU


def test_holds_at_most_its_size_least_recently_used_out_first() -> None:
    cache: SizedLRU[str, int] = SizedLRU(10)
    for i in range(4):
        cache.put(f"k{i}", i, 3)  # 12 units offered: k0 goes
    assert len(cache) == 3 and cache.size == 9 and cache.get("k0") is None
    assert cache.get("k1") == 1 and cache.hits == 1  # k1 is now the most recent
    cache.put("k4", 4, 3)  # k2 is the least recently used
    assert cache.get("k2") is None and cache.get("k1") == 1 and cache.get("k3") == 3
    assert cache.size == 9


def test_small_entries_count_at_least_min_entry_and_oversized_ones_are_not_kept() -> None:
    cache: SizedLRU[str, str] = SizedLRU(100, min_entry=40)
    cache.put("a", "x", 1)
    assert cache.size == 40
    cache.put("huge", "y", 101)
    assert cache.get("huge") is None and cache.size == 40 and cache.get("a") == "x"


def test_replacing_a_key_counts_its_new_size_only() -> None:
    cache: SizedLRU[str, str] = SizedLRU(100)
    cache.put("a", "short", 10)
    cache.put("a", "longer", 30)
    assert cache.size == 30 and len(cache) == 1 and cache.get("a") == "longer"


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_size"):
        SizedLRU(0)


def test_threads_sharing_it_keep_the_size_consistent() -> None:
    """The render cache is used from the event loop and the tokenize thread at once."""
    cache: SizedLRU[int, int] = SizedLRU(500)

    def churn(offset: int) -> None:
        for i in range(5000):
            cache.put((i * 7 + offset) % 300, i, 3)
            cache.get((i * 11 + offset) % 300)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.size == 3 * len(cache) <= 500
