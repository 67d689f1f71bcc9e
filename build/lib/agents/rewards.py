"""Reward functions for math answers, and a process pool that runs reward functions off the event loop.

The functions are plain and synchronous so anyone can reuse them::

    from agents.rewards import math_reward
    math_reward("... so she makes \\boxed{18} dollars", "18")        # -> 1.0
    math_reward("The answer is 17.", "Janet sells ... #### 18")        # -> 0.0

How an answer is found in a completion (first rule that matches wins):

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the text after the last ``####`` on its line (the GSM8K convention);
3. the text after the last "answer is" / "answer:";
4. the last number anywhere in the text (a bare final number).

The found text is turned into a number after dropping ``$``, ``%``, thousands commas, LaTeX spacing and
``\\text{...}`` wrappers; ``\\frac{a}{b}`` and ``a/b`` become fractions; a unicode minus counts as ``-``.
Two numbers are equal when they agree to 6 significant digits (so ``0.333333`` matches ``1/3`` and
``18.0`` matches ``18``). A percentage is compared by its digits: ``50%`` matches ``50``.

`RewardPool` runs any such function in worker processes with a per-call timeout and retries, recovers
from a broken pool (a worker that crashed or had to be killed), and returns 0.0 when it cannot decide.
It counts timeouts, crashes and errors for the runner's summary.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import multiprocessing
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from fractions import Fraction

log = logging.getLogger(__name__)

SIGNIFICANT_DIGITS = 6

# A number as people write it: optional sign, thousands commas, decimals, or a fraction a/b.
_NUMBER = re.compile(
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?(?!\w)"
    r"|(?<![\w.])[-+]?\.\d+(?!\w)"
)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def _last_braced(text: str, command: str) -> str | None:
    """Content of the last ``\\command{...}`` with balanced braces, or None."""
    start = text.rfind("\\" + command + "{")
    while start != -1:
        i = start + len(command) + 2
        depth = 1
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i:j]
        start = text.rfind("\\" + command + "{", 0, start)  # unbalanced: try an earlier one
    return None


def extract_answer(text: str) -> str | None:
    """The part of ``text`` that holds the final answer (see the module docstring), or None."""
    if not text:
        return None
    for command in ("boxed", "fbox"):
        boxed = _last_braced(text, command)
        if boxed is not None and boxed.strip():
            return boxed.strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        if after:
            return after
    said = _ANSWER_IS.findall(text)
    for candidate in reversed(said):
        if _NUMBER.search(_clean(candidate)):
            return candidate.strip()
    numbers = _NUMBER.findall(_clean(text))
    return numbers[-1].strip() if numbers else None


def _clean(text: str) -> str:
    text = text.replace("\u2212", "-").replace("\u2013", "-")
    text = _TEXT.sub(r"\1", text)
    text = _FRAC.sub(r"(\1)/(\2)", text)
    for token in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\left", "\\right", "\\"):
        text = text.replace(token, " " if token in ("\\,", "\\;") else "")
    # "(3)/(4)" from \frac -> "3/4"
    text = re.sub(r"\(\s*([-+]?[\d.,]+)\s*\)\s*/\s*\(\s*([\d.,]+)\s*\)", r"\1/\2", text)
    return text


def parse_number(text: str | None) -> Fraction | None:
    """The first number in ``text`` as an exact fraction, or None. ``"$1,234.50"`` -> 2469/2."""
    if text is None:
        return None
    match = _NUMBER.search(_clean(text))
    if match is None:
        return None
    token = match.group(0).replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return Fraction(num) / Fraction(den)
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def same_number(a: Fraction | float, b: Fraction | float, digits: int = SIGNIFICANT_DIGITS) -> bool:
    """True when ``a`` and ``b`` agree to ``digits`` significant digits."""
    if a == b:
        return True
    fa, fb = float(a), float(b)
    if not (math.isfinite(fa) and math.isfinite(fb)):
        return False
    if f"{fa:.{digits - 1}e}" == f"{fb:.{digits - 1}e}":
        return True
    # values on either side of a rounding boundary (0.1234565 vs 0.12345649999) are still equal
    return math.isclose(fa, fb, rel_tol=10.0 ** -(digits + 3))


def gold_answer(reference: str) -> str:
    """The final answer of a reference: the text after ``####`` for a GSM8K solution, else the reference."""
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    return reference.strip()


