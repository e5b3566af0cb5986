"""Host-side request state: a request as the scheduler and engine see it, and its one stop check (no jax)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from typing import TYPE_CHECKING, Protocol

from orca_jax.outputs import RequestError
from orca_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from orca_jax.outputs import PromptLogprobs
    from orca_jax.sample.rules import LogitsRules
    from orca_jax.structured.matcher import GrammarMatcher

log = logging.getLogger(__name__)


class Detokenizer(Protocol):
    """A request's output text and stop strings (the engine's IncrementalDetokenizer): fed by the stop
    check here, read by the engine when it builds outputs."""

    text: str  # all decoded text so far (cut at a stop string once one is seen)
    stop_string: str | None  # the stop string that was found, once one is

    def add(self, token_ids: list[int], find_stop: bool = True) -> bool:
        """Account for token_ids (the whole output so far); True when a stop string was found."""
        ...

    def flush(self) -> None:
        """Release everything held back (the request has finished)."""
        ...

    def take_new_text(self) -> str:
        """The text emitted since the last call."""
        ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the pool, no KV held: never scheduled, or preempted
    RUNNING = "running"  # KV reserved; initiation or increment phase
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens reached
    FINISHED_ABORTED = "abort"  # client gone or shutdown: nobody waits for an answer
    FINISHED_DEADLINE = "deadline"  # dropped: its deadline passed before it started (TCB)
    FINISHED_ERROR = "error"  # the engine could not go on with it (Request.error says why); answered

    @property
    def finished(self) -> bool:
        # Identity against module globals: read several times per request per iteration, and an enum
        # member looked up on its class costs more than the comparison.
        return self is not _WAITING and self is not _RUNNING


_WAITING, _RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler and engine see it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    priority: int = 0  # larger runs first under SchedulingPolicy.PRIORITY
    deadline: float | None = None  # monotonic seconds; dropped if still waiting after it (EDF, DAS)
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # the sampling seed, resolved once when the request is added (SamplingParams.seed or derived)
    # Text and stop strings of the output; None when nobody wants text (the scheduler's own tests).
    detokenizer: Detokenizer | None = None
    # What the request asks of the logits, in token ids (bad words tokenized, stop tokens for
    # min_tokens); None: nothing beyond temperature, top-k, top-p and min-p.
    logits_rules: LogitsRules | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    # SamplingParams.prompt_logprobs' answer, computed when the request was added; handed out with
    # its first RequestOutput, then None.
    prompt_logprobs: PromptLogprobs | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_iterations: int = 0  # iterations this request took part in
    first_token_time: float | None = None
    finish_time: float | None = None
    scheduled_time: float | None = None  # first admission: arrival to this is the queue time
    # Preemption frees a request's KV and sends it back to the pool; it then feeds its prompt and the
    # outputs it had (recompute_len tokens) as one long initiation, and samples on from where it was.
    num_preemptions: int = 0
    recompute_len: int = 0
    # The LoRA adapter it runs with (LoRARequest.lora_int_id; 0: the base model): part of what its
    # KV depends on, so prefix caching salts with it. lora_slot: the device slot holding that adapter
    # while the request holds KV (lora/slots.py sets it at admission; 0 otherwise).
    lora_int_id: int = 0
    lora_slot: int = 0
    # Prefix caching: a caller's salt (vLLM's cache_salt: requests of different salts never share
    # pages; the adapter is salted in too, see kv_salt). page_keys: the content key of each full page
    # of known tokens, computed once per page (prefix_index.extend_page_keys), with the page's tokens.
    cache_salt: str | None = None
    page_keys: list[int] = dataclasses.field(default_factory=list)
    page_tokens: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it (vLLM's)
    # SamplingParams.structured_outputs' matcher (the engine's StructuredOutputManager attaches it),
    # advanced by stop_status over every output token; None: unconstrained.
    grammar: GrammarMatcher | None = None
    error: RequestError | None = None  # why the engine ended it, with FINISHED_ERROR
    # SamplingParams.stop_token_ids as a set: stop_status looks each output token up in it, and a
    # request may list the whole vocabulary.
    stop_token_set: frozenset[int] = dataclasses.field(init=False)

    def __post_init__(self):
        self.stop_token_set = frozenset(self.sampling.stop_token_ids)

    @property
    def kv_salt(self) -> tuple[int, str | None]:
        """What besides the tokens decides its K/V: the adapter and the caller's salt."""
        return self.lora_int_id, self.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in the KV cache (its reservation)."""
        return len(self.prompt_token_ids) + self.sampling.max_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet fed to the model: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_initiation_tokens(self) -> int:
        """Tokens fed before the next sample: the prompt, or after a preemption, all it had then."""
        return max(self.num_prompt_tokens, self.recompute_len)

    @property
    def in_initiation(self) -> bool:
        """True while prompt tokens remain to be fed (ORCA's initiation phase)."""
        return self.num_computed_tokens < self.num_initiation_tokens

    @property
    def deadline_met(self) -> bool | None:
        """Whether a finished request with a deadline ended by it (None: no deadline or not finished)."""
        if self.deadline is None or self.finish_time is None:
            return None
        return self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) \
            and self.finish_time <= self.deadline

    def token_ids_at(self, start: int, count: int) -> list[int]:
        """The token ids at positions [start, start + count) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if start + count <= num_prompt:
            return self.prompt_token_ids[start:start + count]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:start - num_prompt + count]
        return (self.prompt_token_ids + self.output_token_ids)[start:start + count]


def stop_status(request: Request) -> RequestStatus | None:
    """The one stop check, run once per newly appended output token; the finished status, or None.

    EOS and stop tokens stop (the stop token's text is never emitted), then a grammar that is
    complete (its output can only end here), then max_tokens, then a stop string the detokenizer
    finds in the new text. The detokenizer and the grammar are fed here, so stop strings and
    grammars are decided in the same iteration as every other stop condition. Below min_tokens outputs nothing
    stops but max_tokens (as vLLM: stop tokens count from the min_tokens-th output on, a stop string
    only once it ends after it; the sampler bans EOS and stop tokens until then anyway).
    """
    ids = request.output_token_ids
    num_ids = len(ids)
    sampling = request.sampling
    min_tokens = sampling.min_tokens
    token = ids[-1]
    hit_stop_token = num_ids >= min_tokens and (
        token in request.stop_token_set or (not sampling.ignore_eos and token in request.eos_token_ids))
    hit_stop_string = False
    detokenizer = request.detokenizer
    if detokenizer is not None:
        hit_stop_string = detokenizer.add(ids[:-1] if hit_stop_token else ids, num_ids > min_tokens)
    grammar_complete = False
    if request.grammar is not None and not hit_stop_token:
        if not request.grammar.accept(token):
            # The mask allowed nothing the grammar takes: a grammar with no way on from here, or
            # one whose next step passed the grammar library's limits (its error says which).
            problem = request.grammar.error
            message = (f"output token {token} at position {len(ids) - 1} is not allowed by the request's "
                       f"{request.grammar.constraint.kind.value}" + (f" ({problem})" if problem else ""))
            request.error = RequestError(message, caused_by_request=True)
            log.warning("request %s: %s; ended", request.request_id, message)
            return RequestStatus.FINISHED_ERROR
        grammar_complete = request.grammar.is_terminated()
    if hit_stop_token:
        # EOS comes first, as in vLLM: a stop token is named only when it is not the model's own EOS.
        if sampling.ignore_eos or token not in request.eos_token_ids:
            request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if grammar_complete:
        return RequestStatus.FINISHED_STOPPED
    if num_ids >= sampling.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if hit_stop_string:
        request.stop_reason = request.detokenizer.stop_string
        return RequestStatus.FINISHED_STOPPED
    return None
