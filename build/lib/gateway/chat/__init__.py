"""The gateway's chat layer: pure functions over messages, templates and model text (no HTTP, no DB).

- :mod:`gateway.chat.normalize`: request validation, message normalisation, hash chains for parent lookup;
- :mod:`gateway.chat.template`: prompt ids from the chat template, token-exact continuations, drift;
- :mod:`gateway.chat.hermes`: tools for templates that have no tool support (Hermes format);
- :mod:`gateway.chat.tool_parser`: ``<tool_call>`` blocks out of model text, whole or streamed;
- :mod:`gateway.chat.errors`: the errors the server translates into OpenAI-shaped responses.
"""

from gateway.chat.errors import ChatFormatError, TemplateDriftError
from gateway.chat.normalize import (
    chain_hash,
    chain_hashes,
    extend_chain,
    normalize_message,
    parent_candidates,
    tools_hash,
    validate_messages,
    validate_tool_choice,
    validate_tools,
)
from gateway.chat.template import ChatTemplate, Continuation
from gateway.chat.tool_parser import (
    ContentDelta,
    StreamingToolParser,
    ToolCallDelta,
    new_call_id,
    parse_tool_calls,
    tool_parsing_enabled,
)

__all__ = [
    "ChatFormatError",
    "ChatTemplate",
    "ContentDelta",
    "Continuation",
    "StreamingToolParser",
    "TemplateDriftError",
    "ToolCallDelta",
    "chain_hash",
    "chain_hashes",
    "extend_chain",
    "new_call_id",
    "normalize_message",
    "parent_candidates",
    "parse_tool_calls",
    "tool_parsing_enabled",
    "tools_hash",
    "validate_messages",
    "validate_tool_choice",
    "validate_tools",
]
