"""/generate over HTTP against a real engine process (tiny model): batching, sampling, stops, streaming,
pause/abort and bad input."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.engine.conftest import reference_logprobs
from tests.engine_hooks import held_decoding, hold, release, wait_for, wait_held

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 30, 2, 198],
    [1, 4093, 198, 19556, 17],
    [28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46],
    [500],
    [7, 700, 7000, 70],
    [11, 12, 13],
    [2000, 2001, 2002, 2003, 2004, 2005],
    [300, 301],
]


def generate(url: str, input_ids: list[int], **sampling) -> dict:
    body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
    response = httpx.post(url + "/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def server_state(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"][0]


def test_info_endpoints(engine_url):
    info = httpx.get(engine_url + "/get_model_info").json()
    assert info["is_generation"] is True and info["weight_version"].isdigit()  # a string, as in SGLang
    server = httpx.get(engine_url + "/get_server_info").json()
    assert server["context_length"] == 2048 and server["weight_version"] == info["weight_version"]
    assert httpx.get(engine_url + "/get_weight_version").json() == {"weight_version": info["weight_version"]}
    assert httpx.post(engine_url + "/flush_cache").status_code == 200
    assert "agentrl_engine_decode_steps" in httpx.get(engine_url + "/metrics").text


def test_greedy_is_deterministic_and_matches_a_plain_forward(engine_url, tiny_model):
    first = generate(engine_url, PROMPTS[0], temperature=0, max_new_tokens=8)
    second = generate(engine_url, PROMPTS[0], temperature=0, max_new_tokens=8)
    assert first["output_ids"] == second["output_ids"]
    assert len(first["output_ids"]) == 8
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert first["meta_info"]["completion_tokens"] == 8 and first["meta_info"]["prompt_tokens"] == len(PROMPTS[0])
    # greedy = argmax of the model at every step, and its logprob is the temperature-1 log-softmax
    import torch

    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([PROMPTS[0] + first["output_ids"]])).logits[0]
    n = len(PROMPTS[0])
    assert logits[n - 1 : n - 1 + 8].argmax(-1).tolist() == first["output_ids"]
    ref = reference_logprobs(tiny_model, PROMPTS[0], first["output_ids"])
    got = [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-4


def test_logprobs_equal_a_plain_forward_when_batched_with_other_lengths(engine_url, tiny_model):
    """temperature=1, top_p=1: the engine's logprobs are the model's; requests of different lengths share
    the batch. Decoding is held so that batching is certain: four requests are held at two tokens, four more
    join the batch at one token (a merge at a different position), then all eight decode together."""
    def one(i: int) -> tuple[list[int], dict]:
        return PROMPTS[i], generate(engine_url, PROMPTS[i], temperature=1.0, top_p=1.0,
                                    max_new_tokens=4 + 2 * i, sampling_seed=100 + i)

    with ThreadPoolExecutor(8) as pool:
        with held_decoding(engine_url, 2):
            first = [pool.submit(one, i) for i in range(4)]
            wait_held(engine_url, running=4)
            later = [pool.submit(one, i) for i in range(4, 8)]
            wait_held(engine_url, running=8)
        results = [f.result() for f in first + later]
    worst = 0.0
    for prompt, out in results:
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert [tok for _, tok, _ in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        ref = reference_logprobs(tiny_model, prompt, out["output_ids"])
        worst = max(worst, max(abs(a - b) for a, b in zip(ref, got)))
    assert worst < 1e-4  # wait_held(running=8) saw all eight in one batch before the release


def test_concurrent_requests_are_batched(engine_url):
    """8 concurrent requests vs the same 8 one after another: decode steps are shared, and batching changes
    no token. The 8 are held at their first token until all are in the batch, so every decode step after the
    release carries all 8 rows (what the scheduler reports), whatever the machine's speed."""
    n_tokens = 12

    def one(i: int) -> dict:
        return generate(engine_url, PROMPTS[i], temperature=0, max_new_tokens=n_tokens, ignore_eos=True)

    sequential = [one(i) for i in range(8)]

    before = server_state(engine_url)
    with ThreadPoolExecutor(8) as pool:
        with held_decoding(engine_url, 1):
            futures = [pool.submit(one, i) for i in range(8)]
            wait_held(engine_url, running=8)
        concurrent = [f.result() for f in futures]
    after = server_state(engine_url)

    assert [r["output_ids"] for r in concurrent] == [r["output_ids"] for r in sequential]  # batching changes nothing
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    print(f"\n8 concurrent requests: {steps} decode steps for {rows} rows (mean batch {rows / steps:.2f})")
    # the first token of each comes from its prefill; the other 11 from 11 shared decode steps of 8 rows
    assert (steps, rows) == (n_tokens - 1, 8 * (n_tokens - 1))


