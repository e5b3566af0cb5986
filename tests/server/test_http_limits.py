"""The HTTP limits, attacked on real sockets against a live server (fake engine, short limits).

Each attack checks the status code, that the server closes the connection, and that /health,
polled meanwhile on another connection, never took 100 ms or more: the event loop stayed free.
"""

import contextlib
import http.client
import select
import socket
import threading
import time
import urllib.parse

import pytest

from orca_jax.server.app import create_app
from orca_jax.server.http_limits import HTTPLimits

from tests.helpers.server import FakeEngine, live_server

LIMITS = HTTPLimits(max_header_bytes=8192, max_header_count=20, max_url_bytes=1024, header_timeout_s=0.5,
                    body_timeout_s=0.5, keep_alive_timeout_s=0.5, max_connections=64)
TIMEOUT = 0.5
MAX_HEALTH_SECONDS = 0.1


@pytest.fixture(scope="module")
def server():
    with live_server(create_app(FakeEngine(), served_model_name="fake"), limits=LIMITS) as served:
        yield served


class HealthProbe:
    """Polls /health on one keep-alive connection from a thread; `latencies` in seconds."""

    def __init__(self, url: str):
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=5)
        while not self._stop.is_set():
            start = time.perf_counter()
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            self.latencies.append(time.perf_counter() - start)
            self._stop.wait(0.01)
        connection.close()

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        self._wait_for(1)
        return self

    def __exit__(self, *exc) -> None:
        self._wait_for(len(self.latencies) + 3)  # and a few answers after the attack
        self._stop.set()
        self._thread.join(5)
        assert max(self.latencies) < MAX_HEALTH_SECONDS, f"/health took {max(self.latencies):.3f} s"


    def _wait_for(self, count: int) -> None:
        deadline = time.monotonic() + 5
        while len(self.latencies) < count:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the probe stopped"
            time.sleep(0.005)


def _connect(server) -> socket.socket:
    parsed = urllib.parse.urlparse(server.url)
    return socket.create_connection((parsed.hostname, parsed.port), timeout=5)


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def _exchange(server, request: bytes) -> tuple[int, bytes, float]:
    """Send `request`, then read until the server closes: (status, response, seconds to close)."""
    with _connect(server) as sock:
        start = time.perf_counter()
        sock.sendall(request)
        response = _read_until_closed(sock)
        return _status(response), response, time.perf_counter() - start


def test_a_header_that_never_ends_gets_431_without_holding_the_loop(server):
    with HealthProbe(server.url), _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        sent = 0
        while sent < 64 * 2**20:  # the 64 MB header of the report, unless answered first
            try:
                sock.sendall(b"a" * 65536)
            except OSError:
                break
            sent += 65536
            if select.select([sock], [], [], 0.005)[0]:
                break
        response = _read_until_closed(sock)
    assert _status(response) == 431 and b"headers_too_large" in response
    assert sent < 4 * 2**20  # answered long before the end


def test_headers_over_the_byte_limit_in_one_read_get_431(server):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: %s\r\n" % (i, b"b" * 1000) for i in range(10)) + b"\r\n"
    status, response, _ = _exchange(server, request)
    assert status == 431 and b"headers_too_large" in response


def test_too_many_header_fields_get_431(server):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(25)) + b"\r\n"
    with HealthProbe(server.url):
        status, response, _ = _exchange(server, request)
    assert status == 431 and b"too_many_headers" in response


