"""Stop strings cost the same per token whatever their number (an Aho-Corasick automaton reads each
output character once), and what a request may ask for is bounded with clear errors."""

import dataclasses
import random
import statistics
import time

import pytest

from orca_jax.config import SamplingConfig
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.stop_strings import StopStringAutomaton
from orca_jax.sampling_params import SamplingParams
from orca_jax.tokenizer import ByteTokenizer

from tests.helpers.engines import drain, tiny_engine

TOKENIZER = ByteTokenizer(eos_token_ids=(0,))


def _stop_list(count: int) -> tuple[str, ...]:
    """~count distinct 9-character strings the tiny model's text never holds (each has a "\x01")."""
    rng = random.Random(0)
    return tuple(dict.fromkeys("\x01" + "".join(rng.choice("abcdefgh") for _ in range(8)) for _ in range(count)))


MANY = _stop_list(20_000)


@pytest.fixture(scope="module")
def engine():
    """Room for 65 requests; limits raised to allow MANY stop strings."""
    return tiny_engine(max_num_seqs=65, max_num_batched_tokens=256, num_pages=1024,
                       sampling=SamplingConfig(max_stop_strings=len(MANY), max_stop_chars=9 * len(MANY)))


def _first_stop_by_search(text: str, stop: tuple[str, ...], done: int) -> tuple[int, str] | None:
    """The reference (the old search): among stop strings ending after `done`, the earliest start,
    then the shortest."""
    hits = [(i, s) for s in stop for i in range(len(text)) if text.startswith(s, i) and i + len(s) > done]
    return min(hits) if hits else None


def test_the_automaton_finds_what_searching_every_string_finds():
    """Random stop lists over a small alphabet (so they overlap and nest), text fed in random pieces:
    the automaton reports the match a search of every string reports, piece by piece."""
    rng = random.Random(0)
    for _ in range(300):
        stop = tuple({"".join(rng.choice("ab😀") for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 6))})
        automaton, state, text = StopStringAutomaton(stop), 0, ""
        while len(text) < 30:
            piece = "".join(rng.choice("abc😀") for _ in range(rng.randint(0, 4)))
            done, text = len(text), text + piece
            state, hit = automaton.scan(state, piece)
            expected = _first_stop_by_search(text, stop, done)
            found = None if hit is None else (done + hit[0], text[done + hit[0]:done + hit[0] + hit[1]])
            assert found == expected, (stop, text, done)
            assert automaton.partial_length(state) == max(
                (k for k in range(len(text) + 1) if any(s.startswith(text[len(text) - k:]) for s in stop)))


def test_text_is_held_back_only_while_it_could_begin_a_stop_string():
    detok = IncrementalDetokenizer(TOKENIZER, ("stop here", "😀!"))
    assert not detok.add(list(b"abc st"))
    assert detok.take_new_text() == "abc "  # "st" may begin "stop here"
    assert not detok.add(list(b"abc stx 1 ") + list("😀".encode()))
    assert detok.take_new_text() == "stx 1 "  # the emoji may begin "😀!"
    assert detok.add(list(b"abc stx 1 ") + list("😀!".encode()) + list(b"more"))
    assert (detok.take_new_text(), detok.text, detok.stop_string) == ("", "abc stx 1 ", "😀!")


def test_without_stop_strings_text_and_deltas_are_those_of_a_stop_string_never_met():
    """A request with no stop strings skips the automaton and holds nothing back: its deltas and text,
    one token or several at a time and after the flush, are what a never-met stop string's give once
    nothing is held back (byte by byte, so characters arrive in pieces)."""
    data = list("héllo 😀 wörld, stop".encode()) + [200, 201]  # two bytes no UTF-8 character ends with
    plain, never = IncrementalDetokenizer(TOKENIZER), IncrementalDetokenizer(TOKENIZER, ("\x00never",))
    plain_text = never_text = ""
    for end in (1, 2, 3, 4, 7, 8, 9, 12, len(data)):
        assert not plain.add(data[:end]) and not never.add(data[:end])
        plain_text += plain.take_new_text()
        never_text += never.take_new_text()
        assert plain.text == never.text and plain_text == never_text == plain.text
    plain.flush()
    never.flush()
    assert plain_text + plain.take_new_text() == never_text + never.take_new_text() == plain.text == never.text
    assert plain.text.endswith("stop\ufffd\ufffd")


