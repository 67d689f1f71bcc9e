"""gateway.jsonio: orjson's speed with the standard library's results and errors."""

import json

import pytest

from gateway import jsonio


@pytest.mark.parametrize("value", [
    {"a": "héllo ✓ 😀", "b": [1, 2.5, -0.25, None, True], "c": {"nested": ["x"]}},
    [1, 2, 3],
    {"big": 2**70},  # beyond 64 bits: orjson refuses, json writes it
    "plain",
])
def test_dumps_is_compact_utf8_json_like_the_standard_library(value: object) -> None:
    assert jsonio.dumps(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def test_loads_accepts_what_json_accepts_and_refuses_constants_with_json_s_message() -> None:
    assert jsonio.loads(b'{"n": 123456789012345678901234567890}') == {"n": 123456789012345678901234567890}
    assert jsonio.loads('{"s": "\\u00e9"}') == {"s": "é"}
    # 19 digits: beyond 64 bits from 9223372036854775808 on (orjson would make it a float), exact as json's
    for raw in (b"[9999999999999999999]", b"[-18446744073709551617]", b'{"\xc3\xa9": [1, 9223372036854775808]}',
                b"[123456789012345678, 1.5e300]"):
        assert jsonio.loads(raw) == json.loads(raw) and repr(jsonio.loads(raw)) == repr(json.loads(raw)), raw
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        jsonio.loads(b'{"x": NaN}')
    with pytest.raises(ValueError, match="Expecting value"):
        jsonio.loads(b'{"x": }')
    with pytest.raises(UnicodeDecodeError):
        jsonio.loads(b'{"x": "\xff"}')
