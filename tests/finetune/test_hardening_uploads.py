"""Training files checked in a bounded, cancellable way (issue 47: a 50 MB upload got no answer in
300 s, was checked on after its client left, and took the server from 2.2 to 6.6 GB): checked as
read, a chunk and a line at a time, the first bad line refused at once, given up when the client
leaves; a line with a lone surrogate is a 400 naming the field (the tokenizer raised a TypeError:
a 500); numbers in a job's hyperparameters are JSON numbers ("1" is refused)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import time
import tracemalloc

import pytest

from orca_jax.engine import Engine
from orca_jax.finetune.data import DatasetError, check_jsonl, read_jsonl
from orca_jax.models.loader import load_model
from orca_jax.server.app import create_app
from orca_jax.tokenizer import ByteTokenizer
from orca_jax.tokenizer_bounds import at_most_one_token_per_byte

from tests.helpers.finetune import engine_config
from tests.helpers.server import asgi_client, chatml_tokenizer, live_server

LINE = (json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 2,
                    "completion": " and runs away into the forest."}) + "\n").encode()
CHAT = (json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n").encode()
SURROGATE = b'{"prompt": "a\\ud800", "completion": "b"}\n'


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


def _chunks(data: bytes, size: int = 1 << 16):
    return (data[i:i + size] for i in range(0, len(data), size))


def _upload(client, data: bytes):
    return client.post("/v1/files", files={"file": ("d.jsonl", data)}, data={"purpose": "fine-tune"})


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(eos_token_ids=(2,)), chatml_tokenizer()], ids=["bytes", "bpe"])
def test_a_lone_surrogate_is_refused_naming_the_field(tokenizer):
    data = LINE + SURROGATE + b'{"messages": [{"role": "user", "content": "x\\udc00"}]}\n'
    for check in (lambda: read_jsonl(data, tokenizer, 512), lambda: check_jsonl(_chunks(data), tokenizer, 512)):
        with pytest.raises(DatasetError, match=r"line 2: 'prompt' is not valid Unicode: a lone surrogate"):
            check()
    with pytest.raises(DatasetError, match=r"line 1: messages\[0\].content is not valid Unicode"):
        check_jsonl(_chunks(data.split(b"\n")[2]), tokenizer, 512)


def test_a_surrogate_pair_is_text():
    emoji = b'{"prompt": "\\ud83d\\ude00", "completion": "b"}\n'
    assert check_jsonl(_chunks(emoji), chatml_tokenizer(), 512) == 1


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(eos_token_ids=(2,)), chatml_tokenizer()], ids=["bytes", "bpe"])
def test_checking_as_read_agrees_with_reading_whole(tokenizer):
    """The same examples pass and the same first bad line fails, whether an example's fit is proven
    from its bytes or tokenized; chunk boundaries fall anywhere."""
    fast = at_most_one_token_per_byte(tokenizer)
    assert fast
    long_line = (json.dumps({"prompt": "p" * 300, "completion": "c" * 300}) + "\n").encode()  # past 512 bytes
    near_the_limit = (json.dumps({"prompt": "ab" * 150, "completion": "c" * 210}) + "\n").encode()
    good = LINE * 3 + CHAT + b"\n" + near_the_limit + LINE
    assert check_jsonl(_chunks(good, 7), tokenizer, 512, one_token_per_byte=fast) == len(read_jsonl(good, tokenizer, 512))
    for bad in (long_line, b'{"prompt": "a", "completion": ""}\n', b"{not json\n", b'{"prompt": 1}\n'):
        data = LINE * 2 + bad + LINE
        with pytest.raises(DatasetError) as whole:
            read_jsonl(data, tokenizer, 512)
        with pytest.raises(DatasetError) as as_read:
            check_jsonl(_chunks(data, 5), tokenizer, 512, one_token_per_byte=fast)
        assert str(as_read.value) == str(whole.value) and whole.value.line == 3


def test_a_line_that_no_example_could_fill_is_refused_before_its_end():
    read = []

    def chunks():
        yield LINE
        for _ in range(10_000):  # a 640 MB line, never made whole
            read.append(1)
            yield b"x" * (1 << 16)

    with pytest.raises(DatasetError, match="line 2: longer than 1000000 bytes"):
        check_jsonl(chunks(), ByteTokenizer(), 512, max_line_bytes=1_000_000)
    assert len(read) < 20


def test_memory_is_a_chunk_and_a_line_however_large_the_file():
    def chunks():  # 50 MB, made as read
        block = LINE * (1 << 20 // len(LINE))
        for _ in range(50 * 10**6 // len(block)):
            yield block

    tracemalloc.start()
    try:
        count = check_jsonl(chunks(), ByteTokenizer(eos_token_ids=(2,)), 512, one_token_per_byte=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count > 300_000
    assert peak < 8 << 20, peak  # read_jsonl kept every example: gigabytes


def test_an_upload_is_answered_in_seconds_and_a_bad_line_at_once(tiny, tmp_path):
    """Scaled from the issue's 50 MB (benchmarks/probes/attack_replay.py runs that size on a server)."""
    app = create_app(Engine(engine_config(str(tmp_path)), tiny), served_model_name="tiny")
    data = LINE * (10 * 10**6 // len(LINE))

    async def scenario():
        async with asgi_client(app, timeout=120) as client:
            start = time.monotonic()
            answer = await _upload(client, data)
            took = time.monotonic() - start
            assert answer.status_code == 200 and answer.json()["bytes"] == len(data), answer.text
            assert took < 10, took  # ~1 s on an idle 2-core machine; 300 s for 50 MB before
            bad = await _upload(client, SURROGATE + data)
            assert bad.status_code == 400 and bad.json()["error"]["message"].startswith(
                "invalid training file: line 1: 'prompt' is not valid Unicode")

    asyncio.run(scenario())


class _CountingTokenizer(ByteTokenizer):
    """A byte tokenizer that counts the chats it encodes (how far a check got)."""

    def __init__(self):
        super().__init__(eos_token_ids=(2,), bos_token_id=1)
        self.chats = 0

    def encode_chat(self, *args, **kwargs):
        self.chats += 1
        return super().encode_chat(*args, **kwargs)


def test_a_check_stops_when_its_client_leaves(tiny, tmp_path):
    tokenizer = _CountingTokenizer()
    engine = Engine(engine_config(str(tmp_path)), dataclasses.replace(tiny, tokenizer=tokenizer))
    lines = 200_000  # minutes of checking: chats are rendered and tokenized, line by line
    body, content_type = _multipart(CHAT * lines)
    with live_server(create_app(engine, served_model_name="tiny")) as server:
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/files HTTP/1.1\r\nHost: localhost\r\nContent-Type: " + content_type
                     + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 120
        while tokenizer.chats == 0:  # the check is under way
            assert time.monotonic() < deadline, "the check never started"
            time.sleep(0.01)
        sock.close()
        counts = [tokenizer.chats]
        while True:  # until it has stopped: two looks 0.5 s apart see the same count
            time.sleep(0.5)
            counts.append(tokenizer.chats)
            if counts[-1] == counts[-2]:
                break
            assert time.monotonic() < deadline, "the check went on after its client left"
    assert counts[-1] < lines // 2, counts
    assert os.listdir(engine.fine_tuning.store.files_dir) == []  # nothing stored


def _multipart(data: bytes) -> tuple[bytes, bytes]:
    boundary = b"orca-test-boundary"
    body = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            + b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="d.jsonl"\r\n'
            + b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--" + boundary + b"--\r\n")
    return body, b"multipart/form-data; boundary=" + boundary


@pytest.mark.parametrize("value", ["1", "auto ", "1e-3", True])
def test_hyperparameter_numbers_must_be_json_numbers(tiny, tmp_path, value):
    app = create_app(Engine(engine_config(str(tmp_path)), tiny), served_model_name="tiny")

    async def scenario():
        async with asgi_client(app, timeout=60) as client:
            file_id = (await _upload(client, LINE * 4)).json()["id"]
            answer = await client.post("/v1/fine_tuning/jobs", json={
                "model": "tiny", "training_file": file_id, "hyperparameters": {"learning_rate_multiplier": value}})
            assert answer.status_code == 400, answer.text
            assert "learning_rate_multiplier" in answer.json()["error"]["message"]
            assert (await client.get("/v1/fine_tuning/jobs")).json()["data"] == []
            whole = await client.post("/v1/fine_tuning/jobs", json={
                "model": "tiny", "training_file": file_id, "hyperparameters": {"n_epochs": 2.0}, "seed": 3.0})
            assert whole.status_code == 200, whole.text  # JSON does not tell 2.0 from 2

    asyncio.run(scenario())
