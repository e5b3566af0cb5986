"""What a caller hears of a request after an iteration: its new tokens, text and logprobs as a
RequestOutput. Stop conditions were applied by the scheduler's update (core/request.py's stop_status);
this only collects what they left, from the request and its detokenizer.
"""

from __future__ import annotations

from orca_jax.core.request import Request
from orca_jax.outputs import RequestOutput, TokenLogprob


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
    prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None  # the first output's only
    scheduled_time = request.scheduled_time
    return RequestOutput(
        request_id=request.request_id, new_token_ids=ids[len(ids) - num_new:], new_text=detok.take_new_text(),
        output_token_ids=list(ids), text=detok.text, num_prompt_tokens=len(request.prompt_token_ids),
        finished=finished, finish_reason=status.value if finished else None, new_logprobs=new_logprobs,
        queue_seconds=None if scheduled_time is None else scheduled_time - request.arrival_time,
        num_cached_tokens=request.num_cached_tokens, stop_reason=request.stop_reason if finished else None,
        prompt_logprobs=prompt_logprobs, error=request.error)
