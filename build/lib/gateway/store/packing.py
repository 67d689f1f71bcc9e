"""Token arrays as compact bytes: int32 / float32 little-endian, never JSON lists of numbers."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

_SWAP = sys.byteorder != "little"
assert array("i").itemsize == 4 and array("f").itemsize == 4, "int32/float32 array codes expected"


def _pack(code: str, values: Sequence[float]) -> bytes:
    arr = array(code, values)
    if _SWAP:  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return arr.tobytes()


def _unpack(code: str, data: bytes | None) -> list:  # type: ignore[type-arg]
    if not data:
        return []
    arr = array(code)
    arr.frombytes(data)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def pack_i32(values: Sequence[int]) -> bytes:
    return _pack("i", values)


def unpack_i32(data: bytes | None) -> list[int]:
    return _unpack("i", data)


def pack_f32(values: Sequence[float]) -> bytes:
    return _pack("f", values)


def unpack_f32(data: bytes | None) -> list[float]:
    return _unpack("f", data)