def test_a_stop_string_ending_below_min_tokens_is_passed_over():
    """As vLLM: a stop string counts only once it ends after the min_tokens-th output."""
    detok = IncrementalDetokenizer(TOKENIZER, ("ab",), include_stop_str=True)
    assert not detok.add(list(b"xab"), find_stop=False)
    assert not detok.add(list(b"xabz"))
    assert detok.add(list(b"xabzab"))
    assert detok.text == "xabzab"


def test_stop_string_limits_are_clear_errors():
    limits = SamplingConfig(max_stop_strings=3, max_stop_chars=10)
    limits.check_stop(("a", "bb", "cccc"))
    with pytest.raises(ValueError, match=r"SamplingParams.stop has 4 strings; at most 3 .*--max-stop-strings"):
        limits.check_stop(("a", "b", "c", "d"))
    with pytest.raises(ValueError, match=r"SamplingParams.stop has 11 characters in all; at most 10 .*max-stop-chars"):
        limits.check_stop(("a" * 5, "b" * 6))
    with pytest.raises(ValueError, match="max_stop_chars must be positive"):
        SamplingConfig(max_stop_chars=0)


def test_the_engine_refuses_past_its_limits_before_tokenizing():
    engine = tiny_engine()
    many = tuple(f"s{i}" for i in range(100_000))
    start = time.process_time()
    with pytest.raises(ValueError, match="SamplingParams.stop has 100000 strings"):
        engine.add_request("x" * 100_000, SamplingParams(max_tokens=2, stop=many))
    with pytest.raises(ValueError, match="logit_bias and bad_words give 0 \\+ 100000 entries"):
        engine.add_request([5], SamplingParams(max_tokens=2, bad_words=many))
    assert time.process_time() - start < 1.0  # neither the prompt nor 10^5 words were tokenized
    assert not engine.has_unfinished()


def test_a_stop_token_list_of_almost_the_whole_vocabulary(engine):
    """stop_token_ids is a set per request (each output token is looked up, not searched for)."""
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
    engine.add_request([5, 6], sampling, request_id="plain")
    expected = drain(engine)["plain"]
    others = tuple(t for t in range(engine.model_config.vocab_size) if t not in expected)
    engine.add_request([5, 6], dataclasses.replace(sampling, stop_token_ids=others), request_id="a")
    engine.add_request([5, 6], dataclasses.replace(sampling, stop_token_ids=(expected[3], *others)), request_id="b")
    assert drain(engine) == {"a": expected, "b": expected[:expected.index(expected[3]) + 1]}


def _victim_step_cpu_seconds(engine, stop: tuple[str, ...], n: int) -> list[float]:
    """CPU seconds of each engine step that gives the victim a token, with n requests of `stop` beside it
    (CPU time, not wall-clock: what a busy machine's other processes take does not count)."""
    for i in range(n):
        engine.add_request([5 + i, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True, stop=stop),
                           request_id=f"hostile-{i}")
    engine.add_request([9, 10, 11], SamplingParams(max_tokens=16, ignore_eos=True), request_id="victim")
    steps = []
    while engine.has_unfinished():
        start = time.process_time()
        outputs = engine.step()
        if any(o.request_id == "victim" and o.new_token_ids for o in outputs):
            steps.append(time.process_time() - start)
    return steps[2:]  # past the prompts' iterations


def test_many_stop_strings_do_not_slow_another_users_tokens(engine):
    """n=64 requests with 20,000 stop strings each (the limits raised to allow them): another request's
    steps cost within 2x of the same with one stop string each. (Searching every string on every
    token made them ~40x at 10,000 and ~230x at 100,000: benchmarks/probes/stop_strings_cost.py.)"""
    _victim_step_cpu_seconds(engine, MANY[:1], 64)  # compile what the runs meet
    control = statistics.median(_victim_step_cpu_seconds(engine, MANY[:1], 64))
    hostile = statistics.median(_victim_step_cpu_seconds(engine, MANY, 64))
    assert hostile < 2 * control, (hostile, control)
