"""API-key check, first thing on a request: a caller without a valid key gets 401 before one
byte of its body is read. It also decides the caller's media-UUID namespace."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from mmserve.api.errors import send_error
from mmserve.hashing import DEFAULT_NAMESPACE

# Where the namespace travels from this middleware to the routes (Starlette's request.state).
NAMESPACE_STATE_KEY = "mmserve_namespace"
# Probes stay open; every other path needs a key, so no routing quirk (`//v1/...`, a route
# added later) can skip the check.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def caller_namespace(token: str | None) -> str:
    """Whose UUID namespace a request uses: a digest of its key ("default" without auth)."""
    if token is None:
        return DEFAULT_NAMESPACE
    return "key-" + hashlib.sha256(token.encode()).hexdigest()[:16]


def request_namespace(request: Request) -> str:
    """The namespace ApiKeyMiddleware decided for this request (a route dependency)."""
    return request.scope.get("state", {}).get(NAMESPACE_STATE_KEY, DEFAULT_NAMESPACE)


class ApiKeyMiddleware:
    """With keys, every path but OPEN_PATHS needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str] | None) -> None:
        self.app = app
        # Digests, so each comparison is over 32 bytes whatever the lengths of key and guess.
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in api_keys or ()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        namespace = DEFAULT_NAMESPACE
        if self._key_digests:
            token = self._bearer_token(scope)
            if token is None:
                await send_error(
                    send,
                    "missing or invalid API key: send 'Authorization: Bearer <key>' with the key "
                    "the server was started with (--api-key)",
                    status_code=401,
                    code="invalid_api_key",
                )
                return
            namespace = caller_namespace(token)
        scope.setdefault("state", {})[NAMESPACE_STATE_KEY] = namespace
        await self.app(scope, receive, send)

    def _bearer_token(self, scope: Scope) -> str | None:
        """The request's token if it is one of the keys, else None."""
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.decode("latin-1").partition(" ")
        token = token.strip()
        given = hashlib.sha256(token.encode("latin-1")).digest()
        # Compare against every key (no early exit), each in constant time.
        matches = [hmac.compare_digest(given, key) for key in self._key_digests]
        if scheme.lower() != "bearer" or not any(matches):
            return None
        return token
