"""SamplingParams: how a request picks its tokens and when it stops (vLLM's names and ranges; no jax)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from orca_jax.structured.constraint import Constraint


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
