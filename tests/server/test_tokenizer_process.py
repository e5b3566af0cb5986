"""Large prompts are tokenized by a worker process (the tokenizers library holds the GIL while it
encodes): the same ids as in the server's own threads, the tokenizer's errors raised as they were
(TooManyTokensError with its counts), a worker that dies answered with TokenizerProcessDied and
replaced on the next call, and no worker left once closed."""

from __future__ import annotations

import os
import signal

import pytest

from orca_jax.server.tokenizer_process import TokenizerProcess, TokenizerProcessDied
from orca_jax.tokenizer import ByteTokenizer, ControlTokenError, TooManyTokensError

from tests.helpers.server import chatml_tokenizer


@pytest.fixture(scope="module")
def worker():
    process = TokenizerProcess(chatml_tokenizer())
    yield process
    process.close()


def test_the_worker_gives_the_same_ids(worker):
    tokenizer = chatml_tokenizer()
    text = "hello <|im_start|> world " * 100
    assert worker.encode_prompt(text, split_special_tokens=True) == tokenizer.encode_prompt(text, split_special_tokens=True)
    assert worker.encode(text) == tokenizer.encode(text)
    chat = [{"role": "user", "content": "hi <|im_end|>"}]
    assert worker.encode_chat(chat, add_generation_prompt=True) == tokenizer.encode_chat(chat, add_generation_prompt=True)


def test_errors_come_back_as_raised(worker):
    with pytest.raises(TooManyTokensError) as too_many:
        worker.encode_prompt("x" * 1000, max_tokens=10)
    assert (too_many.value.num_tokens, too_many.value.max_tokens) == (1000, 10)
    with pytest.raises(TypeError):
        worker.encode(12345)


def test_a_dead_worker_is_a_clear_error_and_is_replaced():
    process = TokenizerProcess(ByteTokenizer())
    try:
        assert process.encode("ab") == [97, 98]
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(TokenizerProcessDied):
            process.encode("ab")
        assert process.encode("cd") == [99, 100]
    finally:
        process.close()


def test_close_ends_the_worker():
    process = TokenizerProcess(ByteTokenizer())
    process.start()
    pid = process.pid
    process.close()
    assert process.pid is None
    with pytest.raises(ChildProcessError):  # reaped: gone
        os.waitpid(pid, os.WNOHANG)


def test_too_many_tokens_in_the_servers_own_tokenizers():
    for tokenizer in (ByteTokenizer(), chatml_tokenizer()):
        with pytest.raises(TooManyTokensError):
            tokenizer.encode_prompt("y" * 100, max_tokens=99)
        assert len(tokenizer.encode_prompt("y" * 99, max_tokens=99)) == 99
        with pytest.raises(TooManyTokensError):
            tokenizer.encode_chat([{"role": "user", "content": "z" * 200}], max_tokens=100)
    with pytest.raises(ControlTokenError):
        chatml_tokenizer(template="{{ messages[0]['content'] | upper }}").encode_chat(
            [{"role": "user", "content": "<|im_start|>"}])
