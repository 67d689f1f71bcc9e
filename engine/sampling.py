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
from dataclasses import dataclass, field
from typing import Any

import torch


class InvalidRequest(ValueError):
    """A request the engine refuses (HTTP 400); the message says what is wrong and how to fix it."""


# SGLang keys the embedded engine accepts but that only shape the returned text.
_IGNORED_KEYS = {"spaces_between_special_tokens"}


def _number(name: str, value: Any, *, integer: bool = False) -> float | int:
    # bool is an int in Python; a JSON true/false is never a valid number here.
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise InvalidRequest(f"sampling_params.{name} must be {kind}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise InvalidRequest(f"sampling_params.{name} must be finite, got {value!r}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"sampling_params.{name} must be true or false, got {value!r}")
    return value


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    # SGLang's penalties (srt/sampling/penaltylib), all over the row's output tokens only
    frequency_penalty: float = 0.0  # minus penalty x count of the token so far
    presence_penalty: float = 0.0  # minus penalty once the token appeared
    repetition_penalty: float = 1.0  # logit / p if positive else logit x p, once the token appeared
    min_new_tokens: int = 0  # stop tokens (stop_token_ids + EOS) are impossible before this many outputs
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits
    # SGLang's grammar constraints (engine/grammar.py), at most one; the text as sent
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

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
        for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
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
        params = cls()
        known = {f for f in cls.__dataclass_fields__} | {"n"} | _IGNORED_KEYS
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(
                f"unsupported sampling_params {unknown}; the embedded engine accepts {sorted(known)}"
            )
        values = {k: v for k, v in raw.items() if v is not None}
        if "n" in values and _number("n", values["n"], integer=True) != 1:
            raise InvalidRequest("sampling_params.n must be 1 (send one request per sample)")
        if "max_new_tokens" in values:
            params.max_new_tokens = int(_number("max_new_tokens", values["max_new_tokens"], integer=True))
            if params.max_new_tokens < 0:
                raise InvalidRequest(f"sampling_params.max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if "temperature" in values:
            params.temperature = float(_number("temperature", values["temperature"]))
            if params.temperature < 0:
                raise InvalidRequest(f"sampling_params.temperature must be >= 0, got {params.temperature}")
        if "top_p" in values:
            params.top_p = float(_number("top_p", values["top_p"]))
            if not 0.0 < params.top_p <= 1.0:
                raise InvalidRequest(f"sampling_params.top_p must be in (0, 1], got {params.top_p}")
        if "top_k" in values:
            params.top_k = int(_number("top_k", values["top_k"], integer=True))
            if params.top_k != -1 and params.top_k < 1:
                raise InvalidRequest(f"sampling_params.top_k must be -1 (off) or >= 1, got {params.top_k}")
        if "min_p" in values:
            params.min_p = float(_number("min_p", values["min_p"]))
            if not 0.0 <= params.min_p <= 1.0:
                raise InvalidRequest(f"sampling_params.min_p must be in [0, 1], got {params.min_p}")
        if "stop" in values:
            stop = values["stop"]
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                raise InvalidRequest("sampling_params.stop must be a non-empty string or a list of them")
            params.stop = stop
        if "stop_token_ids" in values:
            ids = values["stop_token_ids"]
            if not isinstance(ids, list):
                raise InvalidRequest("sampling_params.stop_token_ids must be a list of token ids")
            for t in ids:
                _number("stop_token_ids[]", t, integer=True)
                if not 0 <= t < vocab_size:
                    raise InvalidRequest(f"sampling_params.stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
            params.stop_token_ids = [int(t) for t in ids]
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            if name in values:
                setattr(params, name, _flag(name, values[name]))
        for name, low, high in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
            if name in values:
                value = float(_number(name, values[name]))
                if not low <= value <= high:
                    raise InvalidRequest(f"sampling_params.{name} must be in [{low}, {high}], got {value}")
                setattr(params, name, value)
        if "repetition_penalty" in values:
            params.repetition_penalty = float(_number("repetition_penalty", values["repetition_penalty"]))
            if not 0.0 < params.repetition_penalty <= 2.0:
                raise InvalidRequest(f"sampling_params.repetition_penalty must be in (0, 2], got {params.repetition_penalty}")
        if "min_new_tokens" in values:
            params.min_new_tokens = int(_number("min_new_tokens", values["min_new_tokens"], integer=True))
            if params.min_new_tokens < 0:
                raise InvalidRequest(f"sampling_params.min_new_tokens must be >= 0, got {params.min_new_tokens}")
        if "logit_bias" in values:
            bias = values["logit_bias"]
            if not isinstance(bias, dict):
                raise InvalidRequest("sampling_params.logit_bias must be an object of token id -> bias")
            for key, value in bias.items():
                if not (isinstance(key, str) and key.isdigit() and int(key) < vocab_size):
                    raise InvalidRequest(f"sampling_params.logit_bias: key {key!r} is not a token id in [0, {vocab_size})")
                params.logit_bias[int(key)] = float(_number(f"logit_bias[{key}]", value))
        grammars = []
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if name in values:
                if not isinstance(values[name], str):
                    raise InvalidRequest(f"sampling_params.{name} must be a string, got {type(values[name]).__name__}")
                if values[name]:  # SGLang treats "" as unset
                    setattr(params, name, values[name])
                    grammars.append(name)
        if len(grammars) > 1:
            raise InvalidRequest(f"only one of json_schema, regex, ebnf, or structural_tag can be set; got {grammars}")
        if "sampling_seed" in values:
            params.sampling_seed = int(_number("sampling_seed", values["sampling_seed"], integer=True))
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
