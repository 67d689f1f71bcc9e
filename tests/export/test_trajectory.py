"""Pure export functions on hand-built trees, with hand-computed expected rows, and the binary batch format."""

from __future__ import annotations

import numpy as np
import pytest

from agentrl.trajectory import (
    MAGIC,
    Row,
    Turn,
    UntrainableSampling,
    abandoned_retries,
    decode_batch,
    decode_columns,
    encode_batch,
    export_concat,
    export_individual,
    export_session,
    merge_batches,
    turn_from_interaction,
    rows_to_json,
)

EOT = 2  # stands in for <|im_end|>


def turn(id, parent, prompt, output, *, versions=None, logprobs=None, reward=None, finish="stop",
         bridge=0, rh=None, t=0.0):
    logprobs = logprobs if logprobs is not None else [-0.5 - 0.1 * i for i in range(len(output))]
    versions = versions if versions is not None else [0] * len(output)
    return Turn(id=id, parent_id=parent, prompt_ids=prompt, output_ids=output, logprobs=logprobs,
                versions=versions, bridge_len=bridge, finish_reason=finish, reward=reward,
                request_hash=rh or f"req-{id}", created_at=t)


def eq(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------ 2-turn self-correction


def self_correction():
    a = turn("a", None, [1, 2, 3], [10, 11], logprobs=[-0.1, -0.2], versions=[0, 0], reward=0.0, t=1)
    b = turn("b", "a", [4, 5], [12, 13, 14], logprobs=[-0.3, -0.4, -0.5], versions=[0, 1, 1], reward=1.0, t=2)
    return [b, a]  # order of input must not matter


def test_self_correction_concat_row_by_hand():
    (row,) = export_concat(self_correction(), gamma=0.9, session_id="s1", group_id="g1", task_id="q7")
    eq(row.input_ids, [1, 2, 3, 10, 11, 4, 5, 12, 13, 14])
    eq(row.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(row.logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5], rtol=1e-6)
    eq(row.versions, [-1, -1, -1, 0, 0, -1, -1, 0, 1, 1])
    eq(row.turn_ids, [-1, -1, -1, 0, 0, -1, -1, 1, 1, 1])
    eq(row.turn_rewards, [0.0, 1.0])
    np.testing.assert_allclose(row.turn_returns, [0.9, 1.0])
    assert row.reward == pytest.approx(0.9)
    assert not row.is_truncated
    assert (row.session_id, row.group_id, row.leaf_id, row.task_id) == ("s1", "g1", "b", "q7")
    assert row.turn_interaction_ids == ["a", "b"]
    assert row.min_version == 0
    (last,) = export_concat(self_correction(), gamma=0.9, reward_mode="last")
    assert last.reward == 1.0
    eq(last.turn_returns, row.turn_returns)  # the mode changes only the scalar reward


def test_self_correction_individual_rows_by_hand():
    ra, rb = export_individual(self_correction(), gamma=0.9, session_id="s1")
    eq(ra.input_ids, [1, 2, 3, 10, 11])
    eq(ra.loss_mask, [0, 0, 0, 1, 1])
    eq(ra.turn_ids, [-1, -1, -1, 0, 0])
    eq(ra.turn_rewards, [0.0])
    np.testing.assert_allclose(ra.turn_returns, [0.9])
    assert ra.reward == pytest.approx(0.9) and ra.leaf_id == "a"
    eq(rb.input_ids, [1, 2, 3, 10, 11, 4, 5, 12, 13, 14])
    eq(rb.loss_mask, [0, 0, 0, 0, 0, 0, 0, 1, 1, 1])  # the parent's output is prompt here
    eq(rb.versions, [-1] * 7 + [0, 1, 1])
    eq(rb.turn_ids, [-1] * 7 + [0, 0, 0])
    np.testing.assert_allclose(rb.logprobs, [0] * 7 + [-0.3, -0.4, -0.5], rtol=1e-6)
    assert rb.reward == 1.0
    assert ra.row_id != rb.row_id


def test_raw_rewards_are_kept_and_missing_reward_counts_zero():
    turns = [turn("a", None, [1], [5], t=1), turn("b", "a", [2], [6], t=2),
             turn("c", "b", [3], [7], reward=2.0, t=3)]
    (row,) = export_concat(turns, gamma=0.5)
    eq(row.turn_rewards, [0.0, 0.0, 2.0])
    eq(row.turn_returns, [0.5, 1.0, 2.0])
    assert row.reward == 0.5
    assert [t.reward for t in turns] == [None, None, 2.0]  # the input turns are untouched


# ------------------------------------------------------------------------------- two branches


def two_branches():
    root = turn("r", None, [1, 2], [10], reward=None, t=1)
    good = turn("g", "r", [3], [20, 21], reward=1.0, t=2, rh="h-good")
    bad = turn("b", "r", [4], [30], reward=0.0, t=3, rh="h-bad")
    return [root, good, bad]


def test_two_branches_do_not_leak():
    rg, rb = export_concat(two_branches(), gamma=0.5)
    eq(rg.input_ids, [1, 2, 10, 3, 20, 21])
    eq(rg.loss_mask, [0, 0, 1, 0, 1, 1])
    eq(rg.turn_ids, [-1, -1, 0, -1, 1, 1])
    eq(rg.turn_rewards, [0.0, 1.0])
    eq(rg.turn_returns, [0.5, 1.0])
    assert rg.reward == 0.5 and rg.leaf_id == "g"
    eq(rb.input_ids, [1, 2, 10, 4, 30])
    eq(rb.loss_mask, [0, 0, 1, 0, 1])
    eq(rb.turn_rewards, [0.0, 0.0])
    eq(rb.turn_returns, [0.0, 0.0])  # the good sibling's reward does not reach this branch
    assert rb.reward == 0.0 and rb.leaf_id == "b"
    assert not set(rb.input_ids.tolist()) & {20, 21}


def test_two_branches_individual_parent_averages_its_branches():
    rows = {r.leaf_id: r for r in export_individual(two_branches(), gamma=0.5)}
    assert rows["r"].reward == pytest.approx(0.5 * 0.5)  # 0 + 0.5 * mean(1, 0)
    assert rows["g"].reward == 1.0 and rows["b"].reward == 0.0
    assert export_individual(two_branches(), gamma=0.5, reward_mode="last")[0].reward == 0.5


# ---------------------------------------------------------------------- length-truncated parent


def test_length_truncated_parent_bridge_token_masked():
    parent = turn("p", None, [1, 2], [10, 11, 12], finish="length", t=1)
    child = turn("c", "p", [EOT, 7, 8], [13], bridge=1, reward=1.0, t=2)
    (row,) = export_concat([parent, child], gamma=1.0)
    eq(row.input_ids, [1, 2, 10, 11, 12, EOT, 7, 8, 13])
    eq(row.loss_mask, [0, 0, 1, 1, 1, 0, 0, 0, 1])
    eq(row.versions, [-1, -1, 0, 0, 0, -1, -1, -1, 0])
    assert not row.is_truncated  # the leaf finished normally
    (cut,) = export_concat([parent], gamma=1.0)
    assert cut.is_truncated


# ----------------------------------------------------------------------------- retried request


def test_retried_request_abandoned_is_dropped():
    root = turn("r", None, [1], [10], t=1)
    first = turn("x1", "r", [2], [20], reward=0.3, t=2, rh="same")  # the agent gave up on this answer
    retry = turn("x2", "r", [2], [21], t=3, rh="same")  # ... re-sent the same messages, and went on
    cont = turn("y", "x2", [3], [30], reward=1.0, t=4)
    turns = [root, first, retry, cont]
    assert abandoned_retries(turns) == {"x1"}
    (row,) = export_concat(turns, gamma=1.0)
    eq(row.input_ids, [1, 10, 2, 21, 3, 30])
    assert row.turn_interaction_ids == ["r", "x2", "y"]
    assert {r.leaf_id for r in export_individual(turns, gamma=1.0)} == {"r", "x2", "y"}
    # Two answers to one request that nobody continued are two samples, both kept (n>1).
    assert len(export_concat([root, first, retry], gamma=1.0)) == 2


# ------------------------------------------------------------------------ tool results masked


def test_choices_of_one_request_are_siblings_not_retries():
    """n=3 in one request, choice 1 continued: choices 0 and 2 are samples and stay rows; a re-sent request
    with the same messages (another request id) that was not continued is a retry and is dropped."""
    def choice(id, req, t):
        return Turn(**{**{f: getattr(turn(id, None, [1, 2], [10 + t]), f) for f in Turn.__dataclass_fields__},
                       "request_hash": "same", "request_id": req, "created_at": t})

    c0, c1, c2 = choice("c0", "c0", 1), choice("c1", "c0", 1), choice("c2", "c0", 1)
    retry = choice("r", "r", 2)
    child = turn("k", "c1", [3], [20], t=3)
    assert abandoned_retries([c0, c1, c2, retry, child]) == {"r"}
    rows = export_concat([c0, c1, c2, retry, child], gamma=1.0)
    assert sorted(r.leaf_id for r in rows) == ["c0", "c2", "k"]
    # Recorded before request ids existed: each turn is its own request (the old rule).
    old = [Turn(**{**{f: getattr(x, f) for f in Turn.__dataclass_fields__}, "request_id": ""}) for x in (c0, c1, c2)]
    assert abandoned_retries([*old, child]) == {"c0", "c2"}


def test_tool_result_tokens_masked():
    call = [500, 501, 502, EOT]  # <tool_call>{...}</tool_call><|im_end|> generated by the model
    tool_result = [1, 600, 601, 602, 603, EOT]  # <|im_start|>tool <tool_response>..</tool_response><|im_end|>
    gen_prompt = [1, 700]  # <|im_start|>assistant
    a = turn("a", None, [1, 100, 101, EOT, 1, 700], call, finish="tool_calls", t=1)
    b = turn("b", "a", [9] + tool_result + gen_prompt, [800, EOT], reward=1.0, t=2)
    (row,) = export_concat([a, b], gamma=1.0)
    mask = dict(zip(range(len(row.input_ids)), row.loss_mask.tolist()))
    ids = row.input_ids.tolist()
    start = ids.index(600)
    assert all(mask[i] == 0 for i in range(start - 1, start + 5))
    assert [ids[i] for i in range(len(ids)) if mask[i]] == call + [800, EOT]


def test_session_reward_fills_leaves_without_their_own():
    rows = export_concat(two_branches()[:2] + [turn("b", "r", [4], [30], t=3)], gamma=1.0, session_reward=0.25)
    by_leaf = {r.leaf_id: r for r in rows}
    eq(by_leaf["g"].turn_rewards, [0.0, 1.0])  # its own reward wins
    eq(by_leaf["b"].turn_rewards, [0.0, 0.25])


def test_bad_options_and_trees_are_refused():
    with pytest.raises(ValueError, match="valid: discounted, last"):
        export_concat(self_correction(), gamma=0.9, reward_mode="mean")
    with pytest.raises(ValueError, match="gamma"):
        export_concat(self_correction(), gamma=1.5)
    with pytest.raises(ValueError, match="valid: concat, individual"):
        export_session(self_correction(), mode="flat", gamma=1.0)
    with pytest.raises(ValueError, match="parent"):
        export_concat([turn("b", "missing", [1], [2])], gamma=1.0)
    with pytest.raises(ValueError, match="logprobs"):
        Turn(id="x", parent_id=None, prompt_ids=[1], output_ids=[2, 3], logprobs=[0.0], versions=[0, 0])
    with pytest.raises(ValueError, match="finite"):
        turn("x", None, [1], [2], reward=float("nan"))
    assert export_concat([], gamma=1.0) == []


# ---------------------------------------------------------------------------------- encoding


def random_row(rng: np.random.Generator, i: int) -> Row:
    n = int(rng.integers(0, 50))
    k = int(rng.integers(1, 4))
    return Row(
        input_ids=rng.integers(0, 50_000, n).astype(np.int32),
        loss_mask=rng.integers(0, 2, n).astype(np.int8),
        logprobs=-rng.random(n).astype(np.float32),
        versions=rng.integers(-1, 5, n).astype(np.int32),
        turn_ids=rng.integers(-1, k, n).astype(np.int32),
        turn_rewards=rng.normal(size=k),
        turn_returns=rng.normal(size=k),
        reward=float(rng.normal()),
        is_truncated=bool(rng.integers(0, 2)),
        session_id=f"sess-{i}-é",
        group_id=f"g{i % 3}",
        leaf_id=f"chatcmpl-{i}",
        row_id=f"row-{i}",
        task_id=None if i % 2 else f"task {i}",
        turn_interaction_ids=[f"t{i}-{j}" for j in range(k)],
        turn_temperatures=rng.uniform(0.1, 2.0, k).astype(np.float32),
        group_key=f"key-{i % 4}",
    )


def assert_rows_equal(a: Row, b: Row) -> None:
    for name in ("input_ids", "loss_mask", "logprobs", "versions", "turn_ids", "turn_rewards", "turn_returns",
                 "turn_temperatures"):
        got, want = getattr(a, name), getattr(b, name)
        assert got.dtype == want.dtype, name
        eq(got, want)
    for name in ("reward", "is_truncated", "session_id", "group_id", "leaf_id", "row_id", "task_id",
                 "turn_interaction_ids", "group_key"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("seed", range(25))
def test_encode_decode_round_trip(seed):
    rng = np.random.default_rng(seed)
    rows = [random_row(rng, i) for i in range(int(rng.integers(0, 12)))]
    meta = {"lease_id": f"L{seed}", "groups": [{"group_id": "g0", "sessions": ["a", "b"]}], "version": seed}
    data = encode_batch(rows, meta)
    assert data[:8] == MAGIC
    got, got_meta = decode_batch(data)
    assert got_meta == meta
    assert len(got) == len(rows)
    for a, b in zip(got, rows):
        assert_rows_equal(a, b)


def test_encoding_is_columnar_binary_not_json_lists():
    rng = np.random.default_rng(0)
    a = turn("a", None, rng.integers(0, 49152, 300), rng.integers(0, 49152, 200), logprobs=-rng.random(200))
    rows = export_concat([a], gamma=0.9) * 20
    data = encode_batch(rows)
    cols, header = decode_columns(data)
    assert cols["input_ids"].shape == (10_000,) and cols["input_ids"].dtype == np.dtype("<i4")
    for spec in header["columns"].values():
        assert spec["offset"] % 8 == 0
    assert len(data) < 0.7 * len(rows_to_json(rows))  # 17 bytes per token against ~29


def test_decode_rejects_garbage():
    good = encode_batch(export_concat(self_correction(), gamma=0.9))
    with pytest.raises(ValueError, match="not an agentrl"):
        decode_batch(b"x" * 64)
    with pytest.raises(ValueError):
        decode_batch(good[:30])
    with pytest.raises(ValueError, match="past the end"):
        decode_batch(good[:-8])


def test_merge_batches_equals_encoding_all_rows_at_once():
    rng = np.random.default_rng(7)
    parts = [[random_row(rng, 10 * j + i) for i in range(j + 1)] for j in range(4)]
    merged = merge_batches([encode_batch(p, {"part": j}) for j, p in enumerate(parts)], {"lease_id": "L"})
    whole = [r for p in parts for r in p]
    assert merged == encode_batch(whole, {"lease_id": "L"})
    assert decode_batch(merge_batches([]))[0] == []


def test_turn_from_store_interaction():
    from gateway.store.api import Interaction

    rec = Interaction(id="chatcmpl-1", session_id="s", parent_id=None, request={}, response_message={},
                      prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.25], output_versions=[4],
                      finish_reason="length", chain_hash="c", request_hash="r", bridge_len=0, reward=0.5,
                      created_at=12.0)
    t = turn_from_interaction(rec)
    assert (t.id, t.parent_id, t.finish_reason, t.reward, t.request_hash, t.created_at) == (
        "chatcmpl-1", None, "length", 0.5, "r", 12.0)
    eq(t.prompt_ids, [1, 2]); eq(t.output_ids, [3]); eq(t.logprobs, [-0.25]); eq(t.versions, [4])


# ------------------------------------------------------------------ sampling parameters, group key


def test_temperature_of_each_turn_is_exported_and_expanded_per_token():
    a, b = self_correction()[1], self_correction()[0]
    a = Turn(**{**{f: getattr(a, f) for f in Turn.__dataclass_fields__}, "temperature": 0.7})
    b = Turn(**{**{f: getattr(b, f) for f in Turn.__dataclass_fields__}, "temperature": 1.3})
    (row,) = export_concat([a, b], gamma=1.0)
    eq(row.turn_temperatures, np.array([0.7, 1.3], dtype=np.float32))
    # prompt 1 2 3 | out 10 11 (0.7) | prompt 4 5 | out 12 13 14 (1.3)
    eq(row.token_temperatures(), np.array([1, 1, 1, 0.7, 0.7, 1, 1, 1.3, 1.3, 1.3], dtype=np.float32))
    ind = export_individual([a, b], gamma=1.0)
    assert [r.turn_temperatures.tolist() for r in ind] == [[pytest.approx(0.7)], [pytest.approx(1.3)]]
    (back,), _ = decode_batch(encode_batch([row]))
    eq(back.token_temperatures(), row.token_temperatures())


def test_sampling_parameters_come_from_the_recorded_request():
    from gateway.store.api import Interaction

    def rec(params):
        return Interaction(id="c", session_id="s", parent_id=None, request={"params": params}, response_message={},
                           prompt_ids=[1], output_ids=[3], output_logprobs=[-0.25], output_versions=[0],
                           finish_reason="stop", chain_hash="c", request_hash="r")

    assert turn_from_interaction(rec({})).temperature == 1.0  # the OpenAI default
    assert turn_from_interaction(rec({"temperature": 0.7})).temperature == pytest.approx(0.7)
    assert turn_from_interaction(rec({"temperature": 0})).temperature == 1.0  # greedy: engines report T=1
    t = turn_from_interaction(rec({"temperature": 1.0, "top_p": 0.9}))
    assert t.top_p == pytest.approx(0.9)
    with pytest.raises(UntrainableSampling, match="top_p=0.9"):
        export_session([t], gamma=1.0)
    assert export_session([turn_from_interaction(rec({"top_p": 1.0}))], gamma=1.0)
    # a grammar-constrained turn (gateway.constraints records params.grammar) is refused, naming what constrained it
    g = turn_from_interaction(rec({"grammar": {"kind": "ebnf", "origin": "tool_choice", "source": "root ::= \"a\""}}))
    assert g.grammar == "ebnf (tool_choice)"
    with pytest.raises(UntrainableSampling, match=r"grammar \(ebnf \(tool_choice\)\)"):
        export_session([g], gamma=1.0)
    assert turn_from_interaction(rec({"temperature": 1.0})).grammar == ""


def test_batch_written_before_the_new_columns_still_decodes():
    from agentrl.trajectory import _pack, decode_columns

    rows = export_concat(self_correction(), gamma=1.0)
    cols, header = decode_columns(encode_batch(rows))
    old_strings = {k: v for k, v in header["strings"].items() if k != "group_key"}
    old = _pack({k: v for k, v in cols.items() if k != "turn_temperatures"}, old_strings, header["n_rows"], {})
    (row,), _ = decode_batch(old)
    assert row.group_key == "" and row.grpo_group == row.group_id
    eq(row.turn_temperatures, np.ones(2, dtype=np.float32))
    assert decode_batch(merge_batches([old, encode_batch(rows)]))[0][1].turn_temperatures.tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ random trees vs a slow reference


def random_tree(rng: np.random.Generator, n: int) -> list[Turn]:
    turns: list[Turn] = []
    for i in range(n):
        parent = None if i == 0 or rng.random() < 0.15 else turns[int(rng.integers(0, i))].id
        out = rng.integers(100, 1000, int(rng.integers(0, 4))).tolist()
        reward = None if rng.random() < 0.4 else float(rng.integers(-2, 3))
        # Retries: sometimes re-use the request hash of an earlier sibling.
        sibs = [t for t in turns if t.parent_id == parent]
        rh = sibs[0].request_hash if sibs and rng.random() < 0.3 else f"req-{i}"
        turns.append(turn(f"t{i}", parent, rng.integers(1, 100, int(rng.integers(1, 4))).tolist(), out,
                          versions=rng.integers(0, 3, len(out)).tolist(), reward=reward, rh=rh, t=float(i)))
    return turns


def slow_reference(turns: list[Turn], gamma: float) -> dict[str, tuple[list[int], list[int], list[float]]]:
    """leaf id -> (input_ids, loss_mask, returns), by the most direct reading of the rules."""
    by_id = {t.id: t for t in turns}
    has_kids = {t.parent_id for t in turns}
    continued = {t.request_hash for t in turns if t.id in has_kids}
    out = {}
    for leaf in turns:
        if leaf.id in has_kids or leaf.request_hash in continued:
            continue
        path = [leaf]
        while path[0].parent_id is not None:
            path.insert(0, by_id[path[0].parent_id])
        ids, mask = [], []
        for t in path:
            ids += t.prompt_ids.tolist() + t.output_ids.tolist()
            mask += [0] * len(t.prompt_ids) + [1] * len(t.output_ids)
        returns = []
        for k in range(len(path)):
            returns.append(sum(gamma ** (j - k) * (path[j].reward or 0.0) for j in range(k, len(path))))
        out[leaf.id] = (ids, mask, returns)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_concat_matches_slow_reference_on_random_trees(seed):
    rng = np.random.default_rng(seed)
    turns = random_tree(rng, int(rng.integers(1, 14)))
    gamma = float(rng.choice([0.0, 0.5, 0.9, 1.0]))
    rows = export_concat(list(reversed(turns)), gamma=gamma)
    want = slow_reference(turns, gamma)
    assert sorted(r.leaf_id for r in rows) == sorted(want)
    for row in rows:
        ids, mask, returns = want[row.leaf_id]
        assert row.input_ids.tolist() == ids and row.loss_mask.tolist() == mask
        np.testing.assert_allclose(row.turn_returns, returns, atol=1e-12)
        assert (row.logprobs[row.loss_mask == 0] == 0).all() and (row.versions[row.loss_mask == 0] == -1).all()
        assert set(row.turn_ids[row.loss_mask == 1].tolist()) <= set(range(len(returns)))
    ind = export_individual(turns, gamma=gamma)
    assert len(ind) == len(turns) - len(abandoned_retries(turns))
    for row in ind:
        assert row.loss_mask.sum() == len(next(t for t in turns if t.id == row.leaf_id).output_ids)
