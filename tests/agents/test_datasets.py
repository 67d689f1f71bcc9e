"""GSM8K parsing and its errors, the synthetic task, and dataset spec strings."""

import json
from pathlib import Path

import pytest

from agents.datasets import (DatasetError, Sample, load_dataset, load_gsm8k, read_gsm8k_jsonl, synthetic,
                             synthetic_shape)
from agents.rewards import math_reward

REPO = Path(__file__).resolve().parents[2]
GSM8K_DIR = REPO.parent / "shared" / "data" / "gsm8k"

ROW = {"question": "Ann has 2 apples and gets 3 more. How many?", "answer": "2 + 3 = 5\n#### 5"}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_jsonl(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [json.dumps(ROW), "", json.dumps({**ROW, "id": "q7"})])
    samples = read_gsm8k_jsonl(path)
    assert samples == [Sample("train-1", ROW["question"], ROW["answer"]), Sample("q7", ROW["question"], ROW["answer"])]
    assert load_gsm8k(tmp_path, "train") == samples  # a directory of <split>.jsonl


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DatasetError, match=r"nope\.jsonl does not exist"):
        load_gsm8k(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match=r"without test\.jsonl"):
        load_gsm8k(tmp_path, "test")


def test_bad_json_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(ROW), json.dumps(ROW), '{"question": "x", "answer": '])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: not valid JSON"):
        read_gsm8k_jsonl(path)


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, r":1: missing field 'answer'"),
    ({"answer": "#### 1"}, r":1: missing field 'question'"),
    ({"question": "q", "answer": 5}, r":1: field 'answer' must be a non-empty string"),
    ({"question": "q", "answer": "five"}, r":1: 'answer' has no '#### <number>'"),
    (["q", "a"], r":1: expected a JSON object"),
])
def test_malformed_rows(tmp_path, row, message):
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps(row)])
    with pytest.raises(DatasetError, match=message):
        read_gsm8k_jsonl(path)


def test_empty_file(tmp_path):
    with pytest.raises(DatasetError, match="holds no rows"):
        read_gsm8k_jsonl(write_lines(tmp_path / "empty.jsonl", [""]))


def test_repo_gsm8k_data():
    if not (GSM8K_DIR / "test.jsonl").is_file():
        pytest.skip(f"GSM8K not found at {GSM8K_DIR}")
    samples = load_dataset(f"gsm8k:{GSM8K_DIR}", split="test", limit=5, offset=1)
    assert len(samples) == 5 and samples[0].id == "test-2"
    full = load_gsm8k(GSM8K_DIR / "test.jsonl")
    assert len(full) == 1319
    # every reference parses, and the reference solution scores 1.0 against itself
    assert all(math_reward(s.answer, s.answer) == 1.0 for s in full)


def test_synthetic_is_deterministic_and_correct():
    a = synthetic(50, difficulty=5, seed=3)
    assert a == synthetic(50, difficulty=5, seed=3)
    assert a[:10] == synthetic(10, difficulty=5, seed=3)  # a prefix does not depend on n
    assert a != synthetic(50, difficulty=5, seed=4)
    assert [s.question for s in a] != [s.question for s in synthetic(50, difficulty=5, seed=3, split="test")]
    for s in a:
        expression = s.question.removeprefix("What is ").removesuffix("?")
        assert int(s.answer) == eval(expression)  # test-only cross-check of the no-eval evaluator


@pytest.mark.parametrize("difficulty", range(1, 9))
def test_synthetic_difficulty_sets_operands_and_digits(difficulty):
    operands, digits, operators = synthetic_shape(difficulty)
    for s in synthetic(20, difficulty=difficulty, seed=0):
        terms = s.question.removeprefix("What is ").removesuffix("?").split(" ")
        numbers, ops = terms[::2], terms[1::2]
        assert len(numbers) == operands
        assert all(len(n) <= digits for n in numbers) and set(ops) <= set(operators)
    assert synthetic_shape(1) == (2, 1, ("+",))


def test_dataset_specs():
    assert load_dataset("synthetic", limit=3) == synthetic(3)
    assert load_dataset("synthetic:4", limit=2, offset=1, seed=9) == synthetic(3, difficulty=4, seed=9)[1:]
    with pytest.raises(DatasetError, match="difficulty must be 1..8"):
        load_dataset("synthetic:9", limit=1)
    with pytest.raises(DatasetError, match="must be an integer"):
        load_dataset("synthetic:hard", limit=1)
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("mmlu", limit=1)
    with pytest.raises(DatasetError, match="needs a path"):
        load_dataset("gsm8k", limit=1)
    with pytest.raises(DatasetError, match="split must be"):
        load_dataset("synthetic", split="dev")
