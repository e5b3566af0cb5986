"""HTTP limits that uvicorn's httptools protocol lacks: header size and count, URL length, read
timeouts for headers and body, and a cap on open connections; plus a clean answer on shutdown.

uvicorn offers a keep-alive timeout (used as is) and `limit_concurrency`, which is checked only once
a request's headers are in, so a connection that never finishes them is never counted. httptools
has no limit on header size (it grows a header value by concatenation, quadratic in its length, on
the event loop), and uvicorn no read timeout. We keep httptools (h11, which has a header limit,
costs the event loop per streamed chunk, paid once per token) and add what it lacks here, in a
subclass of its protocol given to uvicorn.Config as `http=` (HTTPLimits.uvicorn_options()).

Every refusal is an OpenAI-style error body with `Connection: close`, after which nothing more is
read: 431 past the header limits, 414 past the URL limit, 408 when headers or body stop arriving,
503 past the connection cap or when the server shuts down under an unfinished upload.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from orca_jax.server.errors import error_body

log = logging.getLogger(__name__)
RETRY_AFTER_SECONDS = b"1"


@dataclasses.dataclass(frozen=True, slots=True)
class HTTPLimits:
    """What one connection may send, and for how long; every field is a `serve` flag."""

    max_header_bytes: int = 64 * 1024  # request line and headers together
    max_header_count: int = 100
    max_url_bytes: int = 8 * 1024
    header_timeout_s: float = 30.0  # from connecting (or a request's first byte) to its last header
    body_timeout_s: float = 60.0  # from the last header to the body's last byte
    keep_alive_timeout_s: float = 5.0  # idle between requests (uvicorn's own timer)
    max_connections: int = 2048  # open at once; more are answered 503 as they connect

    def __post_init__(self):
        for name in ("max_header_bytes", "max_header_count", "max_url_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HTTPLimits.{name} must be positive, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HTTPLimits.{name} must be positive, got {getattr(self, name)}")

    def uvicorn_options(self) -> dict:
        """uvicorn.Config keywords that apply these limits."""
        return {"http": functools.partial(LimitedHttpToolsProtocol, limits=self), "ws": "none",
                "timeout_keep_alive": self.keep_alive_timeout_s}


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; data_received answers `status`."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with HTTPLimits enforced (see the module docstring).

    Header bytes are counted two ways, both lower bounds of the truth so neither refuses a request
    within the limit: exactly, as the parser hands over the URL and each whole header; and by
    whole chunks read while one request's headers are unfinished, which catches a single header
    that never ends. So at most one read (256 KiB) past the limit is buffered before the 431.
    """

    def __init__(self, *args, limits: HTTPLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._in_head = False  # between a request's first byte and its last header
        self._num_messages = 0
        self._head_bytes_parsed = 0  # URL + headers handed over by the parser, this request
        self._head_bytes_read = 0  # whole chunks read inside this request's headers
        self._num_headers = 0
        self._read_timer: asyncio.TimerHandle | None = None

    # ---- connection ----

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # not counted: connection_lost finds nothing else to undo
            self._answer(503, f"more than {self.limits.max_connections} open connections; retry later",
                         "too_many_connections", retry_after=True)
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._headers_timed_out)  # a silent socket too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        message, in_head = self._num_messages, self._in_head
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.logger.warning("Unsupported upgrade request.")  # no WebSockets (ws="none")
            return
        except httptools.HttpParserError as error:
            refused = error.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head and in_head and message == self._num_messages:
            self._head_bytes_read += len(data)  # the whole chunk lies inside these headers
            if self._head_bytes_read > self.limits.max_header_bytes:
                self._refuse(self._headers_too_large())

    def shutdown(self) -> None:
        """On server shutdown: an upload still coming in gets 503 (nobody will finish it), so does a
        request whose headers are unfinished; the rest as uvicorn does (idle connections close,
        running requests finish)."""
        cycle = self.cycle
        uploading = cycle is not None and cycle.more_body and not cycle.response_started
        if uploading or self._in_head:
            self._answer(503, "the server is shutting down; retry elsewhere or later", "shutting_down",
                         retry_after=True)
            return
        super().shutdown()

    # ---- parser callbacks ----

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._num_messages += 1
        self._head_bytes_parsed = self._head_bytes_read = self._num_headers = 0
        if self._read_timer is None:  # a first request keeps the deadline its connection started
            self._arm(self.limits.header_timeout_s, self._headers_timed_out)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_url_bytes:
            raise _Refused(414, f"the URL is longer than {self.limits.max_url_bytes} bytes", "url_too_long")
        self._head_bytes_parsed += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_header_count:
            raise _Refused(431, f"more than {self.limits.max_header_count} header fields",
                           "too_many_headers")
        self._head_bytes_parsed += len(name) + len(value) + 4  # ": " and CRLF
        if self._head_bytes_parsed > self.limits.max_header_bytes:
            raise self._headers_too_large()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # ---- timeouts and answers ----

    def _headers_timed_out(self) -> None:
        self._read_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request behind one still being answered: its clock starts after that.
            self._arm(self.limits.header_timeout_s, self._headers_timed_out)
        elif self._in_head:
            self._answer(408, f"the request headers did not arrive within {self.limits.header_timeout_s:g} s",
                         "request_timeout")
        else:
            self.transport.close()  # connected and said nothing: no request to answer

    def _body_timed_out(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        if cycle is None or cycle.response_started or not cycle.more_body:
            self.transport.close()  # answered already (or answering): just stop waiting for the rest
            return
        self._answer(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                     "request_timeout")

    def _headers_too_large(self) -> _Refused:
        return _Refused(431, f"the request headers are larger than {self.limits.max_header_bytes} bytes",
                        "headers_too_large")

    def _refuse(self, refused: _Refused) -> None:
        self._answer(refused.status, refused.message, refused.code)

    def _answer(self, status: int, message: str, code: str, *, retry_after: bool = False) -> None:
        """Write an error response and close, reading nothing more; a request the app holds sees a
        disconnect (so it neither answers nor gets uvicorn's 500)."""
        self._disarm()
        cycle = self.cycle
        # A response under way (a pipelining client's earlier request) cannot take another one.
        mid_response = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if self.transport.is_closing():
            return
        if not mid_response:
            body = json.dumps(error_body(status, message, code=code)).encode()
            head = [STATUS_LINE[status]]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n"]
            if retry_after:
                head.append(b"retry-after: " + RETRY_AFTER_SECONDS + b"\r\n")
            self.transport.write(b"".join(head) + b"\r\n" + body)
        self.transport.close()
        # Debug, not info: under attack one line per refused connection would load the event loop.
        log.debug("%s refused with %d: %s", self.client, status, message)

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
