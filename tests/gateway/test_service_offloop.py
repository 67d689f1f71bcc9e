"""Where the chat template renders: a short conversation on the event loop, a long one on the tokenize
thread, and never on both at once (a fast tokenizer's Rust state must not be borrowed by two threads)."""

from __future__ import annotations

import asyncio
import threading
import time

from gateway import service
from gateway.service import INLINE_RENDER_CHARS, _off_loop


async def test_short_renders_inline_long_ones_on_the_thread_and_never_both_at_once() -> None:
    loop_thread = threading.get_ident()
    running: list[int] = []
    overlaps: list[tuple[int, int]] = []

    def render(seconds: float) -> int:
        if running:
            overlaps.append((running[0], threading.get_ident()))
        running.append(threading.get_ident())
        time.sleep(seconds)
        running.pop()
        return threading.get_ident()

    assert await _off_loop(render, 0.0, chars=100) == loop_thread
    assert await _off_loop(render, 0.0, chars=INLINE_RENDER_CHARS + 1) != loop_thread
    assert await _off_loop(render, 0.0) != loop_thread  # no size given: always the thread
    # a long render is running on the thread: short ones wait their turn there instead of running inline
    long = asyncio.ensure_future(_off_loop(render, 0.3, chars=10 ** 6))
    await asyncio.sleep(0.05)
    shorts = await asyncio.gather(*(_off_loop(render, 0.0, chars=10) for _ in range(5)))
    assert all(t != loop_thread for t in shorts)
    await long
    # a render whose turn was cancelled still holds the thread until it ends there
    slow = asyncio.ensure_future(_off_loop(render, 0.3, chars=10 ** 6))
    await asyncio.sleep(0.05)
    slow.cancel()
    assert await _off_loop(render, 0.0, chars=10) != loop_thread
    await asyncio.sleep(0.4)
    assert service._tokenize_jobs == 0 and await _off_loop(render, 0.0, chars=10) == loop_thread
    assert overlaps == []
