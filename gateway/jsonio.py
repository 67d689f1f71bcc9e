"""Fast JSON for the hot path (request bodies, responses, SSE chunks, engine calls), with the standard
library's behaviour kept.

``orjson`` parses and writes JSON several times faster than ``json``; where it refuses what ``json``
accepts (integers beyond 64 bits, a value it cannot serialise) or to get ``json``'s exact error for a
malformed body, the call falls back to ``json`` so that results and errors stay what they were. Output is
compact UTF-8 with non-ASCII characters kept (``json.dumps(..., separators=(",", ":"),
ensure_ascii=False)``). Hashes that are stored (chain hashes, ``canonical_json``) do not use this module:
their bytes must never change. A body of megabytes whose size is in a few long strings is parsed with
those strings decoded a slice at a time (``_loads_sliced``), so that no one step holds the interpreter lock
for long (issue 36).
"""

from __future__ import annotations

import json
import os
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value``."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):  # big integers, NaN-free subclasses orjson refuses, ...
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def dumps_str(value: Any) -> str:
    return dumps(value).decode()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


# 19 digits in a row may be an integer beyond 64 bits, which orjson reads as a float (json: an exact int).
# Looked for by mapping every digit to "0" and everything else to "." (one C pass, ~5 us for a 3 KB body,
# where a regular expression took ~60 us: more than orjson's parse of it).
_DIGITS_AS_ZEROS = bytes(48 if 48 <= b <= 57 else 46 for b in range(256))
_LONG_DIGITS = b"0" * 19


# A body of megabytes is scanned a slice at a time (overlapping by the run's length): one translate of a
# 7.9 MB body holds the interpreter lock for several ms in one C call; a slice of 1 MB for a fraction of that.
_SCAN_SLICE = 1 << 20


def _has_long_digits(data: bytes) -> bool:
    if len(data) <= _SCAN_SLICE:
        return _LONG_DIGITS in data.translate(_DIGITS_AS_ZEROS)
    step, overlap = _SCAN_SLICE, len(_LONG_DIGITS) - 1
    return any(_LONG_DIGITS in data[i:i + step + overlap].translate(_DIGITS_AS_ZEROS)
               for i in range(0, len(data), step))


def loads(raw: bytes | str) -> Any:
    """Strict JSON (no ``NaN``/``Infinity`` literals). Raises ``ValueError`` (``UnicodeDecodeError`` for
    bytes that are not UTF-8) with the standard library's message."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _has_long_digits(data):
        return json.loads(raw, parse_constant=_no_constants)
    if len(data) > _SCAN_SLICE:
        found = _loads_sliced(data)
        if found is not _UNSLICED:
            return found
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw, parse_constant=_no_constants)  # the same outcome with json's message


# A body of megabytes is one or a few long strings (a prompt, a file) in a small skeleton. orjson parses all of
# it in one C call that holds the interpreter lock (~10-30 ms for 7.9 MB on these machines), so a worker
# thread's parse stalled the event loop as long. Such a body is parsed as its skeleton, with each string
# literal over _LONG_LITERAL bytes replaced by a placeholder, and those literals decoded by orjson a slice at
# a time, each slice cut where no escape sequence and no UTF-8 sequence is split: the same value, with the
# lock released between slices. Anything unexpected (many strings, a malformed or odd literal) falls back to
# the one-call parse, whose result or error is the reference.
_LONG_LITERAL = 1 << 18
_MAX_QUOTES = 200_000  # each quote is a step of a Python loop: past this, the one-call parse is cheaper
_UNSLICED = object()


def _quotes(data: bytes) -> int:
    return sum(data.count(b'"', i, i + _SCAN_SLICE) for i in range(0, len(data), _SCAN_SLICE))


def _long_literals(data: bytes) -> list[tuple[int, int]] | None:
    """(start, end) of the contents of string literals longer than ``_LONG_LITERAL`` bytes; None when the
    quotes do not pair up."""
    out: list[tuple[int, int]] = []
    i = 0
    while (opening := data.find(b'"', i)) >= 0:
        j = opening + 1
        while True:
            closing = data.find(b'"', j)
            if closing < 0:
                return None
            k = closing - 1
            while data[k] == 0x5C:  # backslashes before the quote: an odd run escapes it
                k -= 1
            if (closing - 1 - k) % 2 == 0:
                break
            j = closing + 1
        if closing - opening - 1 > _LONG_LITERAL:
            out.append((opening + 1, closing))
        i = closing + 1
    return out


def _cut(data: bytes, start: int, at: int) -> int:
    """A cut at or before ``at`` (after ``start``) splitting neither an escape sequence (no backslash in the
    12 bytes before it: a surrogate pair's two escapes) nor a UTF-8 sequence; ``start`` if there is none."""
    while at > start:
        if data[at] & 0xC0 != 0x80 and data.find(b"\\", max(start, at - 12), at) < 0:
            return at
        at -= 1
    return start


def _literal(data: bytes, start: int, end: int) -> str | None:
    pieces = []
    while start < end:
        cut = end if end - start <= _LONG_LITERAL else _cut(data, start, start + _LONG_LITERAL)
        if cut == start:
            return None
        pieces.append(orjson.loads(b'"' + data[start:cut] + b'"'))
        start = cut
    return "".join(pieces)


def _loads_sliced(data: bytes) -> Any:
    """``orjson.loads(data)`` with its long string literals decoded a slice at a time, or ``_UNSLICED``."""
    if _quotes(data) > _MAX_QUOTES:
        return _UNSLICED
    spans = _long_literals(data)
    if not spans:
        return _UNSLICED
    nonce = os.urandom(8).hex()  # placeholders no body can hold by chance: "\x00agentrl-long-<nonce>-<n>"
    skeleton: list[bytes] = []
    last, values = 0, {}
    try:
        for n, (start, end) in enumerate(spans):
            value = _literal(data, start, end)
            if value is None:
                return _UNSLICED
            values[f"\x00agentrl-long-{nonce}-{n}"] = value
            skeleton += [data[last:start], f"\\u0000agentrl-long-{nonce}-{n}".encode()]
            last = end
        skeleton.append(data[last:])
        parsed = orjson.loads(b"".join(skeleton))
    except orjson.JSONDecodeError:
        return _UNSLICED
    filled = _fill(parsed, values)
    return filled if not values else _UNSLICED  # every placeholder was found, each as a value


def _fill(value: Any, values: dict[str, str]) -> Any:
    if isinstance(value, str):
        return values.pop(value, value)
    if isinstance(value, list):
        return [_fill(v, values) for v in value]
    if isinstance(value, dict):  # a long key keeps its placeholder, and the caller falls back
        return {k: _fill(v, values) for k, v in value.items()}
    return value
