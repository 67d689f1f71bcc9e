"""Datasets for the example agents: GSM8K from a file, and a synthetic arithmetic task needing no files.

Every dataset is a list of `Sample` (an id, a question, the reference answer). Pick one with a spec string,
the same one the runner's ``--dataset`` flag takes:

- ``gsm8k:PATH``: GSM8K as JSON lines (``{"question": ..., "answer": "... #### 18"}`` per line). PATH is a
  ``.jsonl`` file, or a directory holding ``<split>.jsonl`` (``train``/``test``), or a directory written by
  the ``datasets`` library's ``save_to_disk`` (read only if that optional package is installed).
- ``synthetic`` or ``synthetic:D``: arithmetic expressions of difficulty D (default 1). Deterministic for a
  given seed and split; the ``test`` split uses different numbers from ``train``.

    from agents.datasets import load_dataset
    samples = load_dataset("gsm8k:../shared/data/gsm8k", split="test", limit=50)
    samples = load_dataset("synthetic:2", limit=100, seed=0)

Missing or malformed files raise `DatasetError` naming the file (and the line, for JSON lines).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "test")
MAX_DIFFICULTY = 8


class DatasetError(ValueError):
    """A dataset file is missing or malformed, or the spec is wrong; the message says where and how to fix."""


@dataclass(frozen=True)
class Sample:
    """One task: ``answer`` is what the reward function compares against (a bare number or a GSM8K solution)."""

    id: str
    question: str
    answer: str


# --- GSM8K --------------------------------------------------------------------------------------------


def _jsonl_file(path: Path, split: str) -> Path:
    if path.is_dir():
        candidate = path / f"{split}.jsonl"
        if not candidate.is_file():
            raise DatasetError(
                f"{path} is a directory without {split}.jsonl; pass a .jsonl file, or a directory holding "
                f"{'/'.join(s + '.jsonl' for s in SPLITS)}"
            )
        return candidate
    if not path.exists():
        raise DatasetError(f"dataset file {path} does not exist (looked from {Path.cwd()})")
    return path


def read_gsm8k_jsonl(path: str | Path) -> list[Sample]:
    """GSM8K rows from a JSON lines file: every non-blank line an object with string ``question``/``answer``."""
    path = Path(path)
    samples: list[Sample] = []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
                samples.append(_gsm8k_sample(row, where, f"{path.stem}-{lineno}"))
    except FileNotFoundError as exc:
        raise DatasetError(f"dataset file {path} does not exist (looked from {Path.cwd()})") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc}") from exc
    if not samples:
        raise DatasetError(f"dataset file {path} holds no rows")
    return samples


def _gsm8k_sample(row: object, where: str, default_id: str) -> Sample:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object with 'question' and 'answer', got {type(row).__name__}")
    for key in ("question", "answer"):
        if key not in row:
            raise DatasetError(f"{where}: missing field {key!r} (GSM8K rows need 'question' and 'answer')")
        if not isinstance(row[key], str) or not row[key].strip():
            raise DatasetError(f"{where}: field {key!r} must be a non-empty string")
    if "####" not in row["answer"]:
        raise DatasetError(f"{where}: 'answer' has no '#### <number>' final answer")
    return Sample(id=str(row.get("id", default_id)), question=row["question"], answer=row["answer"])


def _is_hub_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in ("dataset_dict.json", "dataset_info.json", "state.json"))


def read_gsm8k_hub(path: str | Path, split: str = "train") -> list[Sample]:
    """GSM8K from a ``datasets`` ``save_to_disk`` directory (a DatasetDict with ``split``, or one Dataset)."""
    path = Path(path)
    try:
        import datasets  # optional: only for this on-disk format
    except ImportError as exc:
        raise DatasetError(
            f"{path} is a Hugging Face `datasets` directory, but the `datasets` package is not installed; "
            f"`pip install datasets`, or pass the GSM8K .jsonl file instead"
        ) from exc
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise DatasetError(f"cannot load the datasets directory {path}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetError(f"{path} has splits {sorted(loaded)}, not {split!r}; pass --split with one of them")
        loaded = loaded[split]
    return [_gsm8k_sample(row, f"{path} [{split}] row {i}", f"{split}-{i}") for i, row in enumerate(loaded)]


def load_gsm8k(path: str | Path, split: str = "train") -> list[Sample]:
    """GSM8K from a .jsonl file, a directory of ``<split>.jsonl`` files, or a ``datasets`` directory."""
    path = Path(path)
    if _is_hub_dir(path):
        return read_gsm8k_hub(path, split)
    return read_gsm8k_jsonl(_jsonl_file(path, split))


# --- synthetic arithmetic -----------------------------------------------------------------------------


def synthetic_shape(difficulty: int) -> tuple[int, int, tuple[str, ...]]:
    """(operands, digits per operand, operators) for a difficulty level from 1 (``3 + 4``) to 8."""
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise DatasetError(f"synthetic difficulty must be 1..{MAX_DIFFICULTY}, got {difficulty}")
    operands = 2 + (difficulty - 1) // 2  # 2, 2, 3, 3, 4, 4, 5, 5
    digits = 1 + difficulty // 2  # 1, 2, 2, 3, 3, 4, 4, 5
    operators = ("+",) if difficulty == 1 else ("+", "-") if difficulty == 2 else ("+", "-", "*")
    return operands, digits, operators


def synthetic(n: int, *, difficulty: int = 1, seed: int = 0, split: str = "train") -> list[Sample]:
    """``n`` arithmetic questions such as "What is 37 + 5 * 12?"; the answer is the exact integer.

    Difficulty sets the number of operands and their digit count (`synthetic_shape`). The same
    (n, difficulty, seed, split) always gives the same samples, and the first k of n are the same for any
    n >= k; splits use disjoint random streams, so ``test`` is held out from ``train``.
    """
    if n < 0:
        raise DatasetError(f"synthetic sample count must be >= 0, got {n}")
    if split not in SPLITS:
        raise DatasetError(f"split must be one of {SPLITS}, got {split!r}")
    operands, digits, operators = synthetic_shape(difficulty)
    rng = random.Random(f"agentrl-synthetic/{seed}/{split}/{difficulty}")  # str seeds are stable across runs
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    samples = []
    for i in range(n):
        terms = [str(rng.randint(low, high))]
        for _ in range(operands - 1):
            terms += [rng.choice(operators), str(rng.randint(low, high))]
        expression = " ".join(terms)
        value = _evaluate_terms(terms)
        samples.append(Sample(id=f"synthetic-d{difficulty}-{split}-{seed}-{i}",
                              question=f"What is {expression}?", answer=str(value)))
    return samples


def _evaluate_terms(terms: list[str]) -> int:
    """Integer value of ``[a, op, b, op, c ...]`` with * before + and - (no eval)."""
    sums: list[int] = [int(terms[0])]
    signs: list[int] = [1]
    for op, number in zip(terms[1::2], terms[2::2]):
        if op == "*":
            sums[-1] *= int(number)
        else:
            sums.append(int(number))
            signs.append(1 if op == "+" else -1)
    return sum(sign * value for sign, value in zip(signs, sums))


# --- spec strings --------------------------------------------------------------------------------------

DEFAULT_SYNTHETIC_SIZE = 1000


def load_dataset(spec: str, *, split: str = "train", limit: int | None = None, seed: int = 0,
                 offset: int = 0) -> list[Sample]:
    """Samples for a ``--dataset`` spec (``gsm8k:PATH``, ``synthetic``, ``synthetic:D``), sliced
    ``[offset:offset+limit]``; ``limit=None`` takes all (``DEFAULT_SYNTHETIC_SIZE`` for synthetic)."""
    if split not in SPLITS:
        raise DatasetError(f"split must be one of {SPLITS}, got {split!r}")
    if offset < 0 or (limit is not None and limit < 0):
        raise DatasetError(f"offset and limit must be >= 0, got offset={offset} limit={limit}")
    kind, _, arg = spec.partition(":")
    if kind == "gsm8k":
        if not arg:
            raise DatasetError("gsm8k needs a path: --dataset gsm8k:PATH (a .jsonl file or a directory of them)")
        samples = load_gsm8k(arg, split)
    elif kind == "synthetic":
        try:
            difficulty = int(arg) if arg else 1
        except ValueError as exc:
            raise DatasetError(f"synthetic difficulty must be an integer: --dataset synthetic:2, got {arg!r}") from exc
        count = offset + (limit if limit is not None else DEFAULT_SYNTHETIC_SIZE)
        samples = synthetic(count, difficulty=difficulty, seed=seed, split=split)
    else:
        raise DatasetError(f"unknown dataset {spec!r}; use gsm8k:PATH, synthetic or synthetic:DIFFICULTY")
    end = None if limit is None else offset + limit
    return samples[offset:end]
