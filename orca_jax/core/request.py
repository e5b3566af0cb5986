"""Host-side request state and the user-facing SamplingParams (no jax)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from orca_jax.engine.detokenizer import IncrementalDetokenizer
    from orca_jax.outputs import PromptLogprobs
    from orca_jax.sample.rules import LogitsRules
    from orca_jax.structured.constraint import Constraint
    from orca_jax.structured.matcher import GrammarMatcher

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; validated on construction (vLLM's names and ranges).

    The logits of a row go through, in vLLM's order: allowed_token_ids, bad_words, min_tokens (stop
    tokens banned while fewer outputs), logit_bias, then the repetition, frequency and presence
    penalties; greedy rows take the argmax there; sampled rows then divide by the temperature and keep
    the tokens min_p, top_k and top_p allow. Logprobs are of the model's raw logits (vLLM's default).
    """

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1, vLLM's spelling) disables
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one; 0 disables
    seed: int | None = None  # None: drawn from the engine's seed and the request id
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: also the top N (EngineConfig caps N)
    # None: none; k: at every prompt position after the first, the prompt token's logprob and rank and
    # the k most likely tokens' (SamplingConfig.max_logprobs caps k; needs enable_prompt_logprobs).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Subtracted from a token's logit once if it was generated (presence), per time generated (frequency).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Logits of tokens in the prompt or the output: positive ones divided by it, negative ones multiplied.
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop_token_ids are banned (and stop strings ignored) until this many outputs
    # token id -> added to its logit (a mapping is stored as sorted (id, bias) pairs, so the object
    # stays hashable); None: nothing.
    logit_bias: tuple[tuple[int, float], ...] | None = None
    bad_words: tuple[str, ...] = ()  # never generated: each word's last token is banned after its other tokens
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated; None: any
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # With skip_special_tokens off: a space between a special token and its neighbours' text. Byte-level
    # vocabularies (every tokenizer here) decode a special token to its own text without spaces either
    # way, as vLLM's fast detokenizer does.
    spaces_between_special_tokens: bool = True
    # What the output must match (a JSON schema, a regex, a choice, a grammar; vLLM's name); every
    # token is sampled from those the grammar allows next. None: anything.
    structured_outputs: Constraint | None = None

    MAX_TOP_LOGPROBS = 20  # the default cap on logprobs (SamplingConfig.max_logprobs, vLLM's --max-logprobs)

    def __post_init__(self):
        # Lists given by callers become tuples so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _token_ids(self.allowed_token_ids, "allowed_token_ids"))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = (
            ("max_tokens", _is_int(self.max_tokens) and 1 <= self.max_tokens < 2**31, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0.0, ">= 0"),
            ("top_k", _is_int(self.top_k) and 0 <= self.top_k < 2**31, "an int in [0, 2**31) (0 or -1 disables)"),
            ("top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**32),
             "an int in [0, 2**32)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
             "an int >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None
             or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0), "an int >= 0"),
            ("presence_penalty", _is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "in [-2, 2]"),
            ("repetition_penalty", _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf,
             "a finite number > 0"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"an int in [0, max_tokens={self.max_tokens}]"),
            ("bad_words", all(isinstance(w, str) and w.strip() for w in self.bad_words), "non-blank strings"),
            ("allowed_token_ids", self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "a non-empty list (or None)"),
        )
        for field, ok, must in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{field} must be {must}, got {getattr(self, field)!r}")
        if self.structured_outputs is not None:
            from orca_jax.structured.constraint import Constraint  # llguidance only for those who use it

            if not isinstance(self.structured_outputs, Constraint):
                raise ValueError("SamplingParams.structured_outputs must be a Constraint, got "
                                 f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether the row needs its token counts (a penalty slot on device)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything beyond temperature, top-k, top-p and min-p changes the logits."""
        return self.uses_penalties or bool(self.logit_bias) or bool(self.bad_words) or self.min_tokens > 0 \
            or self.allowed_token_ids is not None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_ids(ids, field: str) -> tuple[int, ...]:
    ids = tuple(ids)
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"SamplingParams.{field} must be token ids (ints >= 0), got {ids!r}")
    return ids


def _logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """{id: bias} (ids may be strings, as JSON keys are) or (id, bias) pairs -> sorted pairs."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    pairs = {}
    for token, value in items:
        try:
            token = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids, got {token!r}") from None
        if token < 0 or not _is_number(value):
            raise ValueError(f"SamplingParams.logit_bias must map token ids >= 0 to finite numbers, "
                             f"got {token!r}: {value!r}")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the pool, no KV held: never scheduled, or preempted
    RUNNING = "running"  # KV reserved; initiation or increment phase
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens reached
    FINISHED_ABORTED = "abort"  # client gone, shutdown, or error
    FINISHED_DEADLINE = "deadline"  # dropped: its deadline passed before it started (TCB)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


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
    detokenizer: IncrementalDetokenizer | None = None
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
    sampling = request.sampling
    token = ids[-1]
    hit_stop_token = len(ids) >= sampling.min_tokens and (
        token in sampling.stop_token_ids or (not sampling.ignore_eos and token in request.eos_token_ids))
    hit_stop_string = False
    if request.detokenizer is not None:
        hit_stop_string = request.detokenizer.add(ids[:-1] if hit_stop_token else ids,
                                                  find_stop=len(ids) > sampling.min_tokens)
    grammar_complete = False
    if request.grammar is not None and not hit_stop_token:
        if not request.grammar.accept(token):  # the mask allowed it, so this is a bug: end loudly
            log.error("request %s: output token %d is not allowed by its %s; aborted", request.request_id,
                      token, request.grammar.constraint.kind.value)
            return RequestStatus.FINISHED_ABORTED
        grammar_complete = request.grammar.is_terminated()
    if hit_stop_token:
        # EOS comes first, as in vLLM: a stop token is named only when it is not the model's own EOS.
        if sampling.ignore_eos or token not in request.eos_token_ids:
            request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if grammar_complete:
        return RequestStatus.FINISHED_STOPPED
    if len(ids) >= sampling.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if hit_stop_string:
        request.stop_reason = request.detokenizer.stop_string
        return RequestStatus.FINISHED_STOPPED
    return None
