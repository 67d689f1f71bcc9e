"""Request fields that constrain what the model may sample: penalties, grammars, and the refusal of the rest.

An agent that asks for JSON (``response_format``) or a forced tool call (``tool_choice: "required"`` or a
named function) relies on the server *enforcing* it; a gateway that accepted such a field and sampled
without it would hand the agent free text and the trainer a distribution nobody asked for. Every such
field is either enforced or refused with a 400 naming it (``param``), before anything is planned or
recorded.

Grammars (:func:`grammar_of`, checked by :func:`check_grammar`) are sent as SGLang's native sampling
parameters (the embedded engine implements them, ``engine/grammar.py``; vLLM gets its
``structured_outputs``, ``engines/vllm.py``):

| request | engine constraint |
|---|---|
| ``response_format`` ``json_object`` | ``json_schema: '{"type": "object"}'`` (what SGLang's own OpenAI server sends) |
| ``response_format`` ``json_schema`` (``strict`` or not) | ``json_schema``: the schema as JSON text |
| ``regex`` / ``ebnf`` (SGLang's and vLLM's extension fields) | ``regex`` / ``ebnf`` |
| ``tool_choice`` ``"required"`` / named function | ``ebnf``: one or more ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks (the format the chat layer parses, ``gateway/chat/tool_parser.py``), each call compact JSON held to its function's ``parameters`` schema; only the named function when one is named; exactly one block with ``parallel_tool_calls: false`` |
| ``tools`` with ``tool_choice`` ``auto`` and a JSON ``response_format`` | ``ebnf``: either tool-call blocks or the JSON |

A forced tool call together with a JSON ``response_format`` is refused (as SGLang does: both cannot be
honoured). ``parallel_tool_calls: false`` (Messages: ``disable_parallel_tool_use``) is enforced when a call is
forced; with ``tool_choice: "auto"`` it is accepted and not enforced, on purpose: Codex-style clients send it
on every request, and a grammar there would make every such turn grammar-constrained and so untrainable
(``docs/export.md``); the turn records exactly what was sampled, with the flag.

Penalties are enforced: ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` and the vLLM
extensions ``repetition_penalty``, ``min_tokens`` are sent as SGLang's own ``sampling_params``
(:func:`penalties`; the embedded engine implements them as SGLang does, ``engine/sampling.py``) and
recorded with the turn under their OpenAI names (:func:`penalties_json`). A grammar is recorded too
(``params.grammar``: kind, origin and the constraint's text), so export can tell the turn was masked.

The checks run on the conversation core's request (:class:`~gateway.wire.ChatCompletionRequest` or
:class:`~gateway.wire.CompletionRequest`); the Responses and Messages formats hand the core their
``wire_names`` with it (``CoreRequest.wire_names``, passed on as ``names`` here), which map the core's
field names back onto their own wire names (``text.format``, ``tool_choice.type``), so the error points at
what their client sent.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.chat.errors import ChatFormatError
from gateway.chat.normalize import validate_tools
from gateway.errors import InvalidRequest
from gateway.wire import ChatCompletionRequest, CompletionRequest, SamplingFields

_NOT_YET = "is not enforced by this gateway yet, and it refuses rather than silently ignoring it"


def _refuse(field: str, what: str, hint: str, names: Mapping[str, str]) -> InvalidRequest:
    param = names.get(field, field)
    return InvalidRequest(f"{param}: {what} {_NOT_YET}; {hint}", param=param, code="unsupported_parameter")


def _extra(req: SamplingFields, name: str) -> Any:
    return (req.model_extra or {}).get(name)


def penalties_json(req: SamplingFields, names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The penalties a request asks for, under their OpenAI names, non-default ones only: recorded with
    the turn (its ``params``) so that export and trainer can tell the turn was sampled under them.
    ``repetition_penalty`` (in (0, 2]) and ``min_tokens`` (>= 0) are vLLM's extension names."""
    names = names or {}
    out: dict[str, Any] = {}
    if req.presence_penalty:
        out["presence_penalty"] = req.presence_penalty
    if req.frequency_penalty:
        out["frequency_penalty"] = req.frequency_penalty
    if req.logit_bias:
        out["logit_bias"] = dict(req.logit_bias)
    repetition = _extra(req, "repetition_penalty")
    if repetition is not None:
        if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or not 0 < repetition <= 2:
            param = names.get("repetition_penalty", "repetition_penalty")
            raise InvalidRequest(f"{param} must be a number in (0, 2], got {repetition!r}", param=param)
        if repetition != 1:
            out["repetition_penalty"] = float(repetition)
    min_tokens = _extra(req, "min_tokens")
    if min_tokens is not None:
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            param = names.get("min_tokens", "min_tokens")
            raise InvalidRequest(f"{param} must be an integer >= 0, got {min_tokens!r}", param=param)
        if min_tokens:
            out["min_tokens"] = min_tokens
    return out


_SGLANG_NAMES = {"min_tokens": "min_new_tokens"}  # the rest are SGLang's names too (SamplingParams, 0.5.19)


