"""A request of megabytes does not hold the event loop (issue 36: a 7.9 MB prompt stalled it 98-139 ms).

Structure, not timing (the timing is ``bench/loop_stall.py``): a large body is parsed on a worker thread, a
large conversation is validated and hashed on one, and one with more tokens than the context is refused from
the tokenizer's count before its prompt ids are built. The long-string pieces that keep each step of the
hash short give exactly the bytes (so the hashes) of one ``json.dumps``."""

from __future__ import annotations

import hashlib
import random
import threading
from typing import Any

import pytest

from gateway import jsonio, service
from gateway.chat import normalize
from gateway.routes import common
from tests.gateway.test_openai_inprocess import make_gw, tokenizer  # noqa: F401  (fixtures)

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]


def _words(chars: int) -> str:
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(chars // 5))[:chars]


def _value(rng: random.Random, depth: int = 0) -> Any:
    alphabet = 'ab"\\\n\t\x00é😀\u2028</'
    r = rng.random()
    if depth > 3 or r < 0.3:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 700_000 if depth == 0 else 40)))
    if r < 0.45:
        return rng.choice([1, -2.5, 1e300, True, False, None, 0.1])
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"".join(rng.choice(alphabet) for _ in range(3)): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_canonical_pieces_join_to_canonical_json_and_hash_the_same() -> None:
    rng = random.Random(36)
    for _ in range(40):
        value = {"role": "user", "content": _value(rng), "name": _value(rng)}
        assert "".join(normalize._canonical_pieces(value)) == normalize.canonical_json(value)
    big = {"role": "user", "content": 'x"é😀\n' * 300_000}
    assert normalize._chars(big) > normalize.SLICED_HASH_CHARS
    whole = normalize.canonical_json(normalize.normalize_message(big)).encode()
    assert normalize._link_uncached("", big) == hashlib.sha256(whole).hexdigest()


def test_a_body_of_long_strings_parses_slice_by_slice_to_the_same_value() -> None:
    """Escapes (surrogate pairs with ensure_ascii), multi-byte UTF-8 and quotes at every slice boundary's
    neighbourhood: the sliced parse gives orjson's value; a malformed body gets the one-call parse's error."""
    import json

    import orjson

    rng = random.Random(7)
    alphabet = 'ab"\\\n\t\x01é😀\u2028</ xyz'

    def text(n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    for i in range(12):
        doc = {"model": "m", "n": [1, 2.5, None, True], "k": {"x": text(10)},
               "messages": [{"role": "user", "content": text(rng.randint(300_000, 700_000))},
                            {"role": "assistant", "content": text(280_000)}]}
        for ascii_only in (True, False):
            raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
            sliced = jsonio._loads_sliced(raw)
            assert sliced is not jsonio._UNSLICED, i  # the sliced path was taken
            assert sliced == orjson.loads(raw) == doc, i
            assert jsonio.loads(raw) == doc
    raw = json.dumps({"messages": [{"role": "user", "content": "word " * 400_000}]}).encode()
    with pytest.raises(UnicodeDecodeError):
        jsonio.loads(raw[:-10] + b"\xff" + raw[-9:])
    with pytest.raises(ValueError, match="Expecting"):  # json's own message, as before
        jsonio.loads(raw[:-2])


def test_long_digit_runs_are_found_across_scan_slices() -> None:
    edge = jsonio._SCAN_SLICE - 10  # a run of 19 digits across the first slice's end
    assert jsonio._has_long_digits(b'{"a":"' + b"x" * edge + b"1" * 19 + b'"}')
    assert not jsonio._has_long_digits(b'{"a":"' + (b"1" * 18 + b"x") * 200_000 + b'"}')
    assert jsonio.loads(b'{"n":' + b"1" * 25 + b', "s":"' + b"x" * (3 << 20) + b'"}')["n"] == int("1" * 25)


async def test_a_large_request_is_parsed_hashed_and_refused_off_the_event_loop(
        make_gw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    loop_thread = threading.get_ident()
    calls: dict[str, list[int]] = {"loads": [], "validate": [], "hash": [], "render": []}

    def spy(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls[name].append(threading.get_ident())
            return fn(*args, **kwargs)
        return wrapped

    # thresholds scaled down (the real ones are ~1 MB) so that the test's text tokenizes in a moment
    monkeypatch.setattr(common, "OFF_LOOP_BODY_BYTES", 20_000)
    monkeypatch.setattr(service, "OFF_LOOP_CHARS", 20_000)
    monkeypatch.setattr(jsonio, "loads", spy("loads", jsonio.loads))
    monkeypatch.setattr(service, "validate_messages", spy("validate", service.validate_messages))
    monkeypatch.setattr(service, "chain_hashes", spy("hash", service.chain_hashes))
    async with make_gw(["ok"] * 4, context_length=4096) as gw:
        monkeypatch.setattr(gw.svc.template, "render", spy("render", gw.svc.template.render))
        # ~60 K characters: past the character pre-check's bound only in tokens (~12 K > 4,096)
        too_long = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": _words(60_000)}]}
        resp = await gw.post("/v1/chat/completions", too_long)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
        assert calls["render"] == []  # refused from the count: no prompt ids were built
        assert calls["loads"] and loop_thread not in calls["loads"]
        assert calls["validate"] and loop_thread not in calls["validate"]
        # a large conversation that fits is hashed off the loop and served
        fits = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "-" * 25_000}]}  # ~400 tokens
        resp = await gw.post("/v1/chat/completions", fits)
        assert resp.status_code == 200, resp.text
        assert calls["hash"] and loop_thread not in calls["hash"]
        assert calls["render"] and loop_thread not in calls["render"]
        assert gw.engine.generate_calls == 1
        # a small request stays on the loop (the hop to a thread would cost more than the work)
        before = len(calls["hash"])
        resp = await gw.post("/v1/chat/completions", {"model": "m", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 200 and calls["hash"][before:] == [loop_thread]


def test_the_sliced_token_count_is_within_its_margin_of_the_exact_count(tokenizer: Any) -> None:
    from gateway.chat.template import ChatTemplate

    template = ChatTemplate(tokenizer)
    messages = [{"role": "user", "content": _words(3 * service._COUNT_SLICE_CHARS + 1000)}]
    exact = len(template.render(messages))
    counted = service._count_tokens(template, tokenizer, messages, None)
    assert counted is not None and abs(counted - exact) <= 8 < service.TOKEN_COUNT_MARGIN, (counted, exact)