def math_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's final answer equals the reference's (6 significant digits), else 0.0.

    ``reference`` is either a bare answer (``"18"``, ``"3/4"``) or a full GSM8K solution ending in
    ``#### <answer>``. An unparseable completion scores 0.0; an unparseable reference raises ValueError
    (that is a dataset bug, not a wrong answer).
    """
    expected = parse_number(gold_answer(reference))
    if expected is None:
        raise ValueError(f"reference answer {reference!r} holds no number")
    got = parse_number(extract_answer(completion))
    return 1.0 if got is not None and same_number(got, expected) else 0.0


# --- running reward functions in a process pool -------------------------------------------------------

RewardFn = Callable[..., float]


@dataclass
class RewardStats:
    """What happened to reward calls; the runner prints these in its summary."""

    calls: int = 0
    timeouts: int = 0  # a call ran past its timeout (the worker was killed)
    crashes: int = 0  # a worker process died (BrokenProcessPool); the pool was recreated
    errors: int = 0  # the function raised, or returned something that is not a finite number
    retries: int = 0
    undecided: int = 0  # calls that got the default (0.0) after every attempt failed

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class RewardPool:
    """Run reward functions in worker processes: per-call timeout, retries, recovery, 0.0 when undecided.

    A reward function that hangs or crashes must not stall or kill the agent runner, so every call runs in
    a worker process. On a timeout the pool's workers are killed (a hung worker cannot be interrupted any
    other way) and a fresh pool is made for the next call; calls that were in flight in the killed pool
    see a broken pool and are retried. The function must be importable by name (a module-level function),
    because workers are started with ``spawn``: they import only what they need, not the caller's state.

        pool = RewardPool(workers=2, timeout_s=5.0, retries=1)
        reward = await pool.score(math_reward, completion, reference)
        pool.close()
    """

    def __init__(self, *, workers: int = 2, timeout_s: float = 10.0, retries: int = 1, default: float = 0.0,
                 startup_timeout_s: float = 120.0, mp_context: str = "spawn") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.workers = workers
        self.timeout_s = timeout_s
        self.retries = retries
        self.default = default
        self.stats = RewardStats()
        self.startup_timeout_s = startup_timeout_s
        self._context = multiprocessing.get_context(mp_context)
        self._pool: ProcessPoolExecutor | None = None
        self._warm_up: asyncio.Future[None] | None = None

    def _current_pool(self, fn: RewardFn) -> tuple[ProcessPoolExecutor, asyncio.Future[None]]:
        """The current pool and its warm-up, making both when there is none.

        Starting a worker (a fresh interpreter importing the reward function's module) can take many
        seconds on a loaded machine; that must not count against a call's timeout, so each new pool is
        warmed up first, under ``startup_timeout_s``. Callers arriving meanwhile wait for the same warm-up.
        """
        if (self._pool is not None and self._warm_up is not None and not self._warm_up.done()
                and self._warm_up.get_loop() is not asyncio.get_running_loop()):
            self._discard(self._pool)  # warming up in an event loop that is gone (a pool reused across asyncio.run)
        if self._pool is None or self._warm_up is None:
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=self._context)
            self._warm_up = asyncio.ensure_future(self._start_workers(self._pool, fn.__module__))
        return self._pool, self._warm_up

    async def _start_workers(self, pool: ProcessPoolExecutor, module: str) -> None:
        futures = [asyncio.wrap_future(pool.submit(_touch, module)) for _ in range(self.workers)]
        try:
            await asyncio.wait_for(asyncio.gather(*futures), self.startup_timeout_s)
        except TimeoutError:
            raise BrokenProcessPool(f"reward workers did not start within {self.startup_timeout_s:.0f}s") from None

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        """Drop ``pool`` and kill its workers (a hung worker cannot be stopped any other way)."""
        if self._pool is pool:
            self._pool = self._warm_up = None
        # ProcessPoolExecutor has no public way to stop a running task before Python 3.14
        # (terminate_workers); killing the processes makes the executor mark itself broken.
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, fn: RewardFn, *args: object) -> float:
        """``fn(*args)`` in a worker; the default (0.0) after ``1 + retries`` failed attempts."""
        if "<" in getattr(fn, "__qualname__", "<"):
            raise ValueError(f"reward function {fn!r} must be a module-level function (workers import it by name)")
        self.stats.calls += 1
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.retries += 1
            pool, warm_up = self._current_pool(fn)
            try:
                await asyncio.shield(warm_up)
                future = pool.submit(fn, *args)
                value = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
            except TimeoutError:
                self.stats.timeouts += 1
                log.warning("reward %s timed out after %.1fs (attempt %d)", _name(fn), self.timeout_s, attempt + 1)
                self._discard(pool)
                continue
            except BrokenProcessPool as exc:
                # Every call in flight in a broken pool lands here; count and log the crash once per pool.
                # (A pool killed after a timeout is already discarded, so that is not counted as a crash.)
                if self._pool is pool:
                    self.stats.crashes += 1
                    log.warning("reward pool broken (%s) running %s or a call beside it; recreating it",
                                exc or "a worker died", _name(fn))
                    self._discard(pool)
                continue
            except Exception as exc:  # the reward function's own bug: counted, retried, never fatal
                self.stats.errors += 1
                log.warning("reward %s raised %s: %s (attempt %d)", _name(fn), type(exc).__name__, exc, attempt + 1)
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return float(value)
            self.stats.errors += 1
            log.warning("reward %s returned %r, not a finite number", _name(fn), value)
        self.stats.undecided += 1
        return self.default

    def close(self) -> None:
        if self._pool is not None:
            self._discard(self._pool)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _touch(module: str) -> int:
    """Warm-up task: import the reward function's module in the worker (an import error shows up later, on
    the real call); the short sleep makes concurrent warm-up tasks land on different workers."""
    try:
        importlib.import_module(module)
    except Exception:  # reported by the real call, with the function's name
        pass
    time.sleep(0.05)
    return os.getpid()


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", repr(fn))
