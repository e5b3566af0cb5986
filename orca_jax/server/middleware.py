"""Plain ASGI middleware: Host check, API-key check and request-body size and nesting limits.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses and the handlers'
disconnect detection pass through untouched. All answer before the body is parsed: an
unauthenticated client never gets its body read, an oversized one never gets it buffered, and JSON
nested past the limit never reaches a parser (Python's, pydantic's and ours recurse per level).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orca_jax.json_limits import DEFAULT_MAX_DEPTH, JSONLimitError, check_depth
from orca_jax.server.errors import error_body


async def _send_error(send: Send, status: int, message: str, *, code: str,
                      extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on paths under the protected prefixes."""

    def __init__(self, app: ASGIApp, *, api_key: str, protected_prefixes: tuple[str, ...]):
        self.app = app
        self._expected = api_key.encode()
        self._protected_prefixes = protected_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(self._protected_prefixes):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            # The scheme is case-insensitive (RFC 9110 section 11.1); the key is not. compare_digest
            # takes time independent of where the keys differ.
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._expected)):
                await _send_error(send, 401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key",
                                  extra_headers=((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)


class HostCheckMiddleware:
    """Answers 400 unless the Host header names an allowed host (any port).

    A server bound to localhost without a key trusts whoever can reach it; a web page could reach it
    by pointing its own domain at 127.0.0.1 (DNS rebinding), but the browser then sends that domain
    as Host, which this refuses.
    """

    def __init__(self, app: ASGIApp, *, allowed_hosts: tuple[str, ...]):
        self.app = app
        self._allowed = frozenset(host.lower() for host in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and host_name(dict(scope["headers"]).get(b"host", b"")) not in self._allowed:
            await _send_error(send, 400, "the Host header names a host this server does not answer to; "
                              "start it with --allowed-hosts to add one", code="invalid_host")
            return
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the app routes by: behind a proxy (--root-path /llm) uvicorn gives "/llm/v1/...";
    the routes, and so the protected prefixes, are "/v1/..."."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def host_name(header: bytes) -> str:
    """The host of a Host header, without the port, lower case ("[::1]:8000" -> "[::1]"). A header
    that is not `host[:port]` with a numeric port comes back whole, so it matches no allowed host
    ("localhost:1@evil.com" is not localhost)."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        end = host.find("]") + 1
        name, rest = host[:end], host[end:]
    else:
        name, _, port = host.partition(":")
        rest = ":" + port if ":" in host else ""
    return name if _is_port(rest) else host


def _is_port(rest: str) -> bool:
    """"" or ":" and digits: what may follow the host in a Host header (RFC 9110 section 7.2)."""
    return rest == "" or (rest[:1] == ":" and rest[1:].isascii() and (rest[1:].isdigit() or rest == ":"))


class BodyLimitMiddleware:
    """Answers 413 to bodies over `max_body_bytes` (or the limit of the longest prefix of
    `limits_by_prefix` the path starts with: file uploads), and 400 to a body that is not
    multipart and nests JSON arrays and objects deeper than `max_json_depth`; buffers the rest and
    replays them."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, limits_by_prefix: dict[str, int] | None = None,
                 max_json_depth: int = DEFAULT_MAX_DEPTH):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.limits_by_prefix = sorted((limits_by_prefix or {}).items(), key=lambda item: -len(item[0]))
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = next((n for prefix, n in self.limits_by_prefix if scope["path"].startswith(prefix)),
                     self.max_body_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, 400, "invalid Content-Length header", code="invalid_request")
                return
            if int(declared) > limit:
                await self._too_large(send, limit)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # FastAPI parses any body but a form as JSON (whatever its Content-Type says).
        if not dict(scope["headers"]).get(b"content-type", b"").lower().startswith(b"multipart/"):
            try:
                check_depth(body, self.max_json_depth, "the request body")
            except JSONLimitError as error:
                await _send_error(send, 400, f"{error} (the server's --max-json-depth)", code="json_too_deep")
                return
        await self.app(scope, _replay(body, receive), send)

    async def _too_large(self, send: Send, limit: int) -> None:
        await _send_error(send, 413, f"request body larger than {limit} bytes", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields the buffered body once, then the real channel (for disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
