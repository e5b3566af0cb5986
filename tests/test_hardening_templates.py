"""A chat's prompt in linear time: where each message's content lies is found in one pass, and a
token's overlap with those spans by bisection (10,001 messages took 25 s, now about 1.5 s)."""

from __future__ import annotations

import random
import time

from orca_jax.chat_template import content_spans, overlaps

from tests.helpers.structured import smollm2_tokenizer


def _brute_overlaps(start, end, spans):
    return any(start < span_end and span_start < end for span_start, span_end in spans)


def test_overlaps_agrees_with_a_scan_of_every_span():
    rng = random.Random(0)
    for _ in range(2000):
        cuts = sorted(rng.sample(range(60), rng.randrange(0, 12) * 2))
        spans = [(cuts[i], cuts[i + 1] if rng.random() < 0.8 else cuts[i]) for i in range(0, len(cuts), 2)]
        start = rng.randrange(0, 60)
        end = start + rng.randrange(0, 8)
        assert overlaps(start, end, spans) == _brute_overlaps(start, end, spans), (start, end, spans)


def test_content_spans_of_a_long_chat_come_quickly_and_in_order():
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(10_001)]
    render = lambda marked: "".join(f"<|{m['role']}|>{m['content']}\n" for m in marked)  # noqa: E731
    prompt = render(messages)
    started = time.process_time()  # CPU time: what other processes on a busy host take does not count
    spans = content_spans(render, messages, prompt)
    assert time.process_time() - started < 1.0
    assert [prompt[a:b] for a, b in spans] == [m["content"] for m in messages]


def test_a_template_that_repeats_a_content_gives_no_spans():
    messages = [{"role": "user", "content": "hi"}]
    render = lambda marked: "".join(m["content"] * 2 for m in marked)  # noqa: E731
    assert content_spans(render, messages, "hihi") is None


def test_a_long_chat_with_typed_control_tokens_encodes_in_seconds_not_minutes():
    tokenizer = smollm2_tokenizer()  # ChatML, whose <|im_end|> typed in content must stay text
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} <|im_end|> hi"}
                for i in range(10_001)]
    started = time.process_time()  # CPU time: what other processes on a busy host take does not count
    ids = tokenizer.encode_chat(messages)
    assert time.process_time() - started < 8.0, "25 s before content_spans and overlaps were linear"
    # Only the template's own turn ends: its default system prompt's and one per message.
    assert ids.count(tokenizer.eos_token_ids[0]) == 10_002
