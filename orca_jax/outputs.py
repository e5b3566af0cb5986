"""What the engine hands back to its callers after each iteration."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives when asked for."""

    token_id: int
    logprob: float
    top: dict[int, float] = dataclasses.field(default_factory=dict)  # token id -> logprob


@dataclasses.dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at one prompt position and its rank there (1: the most likely;
    vLLM's Logprob, without the decoded text, which the server adds)."""

    logprob: float
    rank: int


# vLLM's PromptLogprobs: per prompt position, None at the first (nothing precedes it), else the
# prompt token's and the top-k tokens' Logprob by token id (the prompt token first).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestError:
    """Why the engine ended a request itself (finish_reason "error")."""

    message: str
    # The request's own input led there (say, a grammar with no way on): a server answers 4xx, else 5xx.
    caused_by_request: bool = False


class OutputIdsPrefix:
    """The first `length` ids of a request's output list, which only grows: a RequestOutput's
    `output_token_ids` as the engine gives them, copied into a list only when first read. Copying
    the whole list for every request at every iteration costs O(output length) a step (2.5 us a
    request at 1,000 tokens), and most callers read only the iteration's new tokens."""

    __slots__ = ("ids", "length")

    def __init__(self, ids: list[int], length: int):
        self.ids = ids  # appended to, never changed below `length`, while anyone holds this
        self.length = length


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """The news of one request from one iteration: the delta, and the totals so far."""

    request_id: str
    new_token_ids: list[int]  # tokens produced this iteration (usually one)
    new_text: str  # detokenized delta; held back while a stop string may still be forming
    # All generated tokens so far (given as a list, or as an OutputIdsPrefix that becomes one on first read).
    output_token_ids: list[int]
    text: str  # all generated text so far
    num_prompt_tokens: int
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "deadline" or "error" once finished
    new_logprobs: list[TokenLogprob] | None = None  # when SamplingParams.logprobs is set
    queue_seconds: float | None = None  # arrival to first admission; None while never admitted
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    # vLLM's stop_reason once finished: the stop string or stop token id that ended the output;
    # None for EOS, max_tokens, a completed grammar or an abort.
    stop_reason: int | str | None = None
    # SamplingParams.prompt_logprobs' answer, on the request's first output only (None on the rest).
    prompt_logprobs: PromptLogprobs | None = None
    error: RequestError | None = None  # with finish_reason "error": why the engine ended the request


_IDS_SLOT = RequestOutput.__dict__["output_token_ids"]  # the dataclass's own slot, behind the property below


def _output_token_ids(output: RequestOutput) -> list[int]:
    value = _IDS_SLOT.__get__(output, RequestOutput)
    if type(value) is OutputIdsPrefix:  # first read: the list it stands for, kept
        value = value.ids[:value.length]
        _IDS_SLOT.__set__(output, value)
    return value


# Every read (attribute, ==, repr, pickling, dataclasses.replace) sees a list; the field stays a dataclass field.
RequestOutput.output_token_ids = property(_output_token_ids, _IDS_SLOT.__set__,
                                          doc="All generated tokens so far.")


def output_ids_tail(output: RequestOutput, start: int) -> tuple[int, list[int]]:
    """(len(output.output_token_ids), output.output_token_ids[start:]) without copying the rest."""
    value = _IDS_SLOT.__get__(output, RequestOutput)
    if type(value) is OutputIdsPrefix:
        return value.length, value.ids[start:value.length]
    return len(value), value[start:]
