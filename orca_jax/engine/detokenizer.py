"""Incremental detokenization and stop strings for one request's output stream."""

from __future__ import annotations

from orca_jax.tokenizer import StreamDecoder


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; finds stop strings in the new text.

    Each new token is decoded once, from its bytes (StreamDecoder), so the cost per iteration does
    not grow with the output's length.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop_str: bool = False,
                 skip_special_tokens: bool = True):
        self._stream = StreamDecoder(tokenizer, skip_special_tokens)
        self.stop = stop
        self.include_stop_str = include_stop_str
        self.text = ""  # all decoded text so far (cut at a stop string once one is seen)
        self.stop_string: str | None = None  # the stop string that was found, once one is
        self.num_emitted_chars = 0
        self._new_text = ""  # emitted but not yet taken by take_new_text()
        self._num_decoded_tokens = 0
        # Hold back what could be the start of a stop string until it is known not to be one.
        self._hold_back = max((len(s) for s in stop), default=1) - 1

    def add(self, token_ids: list[int], find_stop: bool = True) -> bool:
        """Account for token_ids (the whole output so far); True when a stop string was found (looked
        for only with find_stop: min_tokens defers them)."""
        for token_id in token_ids[self._num_decoded_tokens:]:
            self.text += self._stream.push(token_id)
        self._num_decoded_tokens = len(token_ids)
        stopped = find_stop and self._cut_at_stop_string()
        self._new_text += self._emit(final=stopped)
        return stopped

    def flush(self) -> None:
        """Release everything held back (call once the request has finished)."""
        leftover = self._stream.flush()
        if self.stop_string is None:  # else what is pending came after the cut: not part of the text
            self.text += leftover
        self._cut_at_stop_string()
        self._new_text += self._emit(final=True)

    def take_new_text(self) -> str:
        """The text emitted since the last call."""
        text, self._new_text = self._new_text, ""
        return text

    def _cut_at_stop_string(self) -> bool:
        if not self.stop:
            return False
        # A stop string can only end inside the text not yet emitted (plus its own length before).
        search_from = max(0, self.num_emitted_chars - self._hold_back)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.stop_string = stop
        self.text = self.text[:index + (len(stop) if self.include_stop_str else 0)]
        return True

    def _emit(self, final: bool) -> str:
        end = len(self.text) if final else max(self.num_emitted_chars, len(self.text) - self._hold_back)
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta
