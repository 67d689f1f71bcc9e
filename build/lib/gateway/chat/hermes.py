"""Tools for chat templates that know nothing about tools (SmolLM2's own template): the Hermes format.

The conversation is rewritten into plain ``{"role", "content": str}`` messages before the template sees it:

- the tool schemas go into the system message (appended to the first system/developer message, or a new
  system message in front), one JSON object per line between ``<tools>`` and ``</tools>``, with the
  instruction to answer with ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks;
- an assistant message's tool calls become those blocks, after its text (one per line);
- a ``developer`` message becomes a ``system`` message;
- consecutive ``tool`` messages become ONE user message holding one ``<tool_response>`` block per result.

The wording is the same as the tiny test model's tool-aware template, so the two paths teach the model
the same format. Documented in ``docs/chat.md``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]

TOOLS_HEADER = "# Tools\n\nYou can call the functions listed between <tools> and </tools> when they help with the request.\n<tools>\n"
TOOLS_FOOTER = (
    "</tools>\n\nTo call a function, write a JSON object with its name and arguments between <tool_call> "
    'and </tool_call>:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
)


def text_of(content: object) -> str:
    """Message content as text: a string as is, the texts of a list of parts joined, ``None`` as ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return str(content)


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt block that describes ``tools`` to the model."""
    lines = "".join(
        json.dumps(tool.get("function", tool), ensure_ascii=False) + "\n" for tool in tools
    )
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def arguments_text(arguments: object) -> str:
    """Tool-call arguments as the model writes them: an object as ``json.dumps``, other text verbatim."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else arguments
    return json.dumps(arguments, ensure_ascii=False)


def tool_call_block(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    name = json.dumps(str(fn.get("name", "")), ensure_ascii=False)
    return '<tool_call>\n{"name": ' + name + ', "arguments": ' + arguments_text(fn.get("arguments", {})) + "}\n</tool_call>"


def _assistant_text(msg: Mapping[str, Any]) -> str:
    text = text_of(msg.get("content"))
    for call in msg.get("tool_calls") or []:
        text = (text + "\n" if text else "") + tool_call_block(call)
    return text


def to_hermes(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> list[Message]:
    """Rewrite a conversation (and its tools) into plain text messages for a template without tools."""
    out: list[Message] = []
    rest = list(messages)
    if tools:
        block = tools_prompt(tools)
        if rest and rest[0].get("role") in ("system", "developer"):
            first = text_of(rest.pop(0).get("content"))
            out.append({"role": "system", "content": first + "\n\n" + block})
        else:
            out.append({"role": "system", "content": block})
    for msg in rest:
        role = msg.get("role")
        if role == "tool":
            response = "<tool_response>\n" + text_of(msg.get("content")) + "\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(msg)})
        else:  # the model was trained on system/user/assistant only: a developer message is a system one
            out.append({"role": "system" if role == "developer" else str(role), "content": text_of(msg.get("content"))})
    for msg in out:
        msg.pop("_tool_results", None)
    return out
