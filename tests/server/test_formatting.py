"""Streamed chunks written by hand (formatting._ChunkFrame) equal the pydantic models' JSON."""

import itertools

import pytest

from orca_jax.outputs import RequestOutput
from orca_jax.server.formatting import ChatFormatter, CompletionFormatter
from orca_jax.server.responses import (
    ChatChunkChoice, ChatCompletionChunk, ChatDelta, CompletionChoice, CompletionResponse,
)
from orca_jax.tokenizer import ByteTokenizer

TEXTS = ("a", "", 'say "hi" \\ back', "é ✓ 日本\n\t\x1f\x7f\u2028")
FINISHES = ((False, None), (True, "stop"), (True, "length"))
MODEL = 'mod"el/é'  # served names are caller-chosen; quotes and non-ASCII must survive


def _output(text: str, finished: bool, reason: str | None) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=[97], new_text=text, output_token_ids=[97], text=text,
                         num_prompt_tokens=3, finished=finished, finish_reason=reason)


@pytest.mark.parametrize("text,finish,index", list(itertools.product(TEXTS, FINISHES, (0, 7))))
def test_completion_chunks_match_the_models(text, finish, index):
    formatter = CompletionFormatter("cmpl-1", MODEL, 1700000000, ByteTokenizer(), include_usage=False)
    finished, reason = finish
    chunks = formatter.chunks(index, _output(text, finished, reason))
    assert formatter.chunks(index, _output(text, finished, reason)) == chunks  # the choice's frame, kept
    if not text and not finished:
        assert chunks == []
        return
    expected = CompletionResponse(id="cmpl-1", created=1700000000, model=MODEL, choices=[
        CompletionChoice(index=index, text=text, finish_reason=reason)]).model_dump_json()
    assert chunks == [expected]


@pytest.mark.parametrize("text,finish,index", list(itertools.product(TEXTS, FINISHES, (0, 7))))
def test_chat_chunks_match_the_models(text, finish, index):
    formatter = ChatFormatter("chatcmpl-1", MODEL, 1700000000, ByteTokenizer(), include_usage=False)
    finished, reason = finish
    chunks = formatter.chunks(index, _output(text, finished, reason))
    assert formatter.chunks(index, _output(text, finished, reason)) == chunks  # the choice's frame, kept
    if not text and not finished:
        assert chunks == []
        return
    delta = ChatDelta(content=text) if text else ChatDelta()
    expected = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model=MODEL, choices=[
        ChatChunkChoice(index=index, delta=delta, finish_reason=reason)]).model_dump_json()
    assert chunks == [expected]

