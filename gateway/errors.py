"""The gateway's errors: one tree, translated at the edges, rendered by exactly one function.

::

    GatewayError                      status  type                    code (default)
    ├── InvalidRequest                400     invalid_request_error   invalid_value
    │   └── ContextLengthExceeded     400     invalid_request_error   context_length_exceeded
    ├── AuthenticationFailed          401     authentication_error    invalid_api_key
    ├── PermissionDenied              403     permission_error        forbidden
    ├── NotFound                      404     not_found_error         not_found
    ├── Conflict                      409     conflict_error          conflict
    ├── RequestTimeout                408     invalid_request_error   request_timeout  (body not sent in time)
    ├── PayloadTooLarge               413     invalid_request_error   payload_too_large
    ├── ClientDisconnected            499     invalid_request_error   client_closed_request  (nobody reads it)
    ├── Overloaded                    429     rate_limit_error        staleness_budget  (Retry-After)
    ├── EngineError                   502     upstream_error          engine_error
    └── Unavailable                   503     service_unavailable     unavailable  (Retry-After: 1)
        ├── EngineUnavailable         503     service_unavailable     engine_unavailable
        └── StoreUnavailable          503     service_unavailable     store_unavailable

Errors from the other layers are translated where they enter the gateway (``raise ... from exc``):
:func:`from_store_error` (``gateway.store.errors``), :func:`from_chat_error` (``gateway.chat.errors``) and
:func:`from_validation_error` (pydantic); httpx errors are translated inside ``gateway.engine_client``.
:func:`error_body` is the one place that turns an error into the OpenAI-shaped body
``{"error": {"message", "type", "param", "code"}}`` and its HTTP status; :func:`anthropic_error_body` its
twin for Anthropic's Messages routes (``{"type": "error", "error": {"type", "message"}}``, types from the
``anthropic`` package's ``ErrorType``). Anything else that escapes a
route is a bug: it is logged with its traceback and answered 500 without leaking its text.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import ValidationError

from gateway.chat.errors import ChatFormatError
from gateway.store import errors as store_errors


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"
    retry_after_s: float | None = None  # sent as Retry-After: the client may retry this very request

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code


class InvalidRequest(GatewayError):
    status, type, default_code = 400, "invalid_request_error", "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status, type, default_code = 401, "authentication_error", "invalid_api_key"


class PermissionDenied(GatewayError):
    status, type, default_code = 403, "permission_error", "forbidden"


class NotFound(GatewayError):
    status, type, default_code = 404, "not_found_error", "not_found"


class Conflict(GatewayError):
    status, type, default_code = 409, "conflict_error", "conflict"


class RequestTimeout(GatewayError):
    status, type, default_code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(GatewayError):
    status, type, default_code = 413, "invalid_request_error", "payload_too_large"


class ClientDisconnected(GatewayError):
    """The client closed its connection before the answer was ready: the turn was cancelled (its engine
    request aborted, nothing recorded). Only the metrics see the answer (nginx's 499)."""

    status, type, default_code = 499, "invalid_request_error", "client_closed_request"


class Overloaded(GatewayError):
    status, type, default_code = 429, "rate_limit_error", "staleness_budget"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class EngineError(GatewayError):
    """The engine answered, but with an error the gateway cannot attribute to the request."""

    status, type, default_code = 502, "upstream_error", "engine_error"


class Unavailable(GatewayError):
    """A dependency (engine, database, Redis) cannot serve now; nothing of the request was recorded."""

    status, type, default_code = 503, "service_unavailable", "unavailable"
    retry_after_s = 1.0


class EngineUnavailable(Unavailable):
    default_code = "engine_unavailable"


class StoreUnavailable(Unavailable):
    default_code = "store_unavailable"


def error_body(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI-shaped body of an error (the only place that builds one)."""
    return exc.status, {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(exc: GatewayError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and Anthropic-shaped body of an error (``/v1/messages`` and its siblings). A prompt
    over the context is said as Anthropic says it (``prompt is too long: N tokens > M maximum``): Claude Code
    compacts its history on exactly that message and sends again (reactive compaction), where any other
    wording ends its run."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "api_error")
    message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
    sizes = _CONTEXT_SIZES.search(exc.message) if isinstance(exc, ContextLengthExceeded) else None
    if sizes is not None:
        message = f"prompt is too long: {sizes.group(2)} tokens > {sizes.group(1)} maximum ({exc.message})"
    return exc.status, {"type": "error", "error": {"type": kind, "message": message}}


# "this model's maximum context length is N tokens; the prompt has [at least] M tokens" (service, engines)
_CONTEXT_SIZES = re.compile(r"maximum context length is (\d+) tokens\D*?(\d+) tokens")


def from_store_error(exc: store_errors.StoreError) -> GatewayError:
    """Translate an error of the conversation store."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, store_errors.NotFound):
        return NotFound(message)
    if isinstance(exc, store_errors.Conflict):
        return Conflict(message)
    if isinstance(exc, store_errors.InvalidValue):
        return InvalidRequest(message)
    return StoreUnavailable(f"the conversation store is unavailable: {message}")


def from_chat_error(exc: ChatFormatError) -> InvalidRequest:
    """Translate a malformed ``messages``/``tools`` error of the chat layer."""
    return InvalidRequest(exc.message, param=exc.param, code=exc.code)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(exc: ValidationError) -> InvalidRequest:
    """Translate a pydantic error on a request body (first error; ``param`` is its JSON path)."""
    first = exc.errors(include_url=False)[0]
    kind = first.get("type", "")
    code = "missing_required_parameter" if kind == "missing" else (
        "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    )
    param = _loc(tuple(p for p in first.get("loc", ()) if p not in ("function-after", "function-before")))
    return InvalidRequest(f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param or None, code=code)
