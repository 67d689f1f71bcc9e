"""Validation, normalisation and hash chains of chat messages.

A conversation comes back to the gateway through an SDK, which adds or reshapes fields: ``None`` values,
``tool_calls: []``, ``refusal: None``, content as a list of text parts, tool-call arguments re-serialised.
:func:`normalize_message` maps every such variant to one canonical dict, so that the message an SDK sends
back compares equal to the message the gateway returned. :func:`chain_hashes` turns a normalised
conversation into a hash per prefix; the store finds a request's parent turn by looking up those hashes
(O(1) per prefix, no scan). The rules are listed in ``docs/chat.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gateway.chat.errors import ChatFormatError
from gateway.sizedlru import CacheSize, SizedLRU

Message = dict[str, Any]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Message fields that are equivalent to absent when empty: defaults that SDKs add to what they send back.
_EMPTY_DEFAULTS = frozenset({"tool_calls", "annotations", "audio", "function_call", "refusal", "name"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_TEXT_PART_TYPES = {"text"}
_ASSISTANT_PART_TYPES = {"text", "refusal"}


# --------------------------------------------------------------------------------------------- validation


def _require_str(value: object, param: str, what: str) -> str:
    if not isinstance(value, str):
        raise ChatFormatError(f"{what} must be a string, got {type(value).__name__}", param, "invalid_type")
    return value


def _validate_content(content: object, role: str, param: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ChatFormatError(
            f"content of a {role} message must be a string or a list of content parts, "
            f"got {type(content).__name__}",
            param,
            "invalid_type",
        )
    allowed = _ASSISTANT_PART_TYPES if role == "assistant" else _TEXT_PART_TYPES
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if not isinstance(part, Mapping):
            raise ChatFormatError("a content part must be an object", part_param, "invalid_type")
        kind = part.get("type")
        if not isinstance(kind, str) or kind not in allowed:
            raise ChatFormatError(
                f"content part type {kind!r} is not supported for a {role} message "
                f"(supported: {', '.join(sorted(allowed))}); this gateway serves text-only models",
                f"{part_param}.type",
            )
        key = "text" if kind == "text" else "refusal"
        _require_str(part.get(key), f"{part_param}.{key}", f"a {kind} part's {key!r}")


def _validate_tool_calls(calls: object, param: str, seen: set[str]) -> None:
    if not isinstance(calls, list):
        raise ChatFormatError("tool_calls must be a list", param, "invalid_type")
    for j, call in enumerate(calls):
        cp = f"{param}[{j}]"
        if not isinstance(call, Mapping):
            raise ChatFormatError("a tool call must be an object", cp, "invalid_type")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatFormatError("a tool call needs a non-empty string id", f"{cp}.id", "missing_required_parameter")
        if call.get("type", "function") != "function":
            raise ChatFormatError(f"tool call type must be 'function', got {call.get('type')!r}", f"{cp}.type")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatFormatError("a tool call needs a 'function' object", f"{cp}.function", "missing_required_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatFormatError("a tool call needs a function name", f"{cp}.function.name", "missing_required_parameter")
        arguments = fn.get("arguments")
        if not isinstance(arguments, (str, Mapping)):
            raise ChatFormatError(
                "tool call arguments must be a JSON string", f"{cp}.function.arguments", "invalid_type"
            )
        seen.add(call_id)


def _check_unicode(value: object, param: str) -> None:
    """Reject strings that are not valid Unicode text (lone surrogates from ``\\ud800`` JSON escapes):
    the tokenizer cannot take them and they have no UTF-8 form to hash."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ChatFormatError(
                f"text contains an invalid character at position {exc.start} (a lone UTF-16 surrogate)", param
            ) from exc
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_unicode(item, f"{param}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{param}[{i}]")


