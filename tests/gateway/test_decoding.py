"""Streamed text is the non-streamed text, and a streamed chunk costs its new tokens, not the output so far.

The real tokenizer (byte-level BPE: a multi-byte character is split over several tokens) decodes outputs
token by token through :class:`ChoiceDecoder.step`, as the engine streams them, and whole through
:meth:`ChoiceDecoder.finish`, as a non-streamed answer; both must give the same text, kept tokens and
finish reason, with stop strings anywhere (inside a word, across a character's bytes, overlapping).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.decoding import ChoiceDecoder, IncrementalText
from gateway.engine_client import Generation

TEXT = "Héllo wörld 😀 — 日本語のテキスト, naïve café ✓ 🧪🧬 end"


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def gen_of(ids: list[int], finish: str | None, matched: int | None = None) -> Generation:
    return Generation(output_ids=list(ids), logprobs=[-0.5] * len(ids), versions=[0] * len(ids),
                      finish=finish, matched=matched)


def streamed(tok: Any, ids: list[int], stop: list[str], eot: int) -> tuple[str, Any, ChoiceDecoder]:
    """What the stream sends (text of every delta) and the finished choice, fed one token per chunk."""
    decoder = ChoiceDecoder(tok, stop=stop, stop_token_ids=[eot], parse_tools=False)
    sent: list[str] = []
    last = gen_of([], None)
    for k in range(1, len(ids) + 1):
        last = gen_of(ids[:k], None)
        sent.append(decoder.step(last).content)
        if decoder.stopped:
            break
    final = gen_of(last.output_ids, "stop" if last.output_ids[-1] == eot else "length",
                   eot if last.output_ids[-1] == eot else None)
    delta, result = decoder.end(final)
    sent.append(delta.content)
    return "".join(sent), result, decoder


def test_the_text_is_split_inside_characters(tok: Any) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs characters split over several tokens"


@pytest.mark.parametrize("stop", [[], ["wör"], ["😀 —"], ["本語"], ["日本", "本語の"], ["ïve c"], ["🧬"],
                                  ["not there"], [" end"]])
def test_streamed_text_equals_the_non_streamed_text(tok: Any, stop: list[str]) -> None:
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode(TEXT, add_special_tokens=False) + [eot]
    text, result, _ = streamed(tok, ids, stop, eot)
    whole = ChoiceDecoder(tok, stop=stop, stop_token_ids=[eot], parse_tools=False).finish(
        gen_of(ids, "stop", eot))
    expected = TEXT
    for s in stop:
        if s in expected:
            expected = expected[: expected.index(s)]
    assert whole.text == expected
    assert text == result.text == result.content == whole.text
    assert (result.output_ids, result.finish_reason, result.visible) == (whole.output_ids, whole.finish_reason,
                                                                         whole.visible)


def test_a_chunk_decodes_its_new_tokens_not_the_output_so_far(tok: Any) -> None:
    """The counter of token ids handed to the tokenizer per chunk stays flat as the output grows."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode(TEXT * 60, add_special_tokens=False)  # ~2,000 tokens
    decoder = ChoiceDecoder(tok, stop=["never appears"], stop_token_ids=[eot], parse_tools=False)
    assert isinstance(decoder.text, IncrementalText)
    per_chunk = []
    for k in range(1, len(ids) + 1):
        before = decoder.text.decoded
        decoder.step(gen_of(ids[:k], None))
        per_chunk.append(decoder.text.decoded - before)
    _, result = decoder.end(gen_of(ids, "length"))
    assert result.text == TEXT * 60
    assert len(ids) > 1500
    # one new token per chunk: it is decoded with the few tokens of the window before it (a character
    # split over up to 4 byte tokens keeps the window open), whatever the output length
    assert max(per_chunk) <= 16
    assert max(per_chunk[-100:]) <= max(per_chunk[:100]) + 4


@pytest.mark.parametrize("parse_tools", [False, True])
def test_a_decoder_is_freed_without_the_garbage_collector(tok: Any, parse_tools: bool) -> None:
    """A choice's decoder, used for a streamed answer, leaves no reference cycle: reference counting frees
    it the moment it is dropped. (It held its incremental decoder, which held the decoder's bound
    ``decode``: one cycle per choice of every turn, freed only by full collections, which a serving gateway
    runs rarely: gateway.app.SERVING_GC_THRESHOLDS.)"""
    import gc
    import weakref

    ids = tok.encode("Hello there, how are you today?", add_special_tokens=False)
    gc.disable()
    try:
        decoder = ChoiceDecoder(tok, stop=["never appears"], stop_token_ids=[], parse_tools=parse_tools)
        assert decoder.text is not None
        for k in range(1, len(ids)):
            decoder.step(Generation(output_ids=ids[:k], logprobs=[0.0] * k))
        _, result = decoder.end(Generation(output_ids=ids, logprobs=[0.0] * len(ids), finish="stop"))
        assert result is not None
        gone = weakref.ref(decoder)
        del decoder
        assert gone() is None
    finally:
        gc.enable()
