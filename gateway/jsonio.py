"""Fast JSON for the hot path (request bodies, responses, SSE chunks, engine calls), with the standard
library's behaviour kept.

``orjson`` parses and writes JSON several times faster than ``json``; where it refuses what ``json``
accepts (integers beyond 64 bits, a value it cannot serialise) or to get ``json``'s exact error for a
malformed body, the call falls back to ``json`` so that results and errors stay what they were. Output is
compact UTF-8 with non-ASCII characters kept (``json.dumps(..., separators=(",", ":"),
ensure_ascii=False)``). Hashes that are stored (chain hashes, ``canonical_json``) do not use this module:
their bytes must never change.
"""

from __future__ import annotations

import json
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
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw, parse_constant=_no_constants)  # the same outcome with json's message
