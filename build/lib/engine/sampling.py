"""Per-request sampling parameters and the batched sampler.

``SamplingParams.parse`` validates SGLang's ``sampling_params`` object (same keys and defaults as SGLang's
``SamplingParams``, see docs/sglang-protocol.md) and raises ``InvalidRequest`` with a message that names the
bad key. ``sample`` draws one token per row of a ``(B, V)`` logits batch, each row under its own parameters
and its own ``torch.Generator``.

Logprob convention (documented in docs/engine.md): the returned log-probability is that of the sampled
token under the distribution actually sampled from, i.e. ``log_softmax(logits / T)`` restricted to the
top-k / top-p / min-p support and renormalised over it, after SGLang's penalties and ``logit_bias``
(:func:`penalise`) where a row has them, and over the tokens its grammar allows where it has one (the
scheduler masks those rows' logits first, ``engine/grammar.py``: masked and renormalised). Greedy rows (``temperature == 0``) report
``log_softmax(logits)`` (temperature 1). With ``temperature=1, top_p=1, top_k=-1, min_p=0`` this is exactly
the log-softmax of the model's logits, the value a trainer recomputes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch


class InvalidRequest(ValueError):
    """A request the engine refuses (HTTP 400); the message says what is wrong and how to fix it."""


# SGLang keys the embedded engine accepts but that only shape the returned text.
_IGNORED_KEYS = {"spaces_between_special_tokens"}
_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def _number(name: str, value: Any, *, integer: bool = False) -> float | int:
    # bool is an int in Python; a JSON true/false is never a valid number here.
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise InvalidRequest(f"sampling_params.{name} must be {kind}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise InvalidRequest(f"sampling_params.{name} must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class _Scalar:
    """A scalar key's type and the values it accepts; the error message states the range from the same fields.

    ``[low, high]``, or ``(low, high]`` with ``open_low``; no ``high``: ``>= low``; no ``low``: any value.
    ``off``: one value outside the range that turns the feature off (``top_k = -1``)."""

    kind: type  # int, float or bool
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    off: int | None = None

    @property
    def rule(self) -> str:
        if self.high is None:
            rule = f">= {self.low}"
        else:
            rule = f"in {'(' if self.open_low else '['}{self.low}, {self.high}]"
        return rule if self.off is None else f"{self.off} (off) or {rule}"

    def __call__(self, name: str, value: Any, vocab_size: int) -> Any:
        if self.kind is bool:
            if not isinstance(value, bool):
                raise InvalidRequest(f"sampling_params.{name} must be true or false, got {value!r}")
            return value
        number = self.kind(_number(name, value, integer=self.kind is int))
        if self.low is None or number == self.off:
            return number
        above = number > self.low if self.open_low else number >= self.low
        if not (above and (self.high is None or number <= self.high)):
            raise InvalidRequest(f"sampling_params.{name} must be {self.rule}, got {number}")
        return number


def _stop(name: str, value: Any, vocab_size: int) -> list[str]:
    stop = [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("sampling_params.stop must be a non-empty string or a list of them")
    return stop


def _stop_token_ids(name: str, value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, list):
        raise InvalidRequest("sampling_params.stop_token_ids must be a list of token ids")
    for t in value:
        _number("stop_token_ids[]", t, integer=True)
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"sampling_params.stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in value]


def _logit_bias(name: str, value: Any, vocab_size: int) -> dict[int, float]:
    if not isinstance(value, dict):
        raise InvalidRequest("sampling_params.logit_bias must be an object of token id -> bias")
    bias = {}
    for key, b in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
            raise InvalidRequest(f"sampling_params.logit_bias: key {key!r} is not a token id in [0, {vocab_size})")
        bias[int(key)] = float(_number(f"logit_bias[{key}]", b))
    return bias


def _grammar(name: str, value: Any, vocab_size: int) -> str | None:
    if not isinstance(value, str):
        raise InvalidRequest(f"sampling_params.{name} must be a string, got {type(value).__name__}")
    return value or None  # SGLang treats "" as unset


def _key(default: Any, parse: Callable[[str, Any, int], Any]) -> Any:
    """A ``sampling_params`` key: its default (``list`` / ``dict``: a fresh empty one) and its parser."""
    if default in (list, dict):
        return field(default_factory=default, metadata={"parse": parse})
    return field(default=default, metadata={"parse": parse})


@dataclass
class SamplingParams:
    # The table of accepted keys: type, default (SGLang's), accepted values; ``parse`` checks them in this order.
    max_new_tokens: int = _key(128, _Scalar(int, low=0))
    temperature: float = _key(1.0, _Scalar(float, low=0))
    top_p: float = _key(1.0, _Scalar(float, low=0, high=1, open_low=True))
    top_k: int = _key(-1, _Scalar(int, low=1, off=-1))
    min_p: float = _key(0.0, _Scalar(float, low=0, high=1))
    stop: list[str] = _key(list, _stop)
    stop_token_ids: list[int] = _key(list, _stop_token_ids)
    ignore_eos: bool = _key(False, _Scalar(bool))
    no_stop_trim: bool = _key(False, _Scalar(bool))
    skip_special_tokens: bool = _key(True, _Scalar(bool))
    # SGLang's penalties (srt/sampling/penaltylib), all over the row's output tokens only
    frequency_penalty: float = _key(0.0, _Scalar(float, low=-2.0, high=2.0))  # minus penalty x count so far
    presence_penalty: float = _key(0.0, _Scalar(float, low=-2.0, high=2.0))  # minus penalty once it appeared
    # logit / p if positive else logit x p, once the token appeared
    repetition_penalty: float = _key(1.0, _Scalar(float, low=0, high=2, open_low=True))
    # stop tokens (stop_token_ids + EOS) are impossible before this many outputs
    min_new_tokens: int = _key(0, _Scalar(int, low=0))
    logit_bias: dict[int, float] = _key(dict, _logit_bias)  # added to the logits
    # SGLang's grammar constraints (engine/grammar.py), at most one; the text as sent
    json_schema: str | None = _key(None, _grammar)
    regex: str | None = _key(None, _grammar)
    ebnf: str | None = _key(None, _grammar)
    structural_tag: str | None = _key(None, _grammar)
    sampling_seed: int | None = _key(None, _Scalar(int))

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

    @property
    def penalised(self) -> bool:
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """``(kind, source)`` of the request's grammar constraint, or None."""
        for kind in _GRAMMARS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    @classmethod
    def parse(cls, raw: Any, *, vocab_size: int) -> "SamplingParams":
        """Validate SGLang's ``sampling_params`` object; ``None`` values mean "use the default" as in SGLang."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(raw).__name__}")
        keys = fields(cls)
        known = {f.name for f in keys} | {"n"} | _IGNORED_KEYS
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(
                f"unsupported sampling_params {unknown}; the embedded engine accepts {sorted(known)}"
            )
        values = {k: v for k, v in raw.items() if v is not None}
        if "n" in values and _number("n", values["n"], integer=True) != 1:
            raise InvalidRequest("sampling_params.n must be 1 (send one request per sample)")
        params = cls()
        for key in keys:
            if key.name in values:
                setattr(params, key.name, key.metadata["parse"](key.name, values[key.name], vocab_size))
        grammars = [name for name in _GRAMMARS if getattr(params, name) is not None]
        if len(grammars) > 1:
            raise InvalidRequest(f"only one of json_schema, regex, ebnf, or structural_tag can be set; got {grammars}")
        return params

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The row's private random stream: seeded when the request gives a seed, else from the OS."""
        gen = torch.Generator(device=device)
        seed = self.sampling_seed if self.sampling_seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen.manual_seed(seed % (2**63))
        return gen


