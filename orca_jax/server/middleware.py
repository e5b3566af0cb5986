"""Plain ASGI middleware: Host check, API-key check and request-body size and nesting limits.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so that streaming responses and the handlers'
disconnect detection pass through untouched. All answer before the body is parsed: an
unauthenticated client never gets its body read, an oversized one never gets it buffered, and JSON
that is not UTF-8 or nests past the limit never reaches a parser (Python's, pydantic's and ours
recurse per level; json_body.py parses UTF-8 only, so the nesting measured is the nesting parsed).
A multipart upload is not buffered at all: it flows to its handler, counted, and is cut off with a
413 once past its limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orca_jax.json_limits import DEFAULT_MAX_DEPTH, JSONLimitError, check_depth
from orca_jax.server.errors import error_body
from orca_jax.server.json_body import PARSE_OFF_LOOP_BYTES, utf8_problem


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
            given_headers = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(given_headers) > 1:  # a singleton field (RFC 9110): which one counts is ambiguous
                await _send_error(send, 400, "more than one Authorization header; send exactly one",
                                  code="invalid_api_key")
                return
            scheme, _, given = (given_headers or [b""])[0].strip().partition(b" ")
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
        hosts = [value for name, value in scope["headers"] if name == b"host"] if scope["type"] == "http" else []
        if len(hosts) > 1:  # RFC 9112 section 3.2: answered 400
            await _send_error(send, 400, "more than one Host header", code="invalid_host")
            return
        if scope["type"] == "http" and host_name((hosts or [b""])[0]) not in self._allowed:
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
    multipart and is not UTF-8 or nests JSON arrays and objects deeper than `max_json_depth`;
    buffers the rest and replays them (multipart ones flow through, counted)."""

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
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _send_error(send, 400, "invalid Content-Length header", code="invalid_request")
                return
            if int(declared) > limit:
                await self._too_large(send, limit)
                return
        if headers.get(b"content-type", b"").lower().startswith(b"multipart/"):
            counted = _CountedBody(receive, send, limit, self._too_large)
            await self.app(scope, counted.receive, counted.send)
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
        # Linear in the body, but a 2 MB one of brackets takes tens of ms: off the loop when large.
        problem = (await asyncio.to_thread(self._json_problem, body) if len(body) > PARSE_OFF_LOOP_BYTES
                   else self._json_problem(body))
        if problem is not None:
            message, code = problem
            await _send_error(send, 400, message, code=code)
            return
        await self.app(scope, _replay(body, receive), send)

    def _json_problem(self, body: bytes) -> tuple[str, str] | None:
        """(message, code) for a body no JSON parse may see: not UTF-8, or nested too deep."""
        problem = utf8_problem(body)
        if problem is not None:
            return problem, "invalid_encoding"
        try:
            check_depth(body, self.max_json_depth, "the request body")
        except JSONLimitError as error:
            return f"{error} (the server's --max-json-depth)", "json_too_deep"
        return None

    async def _too_large(self, send: Send, limit: int) -> None:
        await _send_error(send, 413, f"request body larger than {limit} bytes", code="request_too_large")


class _CountedBody:
    """receive and send for an app reading a body as it comes (a multipart upload): past `limit`
    bytes the client gets a 413, and the app a disconnect and no say (whatever it sends is dropped)."""

    def __init__(self, receive: Receive, send: Send, limit: int, too_large):
        self._receive, self._send, self._limit, self._too_large = receive, send, limit, too_large
        self._size = 0
        self._refused = False

    async def receive(self) -> Message:
        if self._refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self._size += len(message.get("body", b""))
            if self._size > self._limit:
                self._refused = True
                await self._too_large(self._send, self._limit)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if not self._refused:
            await self._send(message)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields the buffered body once, then the real channel (for disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
