"""The host side of logits processing (no jax): rules resolved from SamplingParams, the logit-table
entries of an iteration, penalty slots, and the per-batch sampling inputs and modes."""

import math

import numpy as np
import pytest

from orca_jax.core.request import Request
from orca_jax.core.sched.output import ScheduledRequest
from orca_jax.sample.batcher import PenaltySlots, SamplingBatcher
from orca_jax.sample.mode import FILL_ENTRIES, FILL_RESETS, TOP_K_CANDIDATES, SampleMode
from orca_jax.sample.rules import LogitsRules, bad_word_token_ids
from orca_jax.sampling_params import SamplingParams
from orca_jax.tokenizer import ByteTokenizer

V = 256


class WordTokenizer:
    """Words to fixed ids: ' ab' is one token of its own, ' cd' splits like 'cd'."""

    IDS = {"ab": [10, 11], " ab": [12, 13], "cd": [20], " cd": [30, 20], "x": [40], " x": [40]}

    def encode(self, text, add_special_tokens=False):
        return self.IDS[text]


def test_bad_words_are_tokenized_as_vllm_does():
    # The spaced form is kept only when it starts with another token and has as many tokens.
    assert bad_word_token_ids(["ab", "  cd", "x"], WordTokenizer()) == [(10, 11), (12, 13), (20,)] + [(40,)]


def test_sampling_params_checks_name_the_field():
    for kwargs, field in [(dict(presence_penalty=2.5), "presence_penalty"),
                          (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                          (dict(min_tokens=5, max_tokens=4), "min_tokens"),
                          (dict(logit_bias={"a": 1.0}), "logit_bias"), (dict(logit_bias={3: math.inf}), "logit_bias"),
                          (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[" "]), "bad_words"),
                          (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logprobs=-1), "logprobs")]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**kwargs)
    sp = SamplingParams(logit_bias={"7": 1, 3: -2.5}, top_k=-1, bad_words="x")
    assert sp.logit_bias == ((3, -2.5), (7, 1.0)) and sp.top_k == 0 and sp.bad_words == ("x",)
    assert hash(sp) == hash(SamplingParams(logit_bias={7: 1.0, 3: -2.5}, bad_words=["x"]))


def _rules(**kwargs) -> LogitsRules:
    return LogitsRules.resolve(SamplingParams(max_tokens=8, **kwargs), ByteTokenizer(), (2,), V, V, 16)


def test_rules_resolve_to_token_ids_and_refuse_what_cannot_fit():
    assert _rules(temperature=0.7, top_p=0.9, min_p=0.1) is None  # nothing for the logits processor
    rules = _rules(logit_bias={65: 3.0}, bad_words=["a", "bc"], stop_token_ids=[9], min_tokens=2)
    assert rules.bias_ids.tolist() == [65, 97] and rules.bias_values.tolist() == [3.0, -math.inf]
    assert rules.bad_word_sequences == ((98, 99),) and rules.stop_ids.tolist() == [9, 2]
    assert rules.num_entries == 5 and not rules.uses_penalties and rules.allowed_mask is None
    with pytest.raises(ValueError, match="SamplingParams.logit_bias"):
        _rules(logit_bias={V: 1.0})
    with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids"):
        _rules(allowed_token_ids=[V + 3])
    with pytest.raises(ValueError, match="logit_table_width"):
        _rules(logit_bias={i: 1.0 for i in range(17)})


def test_entries_of_an_iteration():
    rules = _rules(bad_words=["ab", "cde"], min_tokens=3)  # (97, 98) and (99, 100, 101)
    ids, values, conditions = rules.entries([5, 97], step=2, pending=False)
    assert (ids, conditions) == ([98, 2], [-1, -1]) and values == [-math.inf] * 2  # 'a' just out: ban 'b'; EOS
    # The last output still on device: 'ab' bans 'b' if it is 'a'; 'cde' bans 'e' if it is 'd' after 'c'.
    ids, _, conditions = rules.entries([5, 99], step=3, pending=True)
    assert (ids, conditions) == ([98, 101], [97, 100])
    ids, _, _ = rules.entries([99, 100], step=2, pending=False)
    assert ids == [101, 2]
    assert rules.entries([], step=0, pending=False)[0] == [2]


def test_penalty_slots_are_kept_refilled_after_preemption_and_taken_over_least_recently_used():
    slots = PenaltySlots(2)
    a, b, c = (Request(r, [1], SamplingParams()) for r in "abc")
    assert slots.assign(a, set()) == (0, True) and slots.assign(a, set()) == (0, False)
    assert slots.assign(b, set()) == (1, True)
    a.num_preemptions += 1  # its counts may hold a token the host dropped: refill
    assert slots.assign(a, set()) == (0, True)
    assert slots.assign(c, {0}) == (1, True) and slots.slot_of(b) is None  # b's was least recently used
    with pytest.raises(RuntimeError):
        slots.assign(b, {0, 1})
    slots.release(c)
    assert slots.assign(b, {0}) == (1, True)


def _item(request, start, num_tokens, *, step=0, source=-1, seed=0):
    return ScheduledRequest(request=request, start=start, token_ids=(0,) * num_tokens, page_ids=(1,), seed=seed,
                            sampling=request.sampling, step=step, token_source=source)


def _request(rid, prompt_len=4, rules=None, **sampling):
    sp = SamplingParams(max_tokens=8, **sampling)
    request = Request(rid, list(range(3, 3 + prompt_len)), sp)
    request.logits_rules = LogitsRules.resolve(sp, ByteTokenizer(), (2,), V, V, 16) if rules is None else rules
    return request


