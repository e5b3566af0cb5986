"""What a caller hears of a request after an iteration: its new tokens, text and logprobs as a
RequestOutput. Stop conditions were applied by the scheduler's update (core/request.py's stop_status);
this only collects what they left, from the request and its detokenizer.
"""

from __future__ import annotations

from orca_jax.core.request import Request
from orca_jax.outputs import OutputIdsPrefix, RequestOutput, TokenLogprob


def request_output(request: Request, num_new: int) -> RequestOutput:
    """The RequestOutput of a request's last num_new output tokens (0: none, e.g. a request dropped
    while waiting); a finished request's held-back text is released, and the prompt logprobs go with
    its first output only."""
    detok = request.detokenizer
    ids = request.output_token_ids
    status = request.status
    finished = status.finished  # read once: this runs per request per iteration
    if finished:
        detok.flush()
    new_logprobs = None
    if num_new and request.sampling.logprobs is not None:
        new_logprobs = [TokenLogprob(t, lp, top) for t, lp, top in zip(
            ids[-num_new:], request.output_logprobs[-num_new:],
            request.output_top_logprobs[-num_new:])]
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None:  # the first output's only
        request.prompt_logprobs = None
    scheduled_time = request.scheduled_time
    # Positional, in RequestOutput's field order: built per request per iteration, and by keyword it costs
    # more. The totals are the request's own list up to now (it only grows), copied only if read.
    return RequestOutput(
        request.request_id, ids[len(ids) - num_new:], detok.take_new_text(), OutputIdsPrefix(ids, len(ids)),
        detok.text, len(request.prompt_token_ids), finished, status.value if finished else None, new_logprobs,
        None if scheduled_time is None else scheduled_time - request.arrival_time, request.num_cached_tokens,
        request.stop_reason if finished else None, prompt_logprobs, request.error)