def penalties(req: SamplingFields) -> dict[str, Any]:
    """The request's penalties as SGLang ``sampling_params`` (which the embedded engine implements too)."""
    return {_SGLANG_NAMES.get(k, k): v for k, v in penalties_json(req).items()}


def refuse_unenforced(req: ChatCompletionRequest | CompletionRequest,
                      names: Mapping[str, str] | None = None) -> None:
    """Raise :class:`InvalidRequest` (400, ``param`` set) for the first constraint the gateway would not
    enforce, or that is malformed (what :func:`grammar_of` checks without compiling). ``names`` maps core
    field names to the caller's wire names for the error (default: the core's own names)."""
    names = names or {}
    penalties_json(req, names)  # validates the extensions' values
    if isinstance(req, CompletionRequest):
        if req.best_of is not None and req.best_of != req.n:
            raise _refuse("best_of", f"best_of={req.best_of}", "leave it unset (n choices are all returned)",
                          names)
        if req.suffix:
            raise _refuse("suffix", "suffix (insertion)", "leave it unset", names)
    grammar_of(req, names)


# ------------------------------------------------------------------------------------------------ grammars

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"  # gateway/chat/tool_parser.py strips the newlines
JSON_OBJECT = '{"type": "object"}'
_BLOCK = "tool_call_block"


@dataclass(frozen=True, slots=True)
class Grammar:
    """One request's grammar constraint, as the engine gets it (SGLang's sampling key and its text).

    Tool-call grammars are EBNF built by :func:`check_grammar` (``source`` is empty until then) from
    ``tools``: each function's call object as a JSON schema, compiled by xgrammar to compact JSON (no
    free whitespace: a weak model cannot pad forever), wrapped in the ``<tool_call>`` tags."""

    kind: str  # "json_schema" | "regex" | "ebnf" | "structural_tag"
    source: str
    origin: str  # what asked for it: "response_format" | "tool_choice" | "regex" | "ebnf"
    param: str  # the wire name to blame when it does not compile
    tools: tuple[tuple[str, str], ...] = ()  # (call JSON schema, param of its parameters) of the callable tools
    one_call: bool = False  # parallel_tool_calls: false
    or_json: str | None = None  # tools with tool_choice auto: calls, or JSON of this schema

    def sampling(self) -> dict[str, str]:
        return {self.kind: self.source}

    def record(self) -> dict[str, str]:
        """What the turn records (``params.grammar``)."""
        return {"kind": self.kind, "origin": self.origin, "source": self.source}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _functions(req: ChatCompletionRequest, names: Mapping[str, str]) -> list[tuple[int, Mapping[str, Any]]]:
    """(index, function) of the request's function tools. ``tools`` is any JSON on the wire (``wire.py``)
    and this runs before the conversation is planned, so the chat layer's validation of ``tools`` runs here
    first: ``"tools": 5`` is a 400 naming ``tools`` (it was the ``TypeError`` of iterating ``5``, a 500),
    and a malformed tool is blamed as such, not as a ``tool_choice`` that has no tools to force."""
    try:
        validate_tools(req.tools)
    except ChatFormatError as exc:
        param = names.get(exc.param, exc.param) if exc.param else names.get("tools", "tools")
        raise InvalidRequest(exc.message, param=param, code=exc.code) from exc
    out = []
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            out.append((i, fn))
    return out


