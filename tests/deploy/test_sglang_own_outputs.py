"""What SGLang 0.5.19 sends for a request held across a weight push, produced by SGLang's own code
(``tests/sglang/own_code.py`` ``abort_path``, ``weight_versions``) and read by the gateway's engine client.

1. A request in SGLang's waiting queue that is aborted (a ``retract`` pause put it there with its output so
   far; then ``/abort_request`` or an ``abort`` pause): the scheduler's ``_make_abort_req`` and the
   tokenizer manager's ``_handle_abort_req``. Streamed, the answer carries ``output_ids = [last token]``
   but the cumulative ``output_token_logprobs`` and ``completion_tokens``, no ``prompt_tokens``, and the
   ``weight_versions`` spans; not streamed, all output ids.
2. A finished request whose tokens span a push: ``record_weight_version_events`` at the version change,
   ``compute_weight_version_spans`` + ``add_weight_versions_to_meta_info`` at the end. The gateway records
   each token's version from the spans; the embedded engine reports the same spans.
"""

from __future__ import annotations

import json
import types
from typing import Any

from engine.service import version_spans
from gateway.engine_client import parse_output
from tests.sglang import own_code

IDS, LOGPROBS = [5, 6, 7], [-0.1, -0.2, -0.3]


def aborted_in_waiting_queue(stream: bool, push: bool) -> dict[str, Any]:
    return own_code.waiting_abort_output(IDS, LOGPROBS, stream=stream, text="abc", version="3",
                                         pushed_to="4" if push else None)


def test_a_streamed_request_aborted_in_the_waiting_queue_is_read_whole() -> None:
    out = aborted_in_waiting_queue(stream=True, push=False)
    assert out["output_ids"] == [IDS[-1]]  # SGLang's shape: only the last id ...
    meta = out["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == IDS and meta["completion_tokens"] == 3  # ... all else whole
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}  # no status: a pause
    assert "prompt_tokens" not in meta and meta["weight_versions"] == [{"version": "3", "start": 0, "end": 3}]
    parsed = parse_output(out)
    assert parsed.output_ids == IDS and parsed.logprobs == LOGPROBS
    assert parsed.finish == "abort" and parsed.abort_status is None  # held and re-sent by the router
    assert parsed.versions == [3, 3, 3]

    whole = aborted_in_waiting_queue(stream=False, push=False)
    assert whole["output_ids"] == IDS and parse_output(whole).output_ids == IDS


def test_a_push_while_it_waited_leaves_its_tokens_under_the_old_version() -> None:
    out = aborted_in_waiting_queue(stream=True, push=True)
    assert out["meta_info"]["weight_version"] == "3"  # the last span's, not the server's current "4"
    assert parse_output(out).versions == [3, 3, 3]


def finished_meta(token_versions: list[int]) -> dict[str, Any]:
    """SGLang's ``weight_versions`` for a request whose tokens were sampled under ``token_versions``: an event
    at each version change (``record_weight_version_events``), spans at the end."""
    sg = own_code.abort_path()
    req = types.SimpleNamespace(output_ids=[], weight_version_events=[])
    for pos, version in enumerate(token_versions):
        if pos and version != token_versions[pos - 1]:
            req.output_ids = [0] * pos
            sg["record_weight_version_events"]([req], old_version=str(token_versions[pos - 1]))
    spans = sg["compute_weight_version_spans"](req.weight_version_events, current_version=str(token_versions[-1]),
                                               num_output_tokens=len(token_versions))
    meta: dict[str, Any] = {}
    sg["add_weight_versions_to_meta_info"](meta, spans, num_output_tokens=len(token_versions))
    return json.loads(json.dumps(meta))


def test_per_token_versions_from_sglangs_spans_and_the_embedded_engines() -> None:
    for versions in ([2, 2, 2, 2], [2, 2, 3, 3, 3], [1, 2, 2, 4]):
        meta = finished_meta(versions)
        assert meta["weight_versions"] == version_spans(versions, versions[-1])  # the embedded engine's
        assert meta["weight_version"] == str(versions[-1])
        body = {"output_ids": list(range(len(versions))),
                "meta_info": {**meta, "finish_reason": {"type": "length", "length": len(versions)},
                              "output_token_logprobs": [[-1.0, i, None] for i in range(len(versions))]}}
        assert parse_output(body).versions == versions