def validate_tools(tools: object) -> None:
    """Check the request's ``tools`` (``None`` or a list of ``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list", "tools", "invalid_type")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        tp = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ChatFormatError("a tool must be an object", tp, "invalid_type")
        if tool.get("type") != "function":
            raise ChatFormatError(f"tool type must be 'function', got {tool.get('type')!r}", f"{tp}.type")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ChatFormatError("a tool needs a 'function' object", f"{tp}.function", "missing_required_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise ChatFormatError(
                "a function name must be 1-64 characters of a-z, A-Z, 0-9, '_', '.', '-'",
                f"{tp}.function.name",
            )
        if name in names:
            raise ChatFormatError(f"duplicate function name {name!r}", f"{tp}.function.name")
        names.add(name)
        if fn.get("description") is not None:
            _require_str(fn["description"], f"{tp}.function.description", "description")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ChatFormatError("parameters must be a JSON Schema object", f"{tp}.function.parameters", "invalid_type")


def validate_tool_choice(tool_choice: object, tools: object) -> None:
    """Check ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or a function named in ``tools``."""
    if tool_choice is None or tool_choice == "none":
        return
    if tool_choice in ("auto", "required"):
        if tool_choice == "required" and not tools:
            raise ChatFormatError("tool_choice 'required' needs tools", "tool_choice")
        return
    if isinstance(tool_choice, str):
        raise ChatFormatError(
            f"tool_choice must be 'none', 'auto', 'required' or a function object, got {tool_choice!r}", "tool_choice"
        )
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ChatFormatError("tool_choice object must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    names = [
        t["function"].get("name")
        for t in (tools if isinstance(tools, list) else [])
        if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
    ]  # a list, not a set: names may be any JSON value (unhashable) until validate_tools has run
    if name not in names:
        raise ChatFormatError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice.function.name")


def validate_messages(messages: object, tools: object = None) -> None:
    """Raise :class:`ChatFormatError` (with the JSON path in ``param``) if the request is malformed.

    Checks: a non-empty list of objects; known roles; content present and text-only where required
    (system, developer, user, tool; an assistant message may have none, as the gateway's own empty
    replies come back that way); well-formed tool calls with unique ids; every ``tool`` message answers
    a tool call of an earlier assistant message; well-formed ``tools``; no lone surrogates in any string.
    """
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list", "messages", "invalid_type")
    if not messages:
        raise ChatFormatError("messages must not be empty", "messages")
    call_ids: set[str] = set()
    for i, msg in enumerate(messages):
        mp = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatFormatError("a message must be an object", mp, "invalid_type")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatFormatError(
                f"unknown role {role!r}; valid roles: {', '.join(sorted(ROLES))}", f"{mp}.role"
            )
        content = msg.get("content")
        if msg.get("name") is not None:
            _require_str(msg["name"], f"{mp}.name", "name")
        if role == "assistant":
            if content is not None:
                _validate_content(content, role, f"{mp}.content")
            calls = msg.get("tool_calls")
            if calls is not None:
                before = len(call_ids)
                _validate_tool_calls(calls, f"{mp}.tool_calls", call_ids)
                if len(call_ids) - before != len(calls):
                    raise ChatFormatError("tool call ids must be unique", f"{mp}.tool_calls")
            continue
        if content is None:
            raise ChatFormatError(f"a {role} message needs content", f"{mp}.content", "missing_required_parameter")
        _validate_content(content, role, f"{mp}.content")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ChatFormatError(
                    "a tool message needs a tool_call_id", f"{mp}.tool_call_id", "missing_required_parameter"
                )
            if call_id not in call_ids:
                raise ChatFormatError(
                    f"tool_call_id {call_id!r} does not match any tool call of an earlier assistant message",
                    f"{mp}.tool_call_id",
                )
    validate_tools(tools)
    _check_unicode(messages, "messages")
    _check_unicode(tools, "tools")


# ---------------------------------------------------------------------------------------- normalisation


def canonical_json(value: object) -> str:
    """JSON with sorted keys, no insignificant whitespace, non-ASCII kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: object) -> object:
    """Tool-call arguments as canonical JSON text; a string that is not valid JSON is kept as is."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return canonical_json(parsed)
    if isinstance(arguments, (Mapping, list)):
        return canonical_json(arguments)
    return arguments


def _drop_none(value: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if v is not None}


def _normalize_content(content: object) -> object:
    if isinstance(content, list):
        parts = [_drop_none(p) if isinstance(p, Mapping) else p for p in content]
        if all(isinstance(p, Mapping) and p.get("type") == "text" for p in parts):
            return "".join(str(p.get("text", "")) for p in parts)
        return parts
    return content


def _normalize_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in call.items() if v is not None and k != "index"}
    out.setdefault("type", "function")
    fn = call.get("function")
    if isinstance(fn, Mapping):
        fn_out = _drop_none(fn)
        if "arguments" in fn_out:
            fn_out["arguments"] = canonical_arguments(fn_out["arguments"])
        out["function"] = fn_out
    return out


def normalize_message(msg: Mapping[str, Any]) -> Message:
    """The canonical form of one message (pure; the input is not modified).

    - fields whose value is ``None`` are dropped; ``tool_calls``, ``annotations``, ``audio``,
      ``function_call``, ``refusal`` and ``name`` are also dropped when empty (``[]``, ``{}``, ``""``);
    - content given as a list of only text parts becomes the concatenation of their texts;
    - an assistant message's empty content (``None``, ``""``) is dropped (both mean "no text");
    - each tool call keeps its id, gets ``type: "function"`` if missing, loses the streaming ``index``,
      and its ``arguments`` become canonical JSON (sorted keys, compact); invalid JSON is kept as is.
    """
    out: Message = {}
    for key, value in msg.items():
        if value is None:
            continue
        if key in _EMPTY_DEFAULTS and value in ([], {}, ""):
            continue
        if key == "content":
            value = _normalize_content(value)
        elif key == "tool_calls" and isinstance(value, list):
            value = [_normalize_tool_call(c) if isinstance(c, Mapping) else c for c in value]
        out[key] = value
    if out.get("role") == "assistant" and out.get("content") == "":
        del out["content"]
    return out


# ------------------------------------------------------------------------------------------ hash chains


def _link(previous: str, msg: Mapping[str, Any]) -> str:
    content = msg.get("content")
    if len(msg) == 2 and type(content) is str and type(msg.get("role")) is str:
        if len(content) <= _SHORT_LINK_CHARS:
            return _plain_link(previous, msg["role"], content)
        if len(content) <= _PLAIN_LINK_MAX_CHARS:
            return _long_links(previous, msg["role"], content)
    return _link_uncached(previous, msg)


def _link_uncached(previous: str, msg: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(bytes.fromhex(previous))
    normalized = normalize_message(msg)
    if _chars(normalized) <= SLICED_HASH_CHARS:
        digest.update(canonical_json(normalized).encode("utf-8", "surrogatepass"))
    else:
        for piece in _canonical_pieces(normalized):
            digest.update(piece.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


# A message of more characters than this is hashed in slices (the same bytes, so the same hash): one
# ``json.dumps`` of a 7.9 MB string holds the interpreter lock for tens of ms in one C call, so even on a
# worker thread it stalled the event loop that long (issue 36); a slice of 256K characters takes well under
# a millisecond, and the loop gets the lock between slices.
SLICED_HASH_CHARS = 1_000_000
_SLICE_CHARS = 1 << 18


def _chars(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


def _canonical_pieces(value: object) -> Iterator[str]:
    """:func:`canonical_json` of ``value`` in pieces whose concatenation is exactly its text, long strings
    a slice at a time (JSON escapes each code point on its own, so slicing a ``str`` keeps its encoding)."""
    if isinstance(value, str):
        if len(value) <= _SLICE_CHARS:
            yield json.dumps(value, ensure_ascii=False)
            return
        yield '"'
        for start in range(0, len(value), _SLICE_CHARS):
            yield json.dumps(value[start:start + _SLICE_CHARS], ensure_ascii=False)[1:-1]
        yield '"'
    elif isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        yield "{"
        for i, key in enumerate(sorted(value)):
            yield ("," if i else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from _canonical_pieces(value[key])
        yield "}"
    elif isinstance(value, list):
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _canonical_pieces(item)
        yield "]"
    else:  # numbers, booleans, null (and whatever json.dumps makes of the rest)
        yield canonical_json(value)


# A conversation's earlier messages come back with every turn, so the links of plain ``{role, content}``
# messages (most of them) are computed once and looked up afterwards: a growing conversation's hash chain
# then costs a dictionary probe per earlier message instead of a normalisation, a JSON dump and a hash.
# The caches hold each message's content (in their keys), so what they may hold is bounded in characters:
# short messages (most) in functools' C cache, 65,536 of at most 256 characters (~0.5 KB each, ~30 MB
# full); longer ones up to 8,192 characters in a cache of 16M characters in all (entries of 65,536 x 8 KB
# could have held ~0.5 GB). Longer messages are hashed every time.
_SHORT_LINK_CHARS = 256
_PLAIN_LINK_MAX_CHARS = 8192
_LONG_LINK_CACHE_CHARS = 16_000_000


@functools.lru_cache(maxsize=65536)
def _plain_link(previous: str, role: str, content: str) -> str:
    return _link_uncached(previous, {"role": role, "content": content})


class _LinkCache:
    """``(previous link, role, content) -> link``, least recently used out first, holding at most
    ``max_chars`` characters of content (each entry counted at least ``entry_chars``)."""

    def __init__(self, max_chars: int, *, entry_chars: int = 400) -> None:
        self._items: SizedLRU[tuple[str, str, str], str] = SizedLRU(max_chars, min_entry=entry_chars)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        return self._items.size

    @property
    def hits(self) -> int:
        return self._items.hits

    def cache_size(self, name: str) -> CacheSize:
        return CacheSize(name, len(self._items), self._items.size, self._items.max_size)

    def __call__(self, previous: str, role: str, content: str) -> str:
        key = (previous, role, content)
        link = self._items.get(key)
        if link is None:
            link = _link_uncached(previous, {"role": role, "content": content})
            self._items.put(key, link, len(content))
        return link


_long_links = _LinkCache(_LONG_LINK_CACHE_CHARS)


def link_cache_sizes() -> list[CacheSize]:
    """The chain-link caches of this process (short messages by entries, longer ones by characters)."""
    short = _plain_link.cache_info()
    return [CacheSize("chain_links", short.currsize, short.currsize, short.maxsize or 0),
            _long_links.cache_size("chain_links_long")]


def chain_hashes(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """One hex sha256 per prefix: ``h[i] = sha256(h[i-1] || canonical_json(normalize(m[i])))``, ``h[-1] = b""``.

    ``chain_hashes(ms)[k - 1]`` identifies the prefix ``ms[:k]``; equal prefixes (after normalisation)
    give equal hashes whatever follows them.
    """
    hashes: list[str] = []
    previous = ""
    for msg in messages:
        previous = _link(previous, msg)
        hashes.append(previous)
    return hashes


def chain_hash(messages: Sequence[Mapping[str, Any]]) -> str:
    """The hash of the whole sequence (``chain_hashes(messages)[-1]``); the store keys turns by it."""
    if not messages:
        raise ValueError("chain_hash of an empty conversation")
    return chain_hashes(messages)[-1]


def extend_chain(previous: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """Continue a chain from a known hash (``chain_hash(a + b) == extend_chain(chain_hash(a), b)``)."""
    for msg in messages:
        previous = _link(previous, msg)
    return previous


def tools_hash(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A hex sha256 of the canonical JSON of ``tools`` (``""`` for none). Tools are not part of the message
    chain; the server compares this with the parent's to refuse a parent whose prompt held other tools."""
    if not tools:
        return ""
    return hashlib.sha256(canonical_json(list(tools)).encode("utf-8", "surrogatepass")).hexdigest()


def parent_candidates(messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """``(prefix length, hash)`` of every proper prefix ending in an assistant message, longest first.

    A turn is stored under ``chain_hash(request messages + [returned assistant message])``, so only
    prefixes that end in an assistant message can name a parent; the whole request is not a candidate
    (a parent must leave at least one new message to render).
    """
    hashes = chain_hashes(messages)
    return [
        (k, hashes[k - 1])
        for k in range(len(messages) - 1, 0, -1)
        if messages[k - 1].get("role") == "assistant"
    ]
