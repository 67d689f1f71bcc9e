"""Where the chat template renders: a short conversation on the event loop, a long one on the tokenize
thread, and never on both at once (a fast tokenizer's Rust state must not be borrowed by two threads)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from gateway import service
from gateway.service import INLINE_RENDER_CHARS, _off_loop


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(120):  # a hang guard
        while not check():
            await asyncio.sleep(0.005)


async def test_short_renders_inline_long_ones_on_the_thread_and_never_both_at_once() -> None:
    """A "long" render is one the test holds on the thread (an event) for as long as it needs it running,
    not a render that sleeps for a while and may have ended by the time the next step runs."""
    loop_thread = threading.get_ident()
    running: list[int] = []
    overlaps: list[tuple[int, int]] = []

    def render(gate: threading.Event | None) -> int:
        if running:
            overlaps.append((running[0], threading.get_ident()))
        running.append(threading.get_ident())
        if gate is not None:
            assert gate.wait(120)
        running.pop()
        return threading.get_ident()

    assert await _off_loop(render, None, chars=100) == loop_thread
    assert await _off_loop(render, None, chars=INLINE_RENDER_CHARS + 1) != loop_thread
    assert await _off_loop(render, None) != loop_thread  # no size given: always the thread
    # a long render is running on the thread: short ones wait their turn there instead of running inline
    gate = threading.Event()
    long = asyncio.ensure_future(_off_loop(render, gate, chars=10 ** 6))
    await _until(lambda: bool(running))
    shorts = asyncio.ensure_future(asyncio.gather(*(_off_loop(render, None, chars=10) for _ in range(5))))
    await _until(lambda: shorts.done() or service._tokenize_jobs == 6)  # queued behind it (or, wrongly, done)
    gate.set()
    assert all(t != loop_thread for t in await shorts)
    await long
    # a render whose turn was cancelled still holds the thread until it ends there
    gate = threading.Event()
    slow = asyncio.ensure_future(_off_loop(render, gate, chars=10 ** 6))
    await _until(lambda: bool(running))
    slow.cancel()
    short = asyncio.ensure_future(_off_loop(render, None, chars=10))
    await _until(lambda: short.done() or service._tokenize_jobs == 2)
    gate.set()
    assert await short != loop_thread
    await _until(lambda: service._tokenize_jobs == 0)  # the cancelled render has ended on the thread
    assert await _off_loop(render, None, chars=10) == loop_thread
    assert overlaps == []
