"""RequestOutputs across the engine core's pipe as deltas: what each output adds to its request's totals.

A RequestOutput carries its request's whole output so far (`output_token_ids`, `text`) besides the
iteration's delta. Pickled as they are, an iteration of 256 requests 256 tokens into their outputs
costs the core 1.6 ms to send and the front end 2.2 ms to read (1,024 tokens in: 5.0 and 10.7 ms; a
2-core CPU, `benchmarks/results/cpu/notes.md`): every step resends everything. Here the core sends
each output as one flat tuple with only what is new to the front end, and the front end (which keeps
each request's totals) rebuilds the same RequestOutput.

The totals only grow until a request's last step, where a stop string may cut text that was held back
(and sent): so the ids go as (how many sent before stay, what follows), and a finished output's text
goes whole (once per request).
"""

from __future__ import annotations

import dataclasses

from orca_jax.outputs import OutputIdsPrefix, RequestOutput, output_ids_tail

# A row: (request_id, new_token_ids, new_text, ids_kept, ids_tail, text_kept, text_tail, *REST) with
# ids_tail None when it is new_token_ids (the usual case: one token, sent once), then REST's fields.
REST = ("num_prompt_tokens", "finished", "finish_reason", "new_logprobs", "queue_seconds", "num_cached_tokens",
        "stop_reason", "prompt_logprobs", "error")
Row = tuple


class OutputEncoder:
    """The core's side: what it has sent of each live request's totals."""

    def __init__(self):
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens, characters) sent

    def encode(self, output: RequestOutput) -> Row:
        request_id, text = output.request_id, output.text
        num_ids, num_chars = self._sent.get(request_id, (0, 0))
        num_total, ids_tail = output_ids_tail(output, num_ids)  # not the whole list: only what is new
        ids_kept = min(num_ids, num_total)
        if output.finished:  # its text may have been cut and then added to (the last step's flush): whole
            self._sent.pop(request_id, None)
            text_kept = 0
        else:  # before the last step text only grows
            self._sent[request_id] = (num_total, len(text))
            text_kept = min(num_chars, len(text))
        return (request_id, output.new_token_ids, output.new_text, ids_kept,
                None if ids_tail == output.new_token_ids else ids_tail, text_kept, text[text_kept:],
                output.num_prompt_tokens, output.finished, output.finish_reason, output.new_logprobs,
                output.queue_seconds, output.num_cached_tokens, output.stop_reason, output.prompt_logprobs,
                output.error)

    def encode_all(self, outputs: list[RequestOutput]) -> list[Row]:
        return [self.encode(output) for output in outputs]

    def forget(self, request_id: str) -> None:
        """The request is gone without a finished output (aborted): its totals start again if it is
        ever reported (the front end dropped its side at the abort)."""
        self._sent.pop(request_id, None)


@dataclasses.dataclass(slots=True)
class Received:
    """The front end's side for one request: its totals so far, from which each row rebuilds the
    RequestOutput the core made."""

    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""

    def decode(self, row: Row) -> RequestOutput:
        request_id, new_ids, new_text, ids_kept, ids_tail, text_kept, text_tail, *rest = row
        ids, text = self.ids, self.text
        if ids_kept != len(ids):  # a stop string cut the last step's tokens: a new list, so earlier outputs'
            self.ids = ids = ids[:ids_kept]  # prefixes of the old one stay as they were
        ids += new_ids if ids_tail is None else ids_tail
        self.text = text = (text if text_kept == len(text) else text[:text_kept]) + text_tail
        return RequestOutput(request_id, new_ids, new_text, OutputIdsPrefix(ids, len(ids)), text, *rest)


def request_id_of(row: Row) -> str:
    return row[0]
