"""The engine's RequestOutputs built incrementally (the totals are the request's own list up to then,
copied only when read; the text grows by each step's delta) read as if built from scratch at their step:
kept past later steps, through the core's pipe, with stop strings, logprobs and several samples of one
prompt (a server's n > 1)."""

from __future__ import annotations

import dataclasses
import pickle

from orca_jax.engine.output_wire import OutputEncoder, Received
from orca_jax.outputs import OutputIdsPrefix, RequestOutput, output_ids_tail
from orca_jax.sampling_params import SamplingParams
from tests.helpers.engines import tiny_engine


def test_an_output_made_from_a_prefix_equals_one_made_from_a_list():
    ids = [5, 6, 7]
    lazy = RequestOutput("r", [7], "c", OutputIdsPrefix(ids, 3), "abc", 2)
    ids.append(8)  # the request goes on after the output was made
    tail = output_ids_tail(lazy, 1)
    eager = RequestOutput("r", [7], "c", [5, 6, 7], "abc", 2)
    assert tail == (3, [6, 7])
    assert lazy == eager and repr(lazy) == repr(eager)
    assert lazy.output_token_ids == [5, 6, 7] and lazy.output_token_ids is lazy.output_token_ids
    again = RequestOutput("r", [7], "c", OutputIdsPrefix(ids, 3), "abc", 2)
    assert pickle.loads(pickle.dumps(again)) == eager
    assert dataclasses.replace(RequestOutput("r", [7], "c", OutputIdsPrefix(ids, 3), "abc", 2), text="x") == \
        dataclasses.replace(eager, text="x")
    eager.output_token_ids = [1]
    assert eager.output_token_ids == [1]


def _requests():
    greedy = dict(max_tokens=40, ignore_eos=True, temperature=0.0)
    requests = {f"n{i}": ("say it", SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=i))
                for i in range(3)}  # one prompt's three choices, as a server makes them
    requests["greedy-twice"] = ("say it", SamplingParams(**greedy))
    requests["logprobs"] = ("abc", SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, seed=3,
                                                  temperature=1.0))
    return requests, greedy


def test_outputs_kept_across_steps_read_their_own_steps_totals():
    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=64)
    requests, greedy = _requests()
    probe_id = engine.add_request("say it", SamplingParams(**greedy))
    probe = ""
    while engine.has_unfinished():
        probe += "".join(o.new_text for o in engine.step() if o.request_id == probe_id)
    stop = probe[12:14]  # two characters the greedy output reaches: cut inside held-back text
    requests["stop"] = ("say it", SamplingParams(**greedy, stop=(stop,)))
    requests["stop-kept"] = ("say it", SamplingParams(**greedy, stop=(stop,), include_stop_str_in_output=True))
    for request_id, (prompt, sampling) in requests.items():
        engine.add_request(prompt, sampling, request_id=request_id)
    kept: dict[str, list[tuple[RequestOutput, list[int], str, str]]] = {r: [] for r in requests}
    encoder, received, rebuilt = OutputEncoder(), {}, {r: [] for r in requests}
    ids_so_far = {r: [] for r in requests}
    while engine.has_unfinished():
        outputs = engine.step()
        for output in outputs:
            ids_so_far[output.request_id] += output.new_token_ids
            # What a from-scratch output of this step holds, recorded now; compared after the run.
            kept[output.request_id].append((output, list(ids_so_far[output.request_id]), output.text,
                                            "".join(o.new_text for o, *_ in kept[output.request_id]) + output.new_text))
        for row in pickle.loads(pickle.dumps(encoder.encode_all(outputs))):
            totals = received.setdefault(row[0], Received())
            rebuilt[row[0]].append(totals.decode(row))
    for request_id, steps in kept.items():
        assert steps[-1][0].finished and sum(o.finished for o, *_ in steps) == 1
        for (output, ids, text, streamed), copy in zip(steps, rebuilt[request_id], strict=True):
            assert output.output_token_ids == ids  # read only now, many steps after it was made
            assert output.text == text and text.startswith(streamed)
            assert copy == output and copy.output_token_ids is not output.output_token_ids
        final = steps[-1][0]
        assert "".join(o.new_text for o, *_ in steps) == final.text  # the stream adds up to the final text
    assert kept["n0"][-1][0].output_token_ids != kept["n1"][-1][0].output_token_ids  # the choices differ
    cut, whole = kept["stop"][-1][0], kept["stop-kept"][-1][0]
    assert cut.stop_reason == stop and cut.text == probe[:probe.find(stop)]
    assert whole.text == probe[:probe.find(stop) + len(stop)]
    assert all(len(o.new_logprobs) == len(o.new_token_ids) for o, *_ in kept["logprobs"])
