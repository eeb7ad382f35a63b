"""Who may drive an engine's HTTP API, and which files it may load.

Owns the rules of the embedded server:
- Admin endpoints (weights, pause, memory, abort) need ``Authorization:
  Bearer <token>`` whenever a token is set, and a server bound to anything
  but loopback must have one (``require_token``).
- Admin endpoints refuse browsers' cross-origin requests, token or not
  (``check_browser``): a web page must not pause or reload a loopback engine.
  A request with an ``Origin`` that is not the server's own, a
  ``Sec-Fetch-Site`` other than ``same-origin``/``none``, or (on a loopback
  server) a ``Host`` that is not a loopback name (DNS rebinding) is a 403; a
  body that is not ``application/json`` is a 415 (``check_json_body``), so a
  form or ``text/plain`` "simple request" never reaches a handler.
- ``/update_weights_from_disk`` loads only from directories under an allowed
  root, after resolving symlinks and ``..``; every file the loader opens is
  resolved again (``confine``), so a symlinked shard cannot leave the roots.
Never logs or returns a token.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from urllib.parse import urlsplit


class AuthError(Exception):
    """A request lacks the admin token (status 401) or has a wrong one (403)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token(host: str, api_key: str | None) -> None:
    """Refuse to serve admin endpoints beyond loopback without a token."""
    if not is_loopback(host) and not api_key:
        raise ValueError(
            f"binding {host} exposes the admin endpoints: set an api key "
            "(--api-key, or the env var named by engines.api_key_env), or bind 127.0.0.1"
        )


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """Raise AuthError unless the header carries ``api_key`` (no key set: allow)."""
    if not api_key:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(401, "admin endpoint: send 'Authorization: Bearer <api key>'")
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise AuthError(403, "admin endpoint: the bearer token is wrong")


def resolve_allowed(path: str, roots: tuple[str, ...]) -> str:
    """The real path of ``path`` if it sits under one of ``roots``, else PermissionError."""
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if os.path.commonpath([real, base]) == base:
            return real
    raise PermissionError(
        f"model_path {path!r} is outside the allowed roots; "
        "add its directory to engines.allowed_weight_roots"
    )


def _host_name(netloc: str) -> str:
    return urlsplit(f"//{netloc}").hostname or ""


def check_browser(headers: dict[str, str], bound_host: str) -> None:
    """AuthError(403) for a cross-origin browser request to an admin endpoint.

    ``headers`` are the request's (lower-case names). Programs (the engine
    client, SGLang's callers, curl) send neither ``Origin`` nor
    ``Sec-Fetch-Site``, so only browsers are affected.
    """
    host = headers.get("host", "")
    if is_loopback(bound_host) and not is_loopback(_host_name(host)):
        raise AuthError(
            403,
            f"admin endpoint: Host {host!r} is not a loopback name on a loopback server "
            "(DNS rebinding?); call it as 127.0.0.1 or localhost",
        )
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise AuthError(
            403, f"admin endpoint: refused a {fetch_site} browser request; call it from a program"
        )
    origin = headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if origin == "null" or parts.scheme not in ("http", "https") or parts.netloc != host:
            raise AuthError(
                403,
                f"admin endpoint: refused a cross-origin request from {origin!r}; "
                "call it from a program, not a web page",
            )


def check_json_body(content_type: str | None, body: bytes) -> None:
    """AuthError(415) unless a non-empty body is declared ``application/json``."""
    if content_type is None and not body:
        return
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise AuthError(
            415,
            f"admin endpoint: Content-Type {content_type!r} refused; "
            "send the body as 'Content-Type: application/json'",
        )


def confine(path: str, roots: tuple[str, ...] | None, what: str = "file") -> str:
    """The real path of ``path``; with ``roots``, PermissionError unless it is under one.

    For files the loader opens inside an allowed directory: a symlink there
    must not lead outside the allowed roots.
    """
    real = os.path.realpath(path)
    if roots is None:
        return real
    for root in roots:
        base = os.path.realpath(root)
        if os.path.commonpath([real, base]) == base:
            return real
    raise PermissionError(
        f"{what} {os.path.basename(path)!r} resolves to {real!r}, outside the allowed roots; "
        "copy the file into the version directory instead of linking it, or add its "
        "directory to engines.allowed_weight_roots"
    )
