"""Per-request sampling parameters and the batched sampler.

``SamplingParams.parse`` validates SGLang's ``sampling_params`` object (same keys and defaults as SGLang's
``SamplingParams``, see docs/sglang-protocol.md) and raises ``InvalidRequest`` with a message that names the
bad key. ``sample`` draws one token per row of a ``(B, V)`` logits batch, each row under its own parameters
and its own ``torch.Generator``.

Logprob convention (documented in docs/engine.md): the returned log-probability is that of the sampled
token under the distribution actually sampled from, i.e. ``log_softmax(logits / T)`` restricted to the
top-k / top-p / min-p support and renormalised over it. Greedy rows (``temperature == 0``) report
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

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

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
        if "sampling_seed" in values:
            params.sampling_seed = int(_number("sampling_seed", values["sampling_seed"], integer=True))
        return params

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The row's private random stream: seeded when the request gives a seed, else from the OS."""
        gen = torch.Generator(device=device)
        seed = self.sampling_seed if self.sampling_seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        gen.manual_seed(seed % (2**63))
        return gen


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. ``logits``: (B, V) float.

    Returns (tokens (B,) on CPU, logprobs (B,) on CPU, distributions (B, V)): each row's distribution is the
    log-probabilities the reported logprob comes from (used for top logprobs).

    Filtering is vectorised over the batch with per-row temperature / top-k / top-p / min-p; the draw
    itself is per row so that each request's seed fixes its tokens whatever else is in the batch.
    """
    logits = logits.float()
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
