"""What a request asks of its logits, in token ids (numpy, no jax).

A request's logit_bias, bad words, min_tokens and allowed_token_ids are resolved to token ids once,
when it is added (`LogitsRules.resolve`); each iteration the batcher (batcher.py) turns them into the
batch's logit table and allowed-token bitmask. allowed_token_ids go through the bitmask rather than
the logit table: a whitelist of any length then costs the same, and needs no table width.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from orca_jax.sampling_params import SamplingParams


def bad_word_token_ids(bad_words: Sequence[str], tokenizer) -> list[tuple[int, ...]]:
    """vLLM's tokenization of bad words: each word as it is (leading spaces stripped), and with one
    leading space where that gives a different first token and as many tokens (so the word is banned
    at the start of the text and in the middle of it)."""
    words: list[tuple[int, ...]] = []
    for word in bad_words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        words.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            words.append(spaced)
    return words


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LogitsRules:
    """A request's logits processing in token ids, resolved once when it is added."""

    bias_ids: np.ndarray  # i32[n]: logit_bias ids, then single-token bad words
    bias_values: np.ndarray  # f32[n]: their biases (-inf: banned)
    bad_word_sequences: tuple[tuple[int, ...], ...]  # bad words of 2+ tokens: last token banned after the rest
    stop_ids: np.ndarray  # i32[m]: banned while fewer than min_tokens outputs (stop tokens, then EOS)
    min_tokens: int
    uses_penalties: bool
    allowed_mask: np.ndarray | None  # i32[ceil(V / 32)]: bit j of word w allows token 32 w + j; None: any

    def applies_at(self, step: int) -> bool:
        """Whether the sample after `step` outputs needs logits processing (min_tokens alone stops
        needing it once that many are out)."""
        return self.uses_penalties or len(self.bias_ids) > 0 or bool(self.bad_word_sequences) \
            or self.allowed_mask is not None or step < self.min_tokens

    @property
    def num_entries(self) -> int:
        """The most logit-table entries this request uses in one iteration."""
        return len(self.bias_ids) + len(self.bad_word_sequences) + len(self.stop_ids)

    @classmethod
    def resolve(cls, sampling: SamplingParams, tokenizer, eos_token_ids: Sequence[int], vocab_size: int,
                logits_width: int, table_width: int) -> "LogitsRules | None":
        """The rules of `sampling` (None: it asks nothing of the logits); ValueError naming the field
        when a token id is outside the vocabulary or the request needs more than table_width entries."""
        if not sampling.processes_logits:
            return None

        def check(field: str, ids) -> None:
            bad = sorted({t for t in ids if not 0 <= t < vocab_size})
            if bad:
                raise ValueError(f"SamplingParams.{field} must be token ids in [0, {vocab_size}), got {bad[:8]}")

        bias = sampling.logit_bias or ()
        if len(bias) + len(sampling.bad_words) > table_width:  # each takes an entry: refused before tokenizing
            raise ValueError(f"SamplingParams.logit_bias and bad_words give {len(bias)} + {len(sampling.bad_words)} "
                             f"entries; the engine allows {table_width} (SamplingConfig.logit_table_width)")
        check("logit_bias", [t for t, _ in bias])
        words = bad_word_token_ids(sampling.bad_words, tokenizer)
        check("bad_words", [t for word in words for t in word])
        singles = [word[0] for word in words if len(word) == 1]
        stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *eos_token_ids))) if sampling.min_tokens else ()
        allowed = None
        if sampling.allowed_token_ids is not None:
            check("allowed_token_ids", sampling.allowed_token_ids)
            allowed = pack_token_mask(sampling.allowed_token_ids, logits_width)
        rules = cls(bias_ids=np.array([t for t, _ in bias] + singles, np.int32),
                    bias_values=np.array([b for _, b in bias] + [-math.inf] * len(singles), np.float32),
                    bad_word_sequences=tuple(word for word in words if len(word) > 1),
                    stop_ids=np.array(stops, np.int32), min_tokens=sampling.min_tokens,
                    uses_penalties=sampling.uses_penalties, allowed_mask=allowed)
        if rules.num_entries > table_width:
            raise ValueError(f"SamplingParams.logit_bias, bad_words and (with min_tokens) stop_token_ids "
                             f"need {rules.num_entries} logit-table entries; the engine allows "
                             f"{table_width} (SamplingConfig.logit_table_width)")
        return rules

    @property
    def has_entries(self) -> bool:
        """Whether any iteration can have logit-table entries (biases, bad words, min_tokens' bans)."""
        return len(self.bias_ids) > 0 or bool(self.bad_word_sequences) or self.min_tokens > 0

    def entries(self, outputs: Sequence[int], step: int, pending: bool) -> tuple[list[int], list[float], list[int]]:
        """(token ids, values, conditions) of this iteration's logit-table entries.

        `outputs`: the output tokens the host knows; `pending`: one more (the last, still on device)
        precedes this sample. A bad word whose match needs that token gets an entry conditional on it
        (the condition is the token it must be; -1: unconditional).
        """
        ids, values, conditions = self.bias_ids.tolist(), self.bias_values.tolist(), [-1] * len(self.bias_ids)
        for word in self.bad_word_sequences:
            prefix = word[:-1]
            known = prefix[:-1] if pending else prefix  # the part the host must match itself
            # The last token first: a word's tokens are compared only once its end matches.
            if len(outputs) < len(known) or (known and (outputs[-1] != known[-1]
                                                        or tuple(outputs[-len(known):]) != known)):
                continue
            ids.append(word[-1])
            values.append(-math.inf)
            conditions.append(prefix[-1] if pending else -1)
        if step < self.min_tokens:
            ids += self.stop_ids.tolist()
            values += [-math.inf] * len(self.stop_ids)
            conditions += [-1] * len(self.stop_ids)
        return ids, values, conditions


def pack_token_mask(token_ids: Sequence[int], logits_width: int) -> np.ndarray:
    """i32[ceil(logits_width / 32)]: bit j of word w set for token 32 w + j in token_ids."""
    bits = np.zeros(-(-logits_width // 32) * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(np.uint32).ravel().view(np.int32)