def test_sampling_seed_fixes_the_tokens(engine_url):
    a = generate(engine_url, PROMPTS[1], temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=10, sampling_seed=7)
    b = generate(engine_url, PROMPTS[1], temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=10, sampling_seed=7)
    c = generate(engine_url, PROMPTS[1], temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=10, sampling_seed=8)
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    # top_k=1 is greedy, whatever the temperature
    g = generate(engine_url, PROMPTS[1], temperature=0, max_new_tokens=10)
    k1 = generate(engine_url, PROMPTS[1], temperature=0.7, top_k=1, max_new_tokens=10, sampling_seed=1)
    assert k1["output_ids"] == g["output_ids"]
    assert all(lp == 0.0 for lp, _, _ in k1["meta_info"]["output_token_logprobs"])  # only one token kept


def test_stop_token_ids_stop_and_are_returned(engine_url):
    free = generate(engine_url, PROMPTS[2], temperature=0, max_new_tokens=10)["output_ids"]
    stop = free[3]
    out = generate(engine_url, PROMPTS[2], temperature=0, max_new_tokens=10, stop_token_ids=[stop])
    cut = free.index(stop) + 1
    assert out["output_ids"] == free[:cut]  # the matched token is included, as SGLang does
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["completion_tokens"] == cut
    assert len(out["meta_info"]["output_token_logprobs"]) == cut


def test_stop_string(engine_url, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    free = generate(engine_url, PROMPTS[4], temperature=0, max_new_tokens=8)
    piece = tok.decode(free["output_ids"][2:3]).strip()
    assert piece
    out = generate(engine_url, PROMPTS[4], temperature=0, max_new_tokens=8, stop=[piece])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    assert piece not in out["text"]


def test_length_and_zero_tokens(engine_url):
    out = generate(engine_url, PROMPTS[3], temperature=0, max_new_tokens=3)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    none = generate(engine_url, PROMPTS[3], temperature=0, max_new_tokens=0)
    assert none["output_ids"] == [] and none["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_streaming_chunks_are_cumulative_and_end_with_done(engine_url):
    body = {"input_ids": PROMPTS[5], "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3},
            "return_logprob": True, "stream": True}
    chunks, done = [], False
    # held at its first token until that token's chunk has arrived: only then can a second chunk be certain
    # (the engine sends the newest of the snapshots that queued up, so a story that ran ahead of a slow event
    # loop could arrive as one chunk)
    hold(engine_url, 1)
    try:
        with httpx.stream("POST", engine_url + "/generate", json=body, timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: ")
                if line == "data: [DONE]":
                    done = True
                    continue
                chunks.append(json.loads(line[len("data: "):]))
                if len(chunks) == 1:
                    release(engine_url)
    finally:
        release(engine_url)
    assert done and chunks
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    plain = generate(engine_url, PROMPTS[5], temperature=1.0, max_new_tokens=6, sampling_seed=3)
    assert final["output_ids"] == plain["output_ids"]
    assert final["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]
    assert len(chunks) >= 2  # tokens arrive as they are generated, not all at the end


def test_pause_aborts_in_flight_requests_and_holds_new_ones(engine_url):
    long_body = {"input_ids": PROMPTS[6], "return_logprob": True,
                 "sampling_params": {"temperature": 0, "max_new_tokens": 1900, "ignore_eos": True}}
    results: dict[str, dict] = {}

    def run(name: str, body: dict) -> None:
        results[name] = httpx.post(engine_url + "/generate", json=body, timeout=120).json()

    in_flight = threading.Thread(target=run, args=("in_flight", long_body))
    with held_decoding(engine_url, 5):  # the story is running, held at 5 tokens, when the pause lands
        in_flight.start()
        wait_held(engine_url)
        paused = httpx.post(engine_url + "/pause_generation", json={"mode": "abort"}, timeout=30)
    assert paused.status_code == 200 and paused.json()["status"] == "ok"
    in_flight.join(timeout=60)
    aborted = results["in_flight"]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(aborted["output_ids"]) == 5 and len(aborted["meta_info"]["output_token_logprobs"]) == 5

    # while paused, a new request waits in the queue; it completes after continue
    waiting = threading.Thread(target=run, args=("waiting", {"input_ids": PROMPTS[6],
                               "sampling_params": {"temperature": 0, "max_new_tokens": 4}}))
    waiting.start()
    wait_for(lambda: server_state(engine_url)["num_waiting_reqs"] == 1, "the request to reach the paused engine")
    assert "waiting" not in results and waiting.is_alive()
    assert httpx.post(engine_url + "/continue_generation", json={}).json()["status"] == "ok"
    waiting.join(timeout=60)
    assert results["waiting"]["output_ids"] == aborted["output_ids"][:4]  # same greedy tokens, same version


def test_abort_request_by_rid(engine_url):
    body = {"rid": "to-abort", "input_ids": PROMPTS[7],
            "sampling_params": {"temperature": 0, "max_new_tokens": 1900, "ignore_eos": True}}
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault(
        "r", httpx.post(engine_url + "/generate", json=body, timeout=120).json()))
    with held_decoding(engine_url, 3):
        worker.start()
        wait_held(engine_url)
        assert httpx.post(engine_url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
        worker.join(timeout=60)
    assert results["r"]["meta_info"]["id"] == "to-abort"
    assert results["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(results["r"]["output_ids"]) == 3


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input_ids": [], "sampling_params": {}}, "empty"),
        ({"input_ids": [1, 49152], "sampling_params": {}}, "outside the vocabulary"),
        ({"input_ids": [1, -3], "sampling_params": {}}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}}, "context length"),
        ({"input_ids": [5] * 2048, "sampling_params": {"max_new_tokens": 1}}, "longer than the model's context"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": "2"}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"best_of": 2}}, "unsupported sampling_params"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 3}}, "n must be 1"),
        ({"sampling_params": {}}, "exactly one of input_ids"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": {}}, "batched"),
        ({"input_ids": [1, 2], "sampling_params": {}, "top_logprobs_num": -1}, "top_logprobs_num"),
    ],
)
def test_bad_input_is_a_400_with_a_message(engine_url, body, fragment):
    response = httpx.post(engine_url + "/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input_ids": [5] * 2048, "sampling_params": {"max_new_tokens": 1}}, "longer than the model's context"),
        ({"input_ids": [1, 49152], "sampling_params": {}}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ],
)
def test_bad_streamed_input_is_an_error_event_then_done_like_sglang(engine_url, body, fragment):
    response = httpx.post(engine_url + "/generate", json={**body, "stream": True}, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert len(events) == 2 and events[1] == "[DONE]"
    assert fragment in json.loads(events[0])["error"]["message"]


def test_streamed_schema_error_is_still_a_400(engine_url):
    response = httpx.post(engine_url + "/generate", json={"input_ids": ["a"], "stream": True}, timeout=30)
    assert response.status_code == 400 and response.json()["object"] == "error"


def test_schema_errors_use_sglangs_error_shape_and_the_server_keeps_serving(engine_url):
    response = httpx.post(engine_url + "/generate", json={"input_ids": ["a", "b"]}, timeout=30)
    assert response.status_code == 400
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400 and "input_ids" in body["message"]
    assert httpx.post(engine_url + "/pause_generation", json={"mode": "sideways"}).status_code == 400
    assert httpx.post(engine_url + "/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    ok = generate(engine_url, PROMPTS[0], temperature=0, max_new_tokens=2)
    assert len(ok["output_ids"]) == 2