def test_batch_modes_and_discarded_samples():
    batcher = SamplingBatcher(4, V, 16)
    mode = lambda *items: batcher.rows(items, 8).sample_mode  # noqa: E731
    greedy, small_k = _request("g"), _request("k", temperature=0.8, top_k=TOP_K_CANDIDATES, top_p=0.5)
    plain, top_p = _request("t", temperature=0.8, min_p=0.2), _request("p", temperature=0.8, top_p=0.9)
    big_k = _request("K", temperature=0.8, top_k=TOP_K_CANDIDATES + 1)
    assert mode(_item(greedy, 0, 4)) is SampleMode.GREEDY
    assert mode(_item(greedy, 0, 4), _item(small_k, 0, 4), _item(plain, 0, 4)) is SampleMode.SAMPLE
    assert mode(_item(small_k, 0, 4), _item(top_p, 0, 4)) is SampleMode.SEARCH
    assert mode(_item(big_k, 0, 4), _item(top_p, 0, 4)) is SampleMode.SEARCH_TOP_K
    # A mid-prompt chunk's sample is dropped: drawn greedily, it asks for no program of its own.
    rows = batcher.rows([_item(top_p, 0, 2)], 8)
    assert rows.sample_mode is SampleMode.GREEDY and rows.temperature[0] == 0.0
    assert not rows.logits_processed and rows.num_top_logprobs == 0
    rows = batcher.rows([_item(top_p, 0, 4)], 8)  # SEARCH programs process logits (neutral here)
    assert rows.logits_processed and rows.num_top_logprobs == 20 and (rows.penalty_slot == -1).all()
    # min_tokens alone needs processing only until that many outputs are out.
    short = _request("m", min_tokens=2)
    assert [batcher.rows([_item(short, 3 + step, 1, step=step)], 8).logits_processed for step in range(4)] \
        == [True, True, False, False]


def test_processed_rows_get_slots_tables_and_fills():
    batcher = SamplingBatcher(4, V, 16)
    penalized = _request("p", prompt_len=5, repetition_penalty=1.2, frequency_penalty=0.5)
    banned = _request("b", bad_words=["ab"], allowed_token_ids=[97, 98, 99])
    banned.output_token_ids = [97]
    chunk = _request("c", repetition_penalty=1.5)
    rows = batcher.rows([_item(penalized, 0, 5), _item(chunk, 0, 2), _item(banned, 4, 1, step=1)], 8)
    assert rows.logits_processed and rows.sample_mode is SampleMode.GREEDY
    assert rows.penalty_slot[:3].tolist() == [0, -1, -1]  # the mid-prompt chunk needs no slot yet
    np.testing.assert_allclose(rows.repetition_penalty[:3], [1.2, 1.0, 1.0])
    assert rows.bias_token_ids[2, :1].tolist() == [98] and (rows.bias_token_ids[2, 1:] == V).all()
    assert rows.allowed_mask is not None and (rows.allowed_mask[[0, 1]] == -1).all()
    assert rows.penalty_resets.tolist() == [[0] + [-1] * (FILL_RESETS - 1)]
    fill = rows.penalty_fill[0]
    assert fill[:5].tolist() == [[0, t, 0] for t in range(3, 8)] and (fill[5:] == -1).all()
    # The next iteration: the same slot, no fill; the token is still on device (async): a conditional ban.
    penalized.output_token_ids = [9, 9]
    banned.output_token_ids = [97, 5]
    rows = batcher.rows([_item(penalized, 6, 1, step=2, source=0), _item(banned, 5, 1, step=3, source=2)], 8)
    assert rows.penalty_slot[:2].tolist() == [0, -1] and rows.penalty_fill is None
    assert rows.sampled_source[:2].tolist() == [0, 2] and rows.bias_conditions[1, 0] == 97
    # After a preemption its counts are rebuilt from the host's tokens: prompt and outputs (counted).
    penalized.num_preemptions = 1
    rows = batcher.rows([_item(penalized, 0, 7, step=2)], 8)
    fill = rows.penalty_fill[0]
    assert fill[:6].tolist() == [[0, t, 0] for t in range(3, 8)] + [[0, 9, 2]]


def test_long_fills_split_over_calls_each_slot_reset_first():
    batcher = SamplingBatcher(FILL_RESETS + 2, 5000, 16)
    requests = [_request(str(i), repetition_penalty=1.1) for i in range(FILL_RESETS + 1)]
    long = Request("long", list(range(FILL_ENTRIES + 10)), SamplingParams(repetition_penalty=1.1))
    long.logits_rules = requests[0].logits_rules
    items = [_item(long, 0, len(long.prompt_token_ids))] + [_item(r, 0, 4) for r in requests]
    rows = batcher.rows(items, 32)
    resets, fills = rows.penalty_resets, rows.penalty_fill
    seen_reset: set[int] = set()
    for call_resets, call_entries in zip(resets, fills):
        seen_reset |= {int(s) for s in call_resets if s >= 0}
        assert {int(s) for s in call_entries[:, 0] if s >= 0} <= seen_reset  # reset in this call or earlier
    assert sorted(seen_reset) == list(range(FILL_RESETS + 2))
    assert sum(int((f[:, 0] >= 0).sum()) for f in fills) == FILL_ENTRIES + 10 + 4 * (FILL_RESETS + 1)
