"""Acting in the middle of a generation by event, not by the clock.

Tests that need something to happen while a request is being generated (a weight push, an abort, a pause,
a disconnect) used to start a long story, sleep, and hope the story was still running. On a fast machine it
had ended (a 400-token story ended within a 1 s sleep in CI on 2026-12-04); on a slow one too few tokens had
been made. The embedded engine started with ``--test-hooks`` holds decoding at a given output-token count
(``engine/scheduler.py``): the test arms the hold, waits until the engine reports the story held there,
acts, and releases. Each wait here is on a state the engine reports; the timeout is only a hang guard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

HANG_GUARD_S = 180.0  # a wait that outlives this is a hang, not a slow machine


def wait_for(check: Callable[[], Any], what: str, *, timeout_s: float = HANG_GUARD_S, poll_s: float = 0.02) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what`` if it never does (hang guard)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def engine_state(url: str) -> dict[str, Any]:
    """The embedded engine's scheduler state (``/get_server_info``'s ``internal_states[0]``)."""
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]  # type: ignore[no-any-return]


def hold(url: str, at_output_tokens: int) -> None:
    resp = httpx.post(url + "/test/hold_decoding", json={"at_output_tokens": at_output_tokens}, timeout=30)
    assert resp.status_code == 200, f"the engine at {url} has no test hooks (start it with --test-hooks): {resp.text}"


def release(url: str) -> None:
    httpx.post(url + "/test/release_decoding", timeout=30).raise_for_status()


@contextmanager
def held_decoding(url: str, at_output_tokens: int) -> Iterator[None]:
    """Decoding on ``url`` stops once a running request has ``at_output_tokens`` tokens; released on exit."""
    hold(url, at_output_tokens)
    try:
        yield
    finally:
        release(url)


def wait_held(url: str, *, running: int = 1) -> dict[str, Any]:
    """Wait until the engine holds decoding with at least ``running`` requests in its batch."""
    return wait_for(lambda: (lambda s: s if s["decoding_held"] and s["num_running_reqs"] >= running else None)(
        engine_state(url)), f"{running} request(s) held by the engine at {url}")
