"""engine/output_wire.py: the engine core's outputs sent as deltas rebuild, field for field, the
RequestOutputs the engine made."""

from __future__ import annotations

import dataclasses
import pickle

from orca_jax.engine.output_wire import REST, OutputEncoder, Received, request_id_of
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams
from tests.helpers.engines import tiny_engine


def _through_the_pipe(encoder: OutputEncoder, received: dict[str, Received], outputs: list[RequestOutput]):
    rows = pickle.loads(pickle.dumps(encoder.encode_all(outputs)))
    rebuilt = []
    for row in rows:
        totals = received.setdefault(request_id_of(row), Received())
        rebuilt.append(totals.decode(row))
        if rebuilt[-1].finished:
            del received[request_id_of(row)]
    return rebuilt


def test_the_rows_rest_is_request_outputs_fields_after_the_totals():
    names = [field.name for field in dataclasses.fields(RequestOutput)]
    assert tuple(names[5:]) == REST


def _final_text(engine, prompt: str, sampling: SamplingParams) -> str:
    request_id = engine.add_request(prompt, sampling)
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.text
    raise AssertionError("no final output")


def test_every_output_of_an_engine_is_rebuilt_as_it_was():
    """Stop strings (text held back, then cut below what was sent), logprobs, long outputs, an abort."""
    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=64)
    probe = _final_text(engine, "stop here", SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))
    stop = probe[10:12]  # two characters the greedy output reaches: cut inside held-back text
    requests = {
        "stop": ("stop here", SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, stop=(stop,))),
        "stop-kept": ("stop here", SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, stop=(stop,),
                                                  include_stop_str_in_output=True)),
        "logprobs": ("abc", SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2, seed=3, temperature=1.0)),
        "long": ("a long one", SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)),
        "aborted": ("gone soon", SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)),
    }
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(prompt, sampling, request_id=request_id)
    encoder, received = OutputEncoder(), {}
    seen, steps = 0, 0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        if steps == 5:
            engine.abort("aborted")
            encoder.forget("aborted")
            received.pop("aborted", None)
            outputs = [o for o in outputs if o.request_id != "aborted"]
        for original, rebuilt in zip(outputs, _through_the_pipe(encoder, received, outputs), strict=True):
            assert rebuilt == original
            assert rebuilt.output_token_ids is not original.output_token_ids
        seen += len(outputs)
    assert seen > 60 and not received and not encoder._sent
    assert _final_text(engine, "stop here", requests["stop"][1]) == probe[:probe.find(stop)]  # the cut happened


def test_text_cut_below_what_was_sent_and_a_request_seen_again_after_its_abort():
    encoder, received = OutputEncoder(), {}

    def output(ids, text, new_ids, new_text, finished=False):
        return RequestOutput("r", new_ids, new_text, ids, text, 3, finished, "stop" if finished else None)

    steps = [output([1], "ab", [1], ""), output([1, 2], "abcd", [2], "ab"),
             output([1, 2, 3], "a", [3], "", finished=True)]  # the stop string began at "b"
    for step in steps:
        assert _through_the_pipe(encoder, received, [step]) == [step]
    assert not received and not encoder._sent
    # Cut below what was sent, then added to in the same last step: the final text goes whole.
    for step in [output([1], "abend", [1], "ab"), output([1, 2], "ab\ufffd", [2], "\ufffd", finished=True)]:
        assert _through_the_pipe(encoder, received, [step]) == [step]
    encoder.encode(output([1], "ab", [1], ""))
    encoder.forget("r")  # aborted: the front end starts the request's totals afresh
    again = output([1, 2], "abcd", [2], "ab")
    assert _through_the_pipe(encoder, received, [again]) == [again]