def _call_schema(fn: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON schema of one call object the chat layer parses: ``{"name": <this>, "arguments": {...}}``."""
    parameters = fn.get("parameters")
    if not isinstance(parameters, Mapping):
        parameters = {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": dict(parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _response_schema(req: ChatCompletionRequest | CompletionRequest,
                     names: Mapping[str, str]) -> tuple[str, str] | None:
    """(JSON schema text, param) of a JSON ``response_format``, None for text or none."""
    fmt = getattr(req, "response_format", None) or _extra(req, "response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("response_format.type must be 'text', 'json_object' or 'json_schema'",
                             param=names.get("response_format.type", "response_format.type"))
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT, names.get("response_format", "response_format")
    param = names.get("response_format.json_schema.schema", "response_format.json_schema.schema")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, Mapping):
        raise InvalidRequest("response_format json_schema needs json_schema.schema: a JSON schema object",
                             param=param)
    return _dumps(schema), param


def _forced(req: ChatCompletionRequest, fns: list[tuple[int, Mapping[str, Any]]],
            names: Mapping[str, str]) -> list[tuple[int, Mapping[str, Any]]] | None:
    """The functions a forced ``tool_choice`` allows, None when no call is forced."""
    choice = req.tool_choice
    if choice != "required" and not isinstance(choice, Mapping):
        return None
    param = names.get("tool_choice", "tool_choice")
    if not fns:
        raise InvalidRequest("tool_choice forces a tool call but the request has no tools; add tools or "
                             "use tool_choice 'auto'", param=param)
    if choice == "required":
        return fns
    fn_field = choice.get("function")
    wanted = fn_field.get("name") if isinstance(fn_field, Mapping) else None
    if choice.get("type") != "function" or not isinstance(wanted, str):
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", param=param)
    named = [(i, fn) for i, fn in fns if fn["name"] == wanted]
    if not named:
        raise InvalidRequest(f"tool_choice names function {wanted!r}, which is not in tools "
                             f"({', '.join(fn['name'] for _, fn in fns)})", param=param)
    return named[:1]


def grammar_of(req: ChatCompletionRequest | CompletionRequest,
               names: Mapping[str, str] | None = None) -> Grammar | None:
    """The request's grammar constraint (module table), or None; :class:`InvalidRequest` for a malformed or
    contradictory one. Cheap (no compiling): :func:`check_grammar` builds and compiles it."""
    names = names or {}
    found: list[Grammar] = []
    for kind in ("regex", "ebnf"):
        value = _extra(req, kind)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise InvalidRequest(f"{kind} must be a string", param=names.get(kind, kind))
        found.append(Grammar(kind, value, kind, names.get(kind, kind)))
    schema = _response_schema(req, names)
    chat = isinstance(req, ChatCompletionRequest) and req.tool_choice != "none"
    fns = _functions(req, names) if chat else []  # type: ignore[arg-type]
    forced = _forced(req, fns, names) if chat else None  # type: ignore[arg-type]
    if forced is not None and (schema is not None or found):
        raise InvalidRequest("tool_choice 'required' or a named tool cannot be combined with response_format, "
                             "regex or ebnf: the tool-call constraint and the output constraint cannot both be "
                             "honoured", param=names.get("tool_choice", "tool_choice"))

    def tools(chosen: list[tuple[int, Mapping[str, Any]]]) -> tuple[tuple[str, str], ...]:
        template = names.get("tools[].function.parameters", "tools[].function.parameters")
        return tuple((_dumps(_call_schema(fn)), template.replace("[]", f"[{i}]")) for i, fn in chosen)

    one = isinstance(req, ChatCompletionRequest) and req.parallel_tool_calls is False
    if forced is not None:
        found.append(Grammar("ebnf", "", "tool_choice", names.get("tool_choice", "tool_choice"), tools(forced), one))
    elif schema is not None and fns:
        found.append(Grammar("ebnf", "", "response_format", schema[1], tools(fns), one, schema[0]))
    elif schema is not None:
        found.append(Grammar("json_schema", schema[0], "response_format", schema[1]))
    if len(found) > 1:
        raise InvalidRequest(f"only one output constraint can be enforced per request; got "
                             f"{', '.join(g.origin for g in found)}", param=found[1].param)
    return found[0] if found else None


def xgrammar_message(exc: BaseException) -> str:
    """The first line of an xgrammar error without its ``[time] file.cc:line:`` prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", text)


_WHAT = {"json_schema": "is not a JSON schema the grammar engine can enforce",
         "regex": "is not a regular expression that compiles", "ebnf": "is not an EBNF grammar that compiles",
         "structural_tag": "does not compile to a grammar"}


def _compiled(kind: str, text: str, param: str) -> Any:
    """xgrammar's Grammar of ``text``; a 400 naming ``param`` if it does not compile."""
    import xgrammar  # imported on first use (seconds), so only where a grammar is asked for

    try:
        if kind == "json_schema":
            json.loads(text)
            return xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgrammar.Grammar.from_ebnf(text)
        return xgrammar.Grammar.from_structural_tag(text)
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors derive from RuntimeError
        raise InvalidRequest(f"{param} {_WHAT[kind]}: {xgrammar_message(exc)}", param=param) from exc


def _tool_calls_ebnf(grammar: Grammar) -> Any:
    """One ``<tool_call>`` block per call (``one_call``: exactly one; else one or more, newline-separated)."""
    import xgrammar

    calls = [_compiled("json_schema", schema, param) for schema, param in grammar.tools]
    body = calls[0] if len(calls) == 1 else xgrammar.Grammar.union(*calls)
    block = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(f"root ::= {_dumps(CALL_OPEN)}"), body,
                                    xgrammar.Grammar.from_ebnf(f"root ::= {_dumps(CALL_CLOSE)}"))
    if grammar.one_call:
        return block
    text = re.sub(r"^root ::=", f"{_BLOCK} ::=", str(block), count=1, flags=re.M)
    return xgrammar.Grammar.from_ebnf(f'root ::= {_BLOCK} ("\\n" {_BLOCK})*\n{text}')


def check_grammar(grammar: Grammar) -> Grammar:
    """The grammar compiled with xgrammar (the library SGLang and the embedded engine use), a tool-call
    grammar built into its EBNF text first; a failure is a 400 naming the field (each tool's ``parameters``
    compiled on its own, to blame the right one). Blocking (the first call imports xgrammar): run it off the
    event loop."""
    if not grammar.tools:
        _compiled(grammar.kind, grammar.source, grammar.param)
        return grammar
    import xgrammar

    built = _tool_calls_ebnf(grammar)
    if grammar.or_json is not None:
        built = xgrammar.Grammar.union(built, _compiled("json_schema", grammar.or_json, grammar.param))
    return dataclasses.replace(grammar, source=str(built))
