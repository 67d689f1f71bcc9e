"""A long-running gateway's resident memory kept close to what it uses (glibc's malloc; elsewhere these
do nothing).

Under load the gateway's threads (the event loop, the tokenizer's pool, the SQLite writer) each allocate
from glibc's malloc, which gives each thread an arena of its own (up to eight per core) and keeps freed
memory inside the process for reuse. In the 1,000-agent soak (bench/soak.py) glibc's heap held tens of MB
that were free but kept after the load (docs/gateway.md, "Where the RSS growth comes from"). Two measures:

- :func:`limit_arenas` caps the arenas (``M_ARENA_MAX``) before the threads start, so that freed memory
  of one thread serves the others instead of sitting in an arena of its own;
- :func:`trim_loop` gives free pages back to the system every ``every_s`` (``malloc_trim``, in a thread:
  5 ms over a 300 MB heap here, 45 ms when it released 400 MB; logged at debug level with its duration).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import time

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


@functools.cache  # find_library runs `ldconfig -p` in a subprocess: once per process, not once per trim
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def limit_arenas(arenas: int = 2) -> bool:
    """At most ``arenas`` malloc arenas in this process (call before starting threads); False where the
    C library is not glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, arenas))


def trim() -> bool:
    """Give free heap pages back to the system; False where nothing was released or not glibc."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


async def trim_loop(every_s: float) -> None:
    """:func:`trim` every ``every_s`` seconds until cancelled."""
    if _libc() is None:
        return
    while True:
        await asyncio.sleep(every_s)
        started = time.perf_counter()
        released = await asyncio.to_thread(trim)  # ctypes lets go of the GIL: the loop goes on meanwhile
        log.debug("malloc_trim: %s in %.1f ms", "released memory" if released else "nothing to release",
                  1e3 * (time.perf_counter() - started))
