"""What every engine client does with a request before its kind's own logic: one code path over the
transport seam, and one mapping of a failed answer to the caller's errors.

``SGLangClient`` and ``VLLMClient`` both call their engine this way (the two held the same three methods,
word for word, before); a third kind's client starts from here too, never from another kind's client.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engines.base import PLAIN_ERRORS, EngineErrors, dumps, engine_error, error_text, loads
from engines.transport import Transport, TransportError


class EngineCaller:
    """The HTTP calls of one engine at ``base_url``, its bytes carried by ``transport``."""

    label: ClassVar[str] = "engine"  # how errors name the server
    empty_body: ClassVar[Any] = None  # what an empty 2xx body reads as (None: an empty body is not JSON)

    def __init__(self, base_url: str, transport: Transport, *, timeout_s: float = 600.0,
                 errors: EngineErrors = PLAIN_ERRORS) -> None:
        self.base_url = base_url.rstrip("/")
        self.transport, self.timeout_s, self.errors = transport, timeout_s, errors

    def _unreachable(self, exc: TransportError) -> Exception:
        return self.errors.unavailable(f"engine {self.base_url} unreachable: HTTP {exc.kind}: {exc}")

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                    timeout_s: float | None = None) -> bytes:
        """The body of a 2xx answer; an error for anything else."""
        try:
            status, content = await self.transport.request(
                method, self.base_url + path, dumps(body) if body is not None else None,
                timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        except TransportError as exc:
            raise self._unreachable(exc) from exc
        if status >= 400:
            raise engine_error(self.errors, self.base_url, status, error_text(content, f"HTTP {status}"))
        return content

    def _json(self, content: bytes, what: str) -> Any:
        if not content and self.empty_body is not None:
            return dict(self.empty_body)
        try:
            return loads(content)
        except ValueError as exc:
            raise self.errors.failed(f"{self.label} {self.base_url} answered {what} with a body that is not JSON") from exc
