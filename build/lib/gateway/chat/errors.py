"""Errors raised by the chat layer.

::

    ValueError
    ├── ChatFormatError     bad messages / tools in a request (the server answers 400, with ``param``)
    └── TemplateDriftError  a continuation cannot be cut out of the chat template's rendering
                            (the server starts a new root and counts ``reason``)

Both carry machine-readable fields so that exactly one function in the server can turn them into an
OpenAI-shaped error body.
"""

from __future__ import annotations


class ChatFormatError(ValueError):
    """A request's ``messages`` or ``tools`` are malformed.

    ``param`` is the JSON path of the offending value (``messages[2].tool_call_id``); ``code`` is an
    OpenAI-style error code (``invalid_value``, ``invalid_type``, ``missing_required_parameter``).
    """

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class TemplateDriftError(ValueError):
    """The chat template does not render new messages as a pure suffix of the history.

    ``reason`` is a short stable label for metrics (``prefix_mismatch``, ``no_end_of_turn``, ...).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
