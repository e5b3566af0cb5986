"""The one stop check with a grammar and vLLM's stop_reason, through a real Scheduler (no model).

A request's matcher follows its output tokens in scheduler.update: a grammar that is complete
finishes the request ("stop", before max_tokens), a token the grammar refuses aborts it (the mask
makes that impossible; it would be a bug), and stop_reason names the stop string or stop token id.
"""

from __future__ import annotations

import pytest

from orca_jax.core.request import RequestStatus
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.structured import Constraint, ConstraintKind, GrammarCompiler
from orca_jax.tokenizer import ByteTokenizer

from tests.helpers.scheduler import EOS, create_scheduler, make_request

TOKENIZER = ByteTokenizer(eos_token_ids=(EOS,))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, 256)


def _run(request, tokens):
    """Feed `tokens` one iteration each until the request finishes; the request."""
    request.detokenizer = IncrementalDetokenizer(TOKENIZER, request.sampling.stop,
                                                 request.sampling.include_stop_str_in_output)
    sched, kv, _ = create_scheduler()
    sched.add_request(request)
    for token in tokens:
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        sched.update(out, [token])
    assert not sched.has_unfinished() and kv.num_reserved_pages == 0
    return request


def _constrained(compiler, constraint, max_tokens=10, **sampling):
    request = make_request("r", max_tokens=max_tokens, sampling={"structured_outputs": constraint, **sampling})
    request.grammar = compiler.matcher(constraint)
    return request


def test_a_complete_grammar_finishes_the_request_before_max_tokens(compiler):
    choice = Constraint(ConstraintKind.CHOICE, ("yes", "no"))
    done = _run(_constrained(compiler, choice), b"yes!!")
    assert (done.status, done.detokenizer.text, done.stop_reason) == (RequestStatus.FINISHED_STOPPED, "yes", None)
    exact = _run(_constrained(compiler, choice, max_tokens=2), b"no")  # complete at max_tokens: "stop"
    assert exact.status is RequestStatus.FINISHED_STOPPED and exact.output_token_ids == list(b"no")
    # A regex that may go on: EOS, allowed where it may end, ends it as usual.
    digits = _run(_constrained(compiler, Constraint(ConstraintKind.REGEX, "[0-9]+")), [ord("4"), ord("2"), EOS])
    assert digits.status is RequestStatus.FINISHED_STOPPED and digits.detokenizer.text == "42"
    # ignore_eos: the grammar still accepts EOS where it may end, and is then complete.
    ignoring = _run(_constrained(compiler, Constraint(ConstraintKind.REGEX, "[0-9]+"), ignore_eos=True),
                    [ord("7"), EOS, ord("7")])
    assert ignoring.status is RequestStatus.FINISHED_STOPPED and ignoring.output_token_ids == [ord("7"), EOS]


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(compiler, caplog):
    refused = _run(_constrained(compiler, Constraint(ConstraintKind.CHOICE, ("yes", "no"))), b"yo")
    assert refused.status is RequestStatus.FINISHED_ERROR and refused.output_token_ids == list(b"yo")
    assert "not allowed by the request's choice" in refused.error.message and refused.error.caused_by_request
    assert "not allowed by the request's choice" in caplog.text


def test_stop_reason_names_the_stop_string_or_token():
    string = _run(make_request("s", max_tokens=10, sampling={"stop": ("c",)}), b"abcd")
    assert (string.status, string.stop_reason, string.detokenizer.text) == (RequestStatus.FINISHED_STOPPED, "c", "ab")
    token = _run(make_request("t", max_tokens=10, sampling={"stop_token_ids": (9,)}), [7, 9, 7])
    assert token.stop_reason == 9
    eos = _run(make_request("e", max_tokens=10, sampling={"stop_token_ids": (EOS,)}), [7, EOS])
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.stop_reason is None  # the model's own EOS
    length = _run(make_request("l", max_tokens=2), [7, 7])
    assert length.status is RequestStatus.FINISHED_LENGTH and length.stop_reason is None


def test_bytes_pending_after_a_stop_string_stay_out_of_the_text():
    """The token that completes a stop string may end inside a character: the bytes pending then come
    after the cut, and the final flush must not add them (as U+FFFD) to the text."""
    detok = IncrementalDetokenizer(TOKENIZER, ("end",))
    assert not detok.add(list(b"abe"))
    assert detok.add(list(b"abend") + [0xE4])  # "end" found with half of a 3-byte character pending
    detok.flush()
    assert detok.text == "ab" and detok.take_new_text() == "ab"
