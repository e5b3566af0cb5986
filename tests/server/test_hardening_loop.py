"""Nothing one client sends stalls the others (issue 47): while each hostile request runs, /health
answers within 100 ms at the 99th percentile (and never a second late), and another client's first
streamed token comes within twice its idle time (the median, plus a floor) and never a second late;
each bound over the machine's own noise, measured just before (the idle /health p99).

The hostile requests: a non-streamed chat of n=64 choices x 128 tokens x 20 top logprobs (a ~10 MB
body, built and encoded on the loop before: /health froze for 5 s); prompts of 1.9 MB to each route
that tokenizes (refused by their length before tokenizing), and of 0.3 MB with a real BPE tokenizer
and a context long enough that they are tokenized (by a worker process); a 2 MB body of token ids
(parsed and validated off the loop, its ids never looked at one by one on it). Timing is measured, never
waited on: the pollers run until the hostile request's answer has arrived, whatever that takes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.process import ROOT, OutputDrained, checkout_env, free_port, wait_healthy

HEALTH_P99_S = 0.1
NO_STALL_S = 1.0  # the bar: no /health answer a second late
TTFT_FLOOR_S = 0.1  # scheduling noise of a loaded 2-core machine, added to twice the idle time
BIG_PROMPT = "hello " * 330_000  # 1.98 MB, the issue's
MID_PROMPT = "hello " * 50_000  # 0.3 MB: past the tokenizer process's threshold, within the BPE server's bound


def _chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


# name -> (path, body, status with the byte tokenizer, with the BPE one: None where it does not matter)
HOSTILE = {
    "13 MB chat response": ("/v1/chat/completions", _chat("hi", n=64, logprobs=True, top_logprobs=20,
                                                          max_tokens=128, ignore_eos=True), 200, None),
    "1.9 MB prompt, completions": ("/v1/completions", {"prompt": BIG_PROMPT, "max_tokens": 1}, 400, 400),
    "1.9 MB prompt, chat": ("/v1/chat/completions", _chat(BIG_PROMPT, max_tokens=1), 400, 400),
    "1.9 MB prompt, tokenize": ("/tokenize", {"prompt": BIG_PROMPT}, 400, 400),
    # Under the BPE server's bound: tokenized by its worker process, then refused for its 300,000 tokens.
    "0.3 MB prompt, completions": ("/v1/completions", {"prompt": MID_PROMPT, "max_tokens": 1}, 400, 400),
    "0.3 MB prompt, chat": ("/v1/chat/completions", _chat(MID_PROMPT, max_tokens=1), 400, 400),
    "2 MB of token ids": ("/v1/completions", {"prompt": [104] * 400_000, "max_tokens": 1}, 400, None),
}


def _ttft(client: httpx.Client, url: str) -> float:
    """Seconds from sending a small streamed completion to its first token."""
    start = time.monotonic()
    with client.stream("POST", url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}) \
            as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text":"b"' in line:
                return time.monotonic() - start
    raise AssertionError("no token streamed")


def _health_latencies(url: str, done: threading.Event, min_samples: int) -> list[float]:
    """/health latencies, polled every 5 ms until `done` (and at least `min_samples` of them: a quick
    400 is over after a few)."""
    latencies = []
    with httpx.Client(timeout=60) as client:
        while not done.is_set() or len(latencies) < min_samples:
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.005)
    return latencies


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _measure_while(url: str, hostile=None) -> tuple[list[float], list[float], httpx.Response | None]:
    """(/health latencies, TTFTs, the answer) while `hostile` (path, encoded body) runs, or idle for as many
    TTFT probes."""
    done = threading.Event()
    answer: list[httpx.Response] = []
    health: list[float] = []
    poller = threading.Thread(target=lambda: health.extend(_health_latencies(url, done, min_samples=5)))
    poller.start()
    ttfts = []
    probe = httpx.Client(timeout=60)
    if hostile is None:
        ttfts = [_ttft(probe, url) for _ in range(5)]
        done.set()
    else:
        path, content = hostile

        def send() -> None:
            try:
                answer.append(httpx.post(url + path, content=content, headers={"content-type": "application/json"},
                                         timeout=300))
            finally:
                done.set()

        sender = threading.Thread(target=send)
        sender.start()
        while not done.is_set() or len(ttfts) < 3:
            ttfts.append(_ttft(probe, url))
        sender.join()
    poller.join()
    probe.close()
    return health, ttfts, answer[0] if answer else None


def _serve(settings: dict) -> Iterator[str]:
    """A fake-engine server in a process of its own (tests/helpers/serve_fake.py): its URL."""
    port = free_port()
    process = OutputDrained([sys.executable, "-m", "tests.helpers.serve_fake", str(port), json.dumps(settings)],
                            cwd=ROOT, env=checkout_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=120)
        with httpx.Client(timeout=60) as client:
            _ttft(client, url)  # first-request costs out of the way
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=60)


# A byte tokenizer's bound refuses 1.9 MB at once (512 tokens x 1 character); the BPE one's context of
# 2^15 tokens x its 12-character longest token refuses 1.9 MB too, and lets 0.3 MB through, to be
# tokenized by a worker process and then refused for its 300,000 tokens (whose ids are never built).
SERVERS = {
    "bytes": {"engine": {"max_num_seqs": 72, "max_waiting": 72, "num_pages": 8192, "max_model_len": 512,
                         "step_seconds": 0.002}, "app": {"max_body_bytes": 3 << 20}},
    "bpe": {"engine": {"max_num_seqs": 8, "num_pages": 1 << 14, "max_model_len": 1 << 15}, "tokenizer": "chatml",
            "app": {"max_body_bytes": 3 << 20}},
}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request):
    yield from ((request.param, url) for url in _serve(SERVERS[request.param]))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_no_hostile_request_stalls_health_or_another_clients_first_token(case, server):
    tokenizer, url = server
    path, body, *statuses = HOSTILE[case]
    status = statuses[tokenizer == "bpe"]
    if status is None:
        pytest.skip("the tokenizer matters to prompts only")
    idle_health, idle_ttfts, _ = _measure_while(url)
    health, ttfts, answer = _measure_while(url, (path, json.dumps(body).encode()))
    assert answer.status_code == status, answer.text[:500]
    if status == 400:
        assert answer.json()["error"]["code"] == "context_length_exceeded", answer.text
    else:
        assert len(answer.content) > 5_000_000 and len(answer.json()["choices"]) == 64  # 7.6 MB here, 10.8 real
    # Bounds over the machine's own noise, measured just before (a busy CI machine's p99 alone can pass
    # 100 ms): what the hostile request adds, not what the machine does.
    # On a machine with more runnable threads than cores, whatever holds the GIL may itself wait for
    # a core, so the bounds on milliseconds scale with the load (1 on a free machine; a 5 s stall still fails).
    noise, load = _p99(idle_health), max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert max(health) < NO_STALL_S + noise, (max(health), _p99(health), noise)
    assert _p99(health) < HEALTH_P99_S * load + noise, (_p99(health), noise, load)
    # Typically within twice idle (the hostile request's own work shares the machine's 2 cores, so
    # the median), and never stalled.
    assert statistics.median(ttfts) < 2 * statistics.median(idle_ttfts) + TTFT_FLOOR_S * load + noise, \
        (ttfts, idle_ttfts, load)
    assert max(ttfts) < NO_STALL_S + noise, (ttfts, idle_ttfts, noise)