def test_a_long_url_gets_414(server):
    status, response, _ = _exchange(server, b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 414 and b"url_too_long" in response


def test_requests_just_within_the_limits_pass(server):
    # 19 headers, about 7 KiB, sent in pieces: neither count nor chunk-level counting misfires.
    head = b"GET /health?" + b"q" * 900 + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-%d: %s\r\n" % (i, b"v" * 300) for i in range(18)) + b"Connection: close\r\n\r\n"
    assert len(head) < LIMITS.max_header_bytes
    with _connect(server) as sock:
        for start in range(0, len(head), 1000):
            sock.sendall(head[start:start + 1000])
            time.sleep(0.01)
        assert _status(_read_until_closed(sock)) == 200


def test_unfinished_headers_get_408_after_the_header_timeout(server):
    with HealthProbe(server.url):
        sockets = [_connect(server) for _ in range(20)]
        start = time.perf_counter()
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        responses = [_read_until_closed(sock) for sock in sockets]
        elapsed = time.perf_counter() - start
        for sock in sockets:
            sock.close()
    assert all(_status(r) == 408 for r in responses)
    assert TIMEOUT * 0.8 < elapsed < TIMEOUT + 1.5


def test_a_silent_socket_is_closed_after_the_header_timeout(server):
    with _connect(server) as sock:
        start = time.perf_counter()
        assert _read_until_closed(sock) == b""  # no request, so nothing to answer
        assert TIMEOUT * 0.8 < time.perf_counter() - start < TIMEOUT + 1.5


@pytest.mark.parametrize("request_head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n",  # a chunked body that never ends
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{\"prompt\": ",  # shorter than its Content-Length
], ids=["chunked-forever", "short-content-length"])
def test_a_stalled_body_gets_408_after_the_body_timeout(server, request_head):
    with HealthProbe(server.url):
        status, response, elapsed = _exchange(server, request_head)
    assert status == 408 and b"request_timeout" in response
    assert TIMEOUT * 0.8 < elapsed < TIMEOUT + 1.5


def test_a_slow_body_within_the_timeout_is_served(server):
    body = b'{"prompt": "abc", "max_tokens": 2}'
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 10):
            time.sleep(0.05)
            sock.sendall(body[i:i + 10])
        response = _read_until_closed(sock)
    assert _status(response) == 200 and b'"text":"de"' in response


def test_an_idle_keep_alive_connection_is_closed(server):
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.perf_counter()
        response = _read_until_closed(sock)  # the 200, then the close once idle
        elapsed = time.perf_counter() - start
    assert _status(response) == 200
    assert LIMITS.keep_alive_timeout_s * 0.8 < elapsed < LIMITS.keep_alive_timeout_s + 1.5


def test_connections_past_the_cap_get_503_at_once():
    limits = HTTPLimits(max_connections=8, header_timeout_s=10)
    with live_server(create_app(FakeEngine(), served_model_name="fake"), limits=limits) as served:
        held = [_connect(served) for _ in range(8)]
        time.sleep(0.2)  # accepted by the server, not only by the kernel
        status, response, elapsed = _exchange(served, b"")
        assert status == 503 and b"retry-after: 1" in response.lower() and elapsed < 1
        for sock in held:
            sock.close()
        time.sleep(0.2)
        status, _, _ = _exchange(served, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 200


def test_limits_are_checked():
    for bad in ({"max_header_bytes": 0}, {"header_timeout_s": 0}, {"max_connections": -1}):
        with pytest.raises(ValueError):
            HTTPLimits(**bad)


def test_shutdown_answers_unfinished_requests_503_and_does_not_wait_for_them():
    app = create_app(FakeEngine(), served_model_name="fake")
    with live_server(app, graceful_seconds=30) as served:
        upload = _connect(served)  # a body that stops halfway
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        head = _connect(served)  # headers that stop halfway
        head.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        idle = _connect(served)  # a finished request on a kept-alive connection
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        start = time.perf_counter()
        served.server.should_exit = True
        answers = [_read_until_closed(sock) for sock in (upload, head, idle)]
        served.thread.join(10)
        elapsed = time.perf_counter() - start
    for sock in (upload, head, idle):
        sock.close()
    assert [_status(answer) for answer in answers] == [503, 503, 200]
    assert b"shutting_down" in answers[0] and b"retry-after: 1" in answers[0].lower()
    assert not served.thread.is_alive() and elapsed < 3  # not uvicorn's 30 s graceful timeout
