"""Who may drive an engine's HTTP API, and which files it may load.

Owns two rules of the embedded server:
- Admin endpoints (weights, pause, memory, abort) need ``Authorization:
  Bearer <token>`` whenever a token is set, and a server bound to anything
  but loopback must have one (``require_token``).
- ``/update_weights_from_disk`` loads only from directories under an allowed
  root, after resolving symlinks and ``..``, so an open endpoint cannot be
  pointed at arbitrary files.
Never logs or returns a token.
"""

from __future__ import annotations

import hmac
import ipaddress
import os


class AuthError(Exception):
    """A request lacks the admin token (status 401) or has a wrong one (403)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host == "localhost":
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
