"""The trace viewer's templates and static files (shipped as package data) and the one render function.

Routes live in ``gateway.routes.ui``; what each page shows is built by ``gateway.ui.views``.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi.responses import HTMLResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape

HERE = Path(__file__).resolve().parent
STATIC_FILES: dict[str, tuple[Path, str]] = {
    "ui.css": (HERE / "static" / "ui.css", "text/css; charset=utf-8"),
    "ui.js": (HERE / "static" / "ui.js", "text/javascript; charset=utf-8"),
}


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e15):
        return str(int(value))
    return f"{value:.{digits}g}" if abs(value) < 1e-3 else f"{value:.{digits}f}"


def _json_text(value: Any) -> str:
    """JSON of a value as plain text, so that autoescaping escapes its quotes (Jinja's ``tojson`` marks its
    output safe, which breaks out of an HTML attribute at the first double quote)."""
    return json.dumps(value)


def _segment(value: Any) -> str:
    """An id as one URL path segment."""
    return quote(str(value), safe="")


def _token_text(text: str) -> str:
    """A token's text made visible: newlines as a return arrow (then the line break), tabs as arrows."""
    return text.replace("\t", "\u21e5").replace("\n", "\u21b5\n")


_env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                   trim_blocks=True, lstrip_blocks=True)
_env.filters.update(when=_when, num=_num, token_text=_token_text, json_text=_json_text, seg=_segment)


def render(template: str, *, status: int = 200, headers: dict[str, str] | None = None, **context: Any) -> HTMLResponse:
    return HTMLResponse(_env.get_template(template).render(**context), status_code=status, headers=headers)