def penalise(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
             stop_ids: set[int]) -> torch.Tensor:
    """SGLang's penalties of each penalised row applied to a copy of ``logits`` (B, V), in SGLang's order
    (repetition, frequency, presence, min_new_tokens, logit_bias); unpenalised rows are left as they are.
    ``outputs``: each row's output tokens so far; ``stop_ids``: EOS ids (with each row's stop_token_ids)."""
    rows = [i for i, p in enumerate(params) if p.penalised]
    if not rows:
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p, row = params[i], out[i]
        if outputs[i]:
            counts = torch.bincount(torch.tensor(outputs[i], device=logits.device), minlength=vocab)[:vocab]
            seen = counts > 0
            if p.repetition_penalty != 1.0:
                scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, scaled, row))
            if p.frequency_penalty:
                row.sub_(p.frequency_penalty * counts.to(row.dtype))
            if p.presence_penalty:
                row.sub_(p.presence_penalty * seen.to(row.dtype))
        if len(outputs[i]) < p.min_new_tokens:
            blocked = [t for t in stop_ids | set(p.stop_token_ids) if 0 <= t < vocab]
            row[blocked] = float("-inf")
        for token, bias in p.logit_bias.items():
            row[token] += bias
    return out


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
    outputs: list[list[int]] | None = None, stop_ids: set[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. ``logits``: (B, V) float.

    Penalised rows (:func:`penalise`, needing ``outputs`` and ``stop_ids``) are sampled from their
    penalised logits, and their reported logprobs and distributions are those of the penalised
    distribution (what was actually sampled from).

    Returns (tokens (B,) on CPU, logprobs (B,) on CPU, distributions (B, V)): each row's distribution is the
    log-probabilities the reported logprob comes from (used for top logprobs).

    Filtering is vectorised over the batch with per-row temperature / top-k / top-p / min-p; the draw
    itself is per row so that each request's seed fixes its tokens whatever else is in the batch.
    """
    logits = logits.float()
    if any(p.penalised for p in params):
        logits = penalise(logits, params, outputs or [[] for _ in params], stop_ids or set())
    batch, vocab = logits.shape
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    scaled = logits / temps[:, None]
    logprobs_full = torch.log_softmax(scaled, dim=-1)  # (B, V)

    top_k = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    filtered_rows = (top_k < vocab) | (top_p < 1.0) | (min_p > 0.0)
    if bool(filtered_rows.any()):
        # Only the top max(k) candidates can survive; a partial top-k is much cheaper than a full sort.
        width = vocab if bool((filtered_rows & (top_k >= vocab)).any()) else int(top_k[filtered_rows].max())
        if width < vocab:
            sorted_lp, order = torch.topk(logprobs_full, width, dim=-1, sorted=True)
        else:
            sorted_lp, order = torch.sort(logprobs_full, dim=-1, descending=True)
        ranks = torch.arange(width, device=device)[None, :]
        drop = ranks >= top_k[:, None]
        probs_sorted = sorted_lp.exp()
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop |= mass_before >= top_p[:, None]
        drop |= probs_sorted < (min_p[:, None] * probs_sorted[:, :1])
        drop[:, 0] = False  # the most likely token always survives
        masked_sorted = sorted_lp.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logprobs_full, float("-inf")).scatter(-1, order, masked_sorted)
        sample_lp = torch.where(filtered_rows[:, None], torch.log_softmax(filtered, dim=-1), logprobs_full)
    else:
        sample_lp = logprobs_full

    # Exponential race (equivalent to sampling from softmax(sample_lp)): argmax of logp - log(E), E ~ Exp(1),
    # with E drawn from the row's own generator. Cheaper than multinomial over a large vocabulary.
    argmax = logits.argmax(dim=-1).cpu()
    tokens = torch.empty(batch, dtype=torch.long)
    for row in range(batch):
        if bool(greedy[row]):
            tokens[row] = argmax[row]
        else:
            noise = torch.empty(vocab, device=device).exponential_(generator=generators[row])
            tokens[row] = int((sample_lp[row] - noise.log()).argmax())
    tokens_dev = tokens.to(device)
    chosen = sample_lp.gather(-1, tokens_dev[:, None]).squeeze(-1)
    greedy_lp = logprobs_full.gather(-1, tokens_dev[:, None]).squeeze(-1)  # temperature 1 for greedy rows
    logprobs = torch.where(greedy, greedy_lp, chosen)
    dists = torch.where(greedy[:, None], logprobs_full, sample_lp)
    return tokens, logprobs.cpu(), dists
