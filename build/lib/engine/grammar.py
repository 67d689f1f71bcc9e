"""Grammar-constrained decoding: SGLang's ``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag``.

The grammar library is xgrammar (what SGLang uses by default). :class:`Grammars` compiles a request's
constraint once, at parse time (a grammar that does not compile is a 400, like SGLang's
``Failed to compile ... grammar``); compiled grammars are cached by the compiler, so a schema sent on
every turn compiles once. Each constrained request gets its own :class:`xgrammar.GrammarMatcher`; the
scheduler asks :func:`mask_rows` for the logits of the constrained rows of the batch only, then advances
each matcher with the token sampled (:func:`advance`). Unconstrained rows cost nothing: with no
constrained row in the batch nothing here runs.

Masking is plain torch on whatever device the logits are on (CPU here, CUDA on a GPU engine): xgrammar
fills one int32 bitmask row per constrained request on the CPU (a set bit = allowed token), the rows are
unpacked to booleans on the logits' device and disallowed tokens set to ``-inf``. Everything after that
(penalties, temperature, top-k/top-p, the draw, the reported logprob) works on the masked logits, so the
reported logprobs are those of the distribution actually sampled from: masked and renormalised over the
allowed tokens (``engine/sampling.py``).

Semantics (same keys as SGLang 0.5.19's ``SamplingParams``; at most one of the four may be set):

- ``json_schema``: a JSON schema as a string, compiled with ``any_whitespace=False`` (compact JSON with
  ``", "`` / ``": "`` separators: a model cannot pad with whitespace forever) and xgrammar's strict mode
  (no properties beyond the schema's); ``"$$ANY$$"`` is any JSON value (SGLang's convention);
- ``regex``: the whole output matches the regular expression;
- ``ebnf``: an EBNF grammar in xgrammar's (GBNF-like) syntax with a ``root`` rule;
- ``structural_tag``: xgrammar's structural-tag JSON (the gateway uses it to force tool calls).

Once the grammar is complete only the row's stop tokens (EOS and ``stop_token_ids``) are allowed, so a
constrained output ends with a stop token unless ``max_new_tokens`` cuts it first.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.sampling import InvalidRequest

KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
ANY_JSON = "$$ANY$$"


class Grammars:
    """The xgrammar compiler of one model's tokenizer (built on first use: it scans the vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, kind: str, source: str) -> Any:
        """The compiled grammar; :class:`InvalidRequest` naming the key if it does not compile."""
        compiler = self.compiler()
        try:
            if kind == "json_schema":
                if source == ANY_JSON:
                    return compiler.compile_builtin_json_grammar()
                json.loads(source)  # a clear message for text that is not JSON at all
                return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "ebnf":
                return compiler.compile_grammar(source)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(source)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from RuntimeError
            raise InvalidRequest(f"sampling_params.{kind} does not compile: {_first_line(exc)}") from exc
        raise InvalidRequest(f"unknown grammar kind {kind!r}; valid: {', '.join(KINDS)}")

    def matcher(self, compiled: Any, stop_ids: Iterable[int]) -> Any:
        """A fresh matcher for one request; the grammar may end only on one of ``stop_ids``."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_ids)))


def _first_line(exc: BaseException) -> str:
    """The first line of an xgrammar error without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text)


_BITS = torch.arange(32, dtype=torch.int32)


def mask_rows(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Any]) -> torch.Tensor:
    """A copy of ``logits`` (B, V) with, in each of ``rows``, every token its matcher disallows at ``-inf``.

    The bitmask is xgrammar's layout: (len(rows), ceil(V / 32)) int32, bit ``t % 32`` of word ``t // 32``
    set when token ``t`` is allowed."""
    import xgrammar

    vocab = logits.shape[-1]
    bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)
    for j, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, j)
    bits = bitmask.to(logits.device)
    allowed = ((bits[:, :, None] >> _BITS.to(logits.device)) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    out = logits.clone()
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def advance(matcher: Any, token: int) -> bool:
    """Feed the sampled token to the row's matcher; False if the grammar refuses it (never expected: the
    token was drawn from the masked distribution)."""
    if matcher.is_terminated():
        return True
    return bool(matcher.accept_token(token))
