"""Incremental detokenization and stop strings for one request's output stream."""

from __future__ import annotations

from orca_jax.engine.stop_strings import StopStringAutomaton
from orca_jax.tokenizer import StreamDecoder


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; finds stop strings in the new text.

    Each new token is decoded once, from its bytes (StreamDecoder), and each new character is read
    once by the stop strings' automaton, so the cost per iteration grows neither with the output's
    length nor with the number of stop strings. `stop`: the strings, or their automaton built once
    for every request that shares them (the engine's intake does).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] | StopStringAutomaton = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True):
        self._stream = StreamDecoder(tokenizer, skip_special_tokens)
        self._automaton = StopStringAutomaton(stop) if isinstance(stop, tuple) and stop else stop or None
        self._state = 0  # the automaton's, after all of text
        self.include_stop_str = include_stop_str
        self.text = ""  # all decoded text so far (cut at a stop string once one is seen)
        self.stop_string: str | None = None  # the stop string that was found, once one is
        self.num_emitted_chars = 0
        self._new_text = ""  # emitted but not yet taken by take_new_text()
        self._num_decoded_tokens = 0

    def add(self, token_ids: list[int], find_stop: bool = True) -> bool:
        """Account for token_ids (the whole output so far); True when a stop string was found (one
        that ends in this call's text and only with find_stop: min_tokens defers them, as vLLM)."""
        done, count = self._num_decoded_tokens, len(token_ids)
        # Nearly always one new token (every decoding request, every iteration): no slice, no join.
        new = self._stream.push(token_ids[done]) if count == done + 1 else \
            "".join(self._stream.push(t) for t in token_ids[done:])
        self._num_decoded_tokens = count
        if self._automaton is None:  # no stop strings (most requests): nothing is held back, new is the delta
            if new:
                self.text += new
                self._new_text += new
                self.num_emitted_chars = len(self.text)
            return False
        stopped = self._append(new, find_stop)
        self._new_text += self._emit(final=stopped)
        return stopped

    def flush(self) -> None:
        """Release everything held back (call once the request has finished)."""
        leftover = self._stream.flush()
        if self.stop_string is None:  # else what is pending came after the cut: not part of the text
            self._append(leftover, find_stop=True)
        self._new_text += self._emit(final=True)

    def take_new_text(self) -> str:
        """The text emitted since the last call."""
        text, self._new_text = self._new_text, ""
        return text

    def _append(self, new: str, find_stop: bool) -> bool:
        """text += new; True (and text cut there) when a stop string ends in new and find_stop."""
        start = len(self.text)
        self.text += new
        if self._automaton is None or not new:
            return False
        self._state, hit = self._automaton.scan(self._state, new)
        if hit is None or not find_stop:
            return False
        index, length = start + hit[0], hit[1]
        self.stop_string = self.text[index:index + length]
        self.text = self.text[:index + (length if self.include_stop_str else 0)]
        return True

    def _emit(self, final: bool) -> str:
        # Held back: what could still begin a stop string (the automaton knows how much).
        hold_back = 0 if final or self._automaton is None else self._automaton.partial_length(self._state)
        end = max(self.num_emitted_chars, len(self.text) - hold_back)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta
