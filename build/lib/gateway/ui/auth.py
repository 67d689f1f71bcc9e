"""Who may see the trace viewer: the admin key, given once on a login form, kept in an HttpOnly cookie.

The browser never holds the key after the login POST: the cookie carries ``v1.<expiry>.<mac>`` where the
mac is HMAC-SHA256 keyed by the admin key over the expiry. Every replica that shares the admin key accepts
it; changing the admin key logs everyone out. The cookie is ``HttpOnly``, ``SameSite=Strict`` and scoped to
``/ui``; the key never appears in a URL or a log line. An ``Authorization: Bearer`` header is honoured as
everywhere else in the gateway (scripts calling the JSON APIs); an agent or session key gets 403.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from fastapi import Request
from starlette.datastructures import Headers

from gateway.binding import authenticate, require_admin
from gateway.context import services
from gateway.errors import AuthenticationFailed
from gateway.routes.common import caller

COOKIE = "agentrl_ui"
TTL_S = 12 * 3600


def _mac(admin_key: str, expiry: int) -> str:
    return hmac.new(admin_key.encode(), f"agentrl-ui|{expiry}".encode(), hashlib.sha256).hexdigest()


def mint(admin_key: str, *, now: float | None = None, ttl_s: int = TTL_S) -> str:
    expiry = int((time.time() if now is None else now) + ttl_s)
    return f"v1.{expiry}.{_mac(admin_key, expiry)}"


def valid(token: str, admin_key: str, *, now: float | None = None) -> bool:
    version, _, rest = token.partition(".")
    expiry_s, _, mac = rest.partition(".")
    if version != "v1" or not expiry_s.isdigit():
        return False
    expiry = int(expiry_s)
    if expiry < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(admin_key, expiry).encode())


async def require_viewer(request: Request) -> None:
    """Return if the request may read the viewer; AuthenticationFailed (no or bad credentials) or
    PermissionDenied (an agent or session key) otherwise."""
    if "authorization" in request.headers:
        require_admin(await caller(request))
        return
    token = request.cookies.get(COOKIE)
    if token and valid(token, services(request).settings.admin_key):
        return
    raise AuthenticationFailed("log in to the trace viewer at /ui/login (the gateway's admin key)")


async def check_login_key(request: Request, key: str) -> None:
    """The login form's key, checked by the gateway's one authentication function as a bearer key would
    be: AuthenticationFailed for an unknown key, PermissionDenied for an agent or session key."""
    svc = services(request)
    scope = {"type": "http", "headers": Headers({"authorization": f"Bearer {key}"}).raw}
    require_admin(await authenticate(Request(scope), svc.settings, svc.store))
