"""Fine-tuning datasets: JSONL checked line by line, tokenized with completion masks, packed into
micro-batches (numpy; no jax).

A line is a chat, {"messages": [{"role": "system" | "user" | "assistant", "content": str,
"weight": 0 | 1 (assistant only, optional)}, ...]}, rendered by the model's chat template (the tokens
of each assistant message with weight 1 are learned), or {"prompt": str, "completion": str} (the
completion's tokens and an end-of-sequence token are learned; the prompt is encoded as the completions
API encodes it). The first bad line fails the whole file with DatasetError naming it (the HTTP 400).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from orca_jax import json_limits

ROLES = ("system", "user", "assistant")
ROW_MULTIPLE = 64  # a packed row's length is the longest example rounded up to this
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


# Messages an example may have unless the server says otherwise (FineTuningConfig.max_example_messages):
# each assistant message costs two renders of the conversation up to it.
MAX_MESSAGES = 256
StopCheck = Callable[[], bool]
STOP_CHECK_LINES = 256  # a check as read asks should_stop this often (per line, it was 6% of the time)


class ValidationStopped(Exception):
    """Checking a dataset stopped because its job was cancelled or the server is shutting down."""


class DatasetError(ValueError):
    """A dataset that cannot be trained on; the message names the first bad line."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message if line is None else f"line {line}: {message}")
        self.line = line


@dataclasses.dataclass(frozen=True, slots=True)
class Example:
    """One training sequence: its tokens and which of them are learned (predicted from the ones before)."""

    token_ids: tuple[int, ...]
    learned: tuple[bool, ...]  # learned[i]: token i is a completion token the loss covers

    @property
    def num_learned(self) -> int:
        return sum(self.learned[1:])  # the first token has nothing before it to be predicted from


def _check_messages(messages, max_messages: int) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    if len(messages) > max_messages:
        raise ValueError(f"{len(messages)} messages, more than the {max_messages} an example may have on this "
                         "server (--fine-tuning-max-example-messages)")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        unknown = set(message) - {"role", "content", "weight", "name"}
        if unknown:
            raise ValueError(f"messages[{i}] has unknown field {sorted(unknown)[0]!r}")
        if "weight" in message and (role != "assistant" or message["weight"] not in (0, 1)):
            raise ValueError(f"messages[{i}].weight must be 0 or 1, on an assistant message")
    if not any(m["role"] == "assistant" and m.get("weight", 1) == 1 for m in messages):
        raise ValueError("no assistant message to learn (one with weight 1 is needed)")


_GROWING = ("the chat template does not render this conversation as a growing prefix, so the assistant's "
            "tokens cannot be told apart")


def _chat_example(messages: list[dict], tokenizer, max_len: int, should_stop: StopCheck) -> Example:
    """The whole conversation's tokens, learned where an assistant message (weight 1) is: each one's
    span is what rendering it adds to the conversation before it with the generation prompt.

    The conversation is tokenized once, and refused at once if longer than max_len. Each span's ends
    are found by rendering the two prefixes as text (no tokenizing) and mapping their lengths onto the
    tokens' bytes; only a tokenizer whose tokens do not spell the rendered text back (some normalize
    it) tokenizes each prefix, as the definition says. Renders are bounded by the number of messages."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = tokenizer.encode_chat(plain, add_generation_prompt=False)
    if len(full) > max_len:
        raise ValueError(f"{len(full)} tokens, more than the model's {max_len} (max_model_len)")
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=False).encode("utf-8")
    spelt = [tokenizer.token_bytes(t) for t in full]
    # Token index at each byte offset that falls between two tokens.
    boundaries = dict(zip(itertools.accumulate((len(b) for b in spelt), initial=0), range(len(full) + 1)))
    spells_text = b"".join(spelt) == text
    learned = [False] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight", 1) == 0:
            continue
        if should_stop():
            raise ValidationStopped()
        before = tokenizer.apply_chat_template(plain[:i], add_generation_prompt=True).encode("utf-8") if i else b""
        upto = tokenizer.apply_chat_template(plain[:i + 1], add_generation_prompt=False).encode("utf-8")
        if not (text.startswith(upto) and upto.startswith(before)) or len(upto) <= len(before):
            raise ValueError(_GROWING)
        if spells_text:
            start, end = boundaries.get(len(before)), boundaries.get(len(upto))
        else:
            start = len(tokenizer.encode_chat(plain[:i], add_generation_prompt=True)) if i else 0
            end = len(tokenizer.encode_chat(plain[:i + 1], add_generation_prompt=False))
        if start is None or end is None or end <= start:  # a token straddles where a message starts or ends
            raise ValueError(_GROWING)
        learned[start:end] = [True] * (end - start)
    return Example(tuple(full), tuple(learned))


def _completion_example(prompt: str, completion: str, tokenizer) -> Example:
    prompt_ids = tokenizer.encode_prompt(prompt)
    completion_ids = tokenizer.encode(completion) + list(tokenizer.eos_token_ids[:1])
    return Example(tuple(prompt_ids + completion_ids), (False,) * len(prompt_ids) + (True,) * len(completion_ids))


def _check_unicode(text: str, record: dict) -> None:
    """ValueError for a lone surrogate ("\\ud800", which JSON allows and no tokenizer takes) in any key
    or string of the record parsed from `text`, naming where (iterative; the record's depth is
    bounded anyway). Only a \\uD800-\\uDFFF escape in the text can make one: without, nothing to walk."""
    if not _SURROGATE_ESCAPE.search(text):
        return
    pending: list[tuple[object, str]] = [(record, "")]
    while pending:
        value, where = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                # A top-level field quoted, as "'prompt' must be a string" is; a nested one as messages[0].content.
                named = repr(where) if where.isidentifier() else where
                raise ValueError(f"{named} is not valid Unicode: a lone surrogate {value[err.start]!r} at "
                                 f"character {err.start}") from None
        elif isinstance(value, list):
            pending.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                pending.append((key, f"a key of {where}" if where else "a key"))
                pending.append((item, f"{where}.{key}" if where else str(key)))


def _record(text: str) -> dict:
    try:
        record = json_limits.loads(text, "JSON")
    except json_limits.JSONLimitError as err:  # "not valid JSON (...)", "JSON nests ...", "JSON: NaN is ..."
        raise ValueError(str(err).removeprefix("JSON is ")) from None
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    _check_unicode(text, record)
    return record


def parse_line(text: str, tokenizer, max_len: int, max_messages: int = MAX_MESSAGES,
               should_stop: StopCheck = lambda: False) -> Example:
    """One JSONL line -> an Example; ValueError saying what is wrong with it (ValidationStopped if
    should_stop() turned true meanwhile)."""
    return _example(_record(text), tokenizer, max_len, max_messages, should_stop)


def _example(record: dict, tokenizer, max_len: int, max_messages: int, should_stop: StopCheck) -> Example:
    if "messages" in record:
        _check_messages(record["messages"], max_messages)
        try:
            example = _chat_example(record["messages"], tokenizer, max_len, should_stop)
        except (ValueError, ValidationStopped):
            raise
        except Exception as err:  # the template's own raise_exception, or a rendering error
            raise ValueError(f"the chat template refused it: {err}") from None
    elif "prompt" in record or "completion" in record:
        prompt, completion = _prompt_and_completion(record)
        example = _completion_example(prompt, completion, tokenizer)
    else:
        raise ValueError("needs 'messages' (a chat) or 'prompt' and 'completion'")
    if len(example.token_ids) > max_len:
        raise ValueError(f"{len(example.token_ids)} tokens, more than the model's {max_len} (max_model_len)")
    if example.num_learned == 0:
        raise ValueError("no token to learn")
    return example


def _prompt_and_completion(record: dict) -> tuple[str, str]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
        raise ValueError("'prompt' must be a string and 'completion' a non-empty string")
    return prompt, completion


def read_jsonl(data: bytes | str, tokenizer, max_len: int, *, max_messages: int = MAX_MESSAGES,
               should_stop: StopCheck = lambda: False) -> list[Example]:
    """Every line of a JSONL file as an Example (blank lines skipped); DatasetError at the first bad one.

    Lines end at "\n" only: U+2028 and the other breaks str.splitlines knows may stand inside a JSON
    string. `should_stop` is asked before each line and each assistant message (ValidationStopped):
    a cancelled job or a server shutting down does not wait for a large file."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DatasetError(f"the file is not UTF-8 (byte {err.start})") from None
    examples = []
    for number, line in enumerate(data.split("\n"), 1):
        if should_stop():
            raise ValidationStopped()
        if not line.strip():
            continue
        try:
            examples.append(parse_line(line, tokenizer, max_len, max_messages, should_stop))
        except ValueError as err:
            raise DatasetError(str(err), number) from None
    if not examples:
        raise DatasetError("the file holds no examples")
    return examples


def check_jsonl(chunks: Iterable[bytes], tokenizer, max_len: int, *, max_messages: int = MAX_MESSAGES,
                should_stop: StopCheck = lambda: False, max_line_bytes: int = 16 << 20,
                one_token_per_byte: bool = False) -> int:
    """read_jsonl's checks on a file as it is read (an upload: `chunks` of its bytes), keeping nothing
    but the line at hand: memory is a chunk and a line, however large the file. Returns the number of
    examples; DatasetError at the first bad line (a line longer than `max_line_bytes` too, as soon as
    that many bytes came without a line break), ValidationStopped once should_stop() (asked every
    STOP_CHECK_LINES lines, ~5 ms of them, and per assistant message of a chat).

    `one_token_per_byte` (tokenizer_bounds.at_most_one_token_per_byte): a prompt-completion example of
    fewer UTF-8 bytes than max_len tokens provably fits and is not tokenized, so a file of short
    examples is checked at JSON speed (a 50 MB one in seconds rather than a minute)."""
    prefix = len(tokenizer.encode_prompt("")) if one_token_per_byte else 0
    count = 0
    for number, line in _lines(chunks, max_line_bytes):
        if number % STOP_CHECK_LINES == 0 and should_stop():
            raise ValidationStopped()
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DatasetError(f"not UTF-8 text (byte {err.start} of the line)", number) from None
        try:
            record = _record(text)
            if not (one_token_per_byte and _fits_untokenized(record, prefix, max_len, tokenizer)):
                _example(record, tokenizer, max_len, max_messages, should_stop)
        except ValueError as err:
            raise DatasetError(str(err), number) from None
        count += 1
    if not count:
        raise DatasetError("the file holds no examples")
    return count


def _lines(chunks: Iterable[bytes], max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, its bytes without the break) of a file given in chunks."""
    number, carry = 0, b""
    for chunk in chunks:
        pieces = (carry + chunk if carry else chunk).split(b"\n")
        carry = pieces.pop()
        for piece in pieces:
            number += 1
            if len(piece) > max_line_bytes:
                raise DatasetError(f"longer than {max_line_bytes} bytes, more than any example can take", number)
            yield number, piece
        if len(carry) > max_line_bytes:
            raise DatasetError(f"longer than {max_line_bytes} bytes, more than any example can take", number + 1)
    if carry:
        yield number + 1, carry


def _fits_untokenized(record: dict, prefix: int, max_len: int, tokenizer) -> bool:
    """Whether a prompt-completion record provably makes a valid Example without tokenizing it: its
    tokens (at most its bytes, the prompt's `prefix` and an EOS) fit, and one is learned."""
    if "messages" in record or not ("prompt" in record or "completion" in record):
        return False
    prompt, completion = _prompt_and_completion(record)  # ValueError for wrong types
    fits = prefix + len(prompt.encode("utf-8")) + len(completion.encode("utf-8")) + 1 <= max_len
    # A non-empty completion is at least one token; learned are all but the example's first token.
    return fits and bool(prompt or prefix or tokenizer.eos_token_ids)


def examples_from_records(records: Iterable[dict], tokenizer, max_len: int,
                          max_messages: int = MAX_MESSAGES) -> list[Example]:
    """read_jsonl for records already in memory (LLM.fine_tune's list of dicts); lines count from 1."""
    return read_jsonl("\n".join(json.dumps(record) for record in records), tokenizer, max_len,
                      max_messages=max_messages)


# ---- micro-batches -----------------------------------------------------------------------------------

def row_length(examples: Sequence[Example], max_len: int) -> int:
    """The packed rows' length: the longest example rounded up to ROW_MULTIPLE, at most max_len's."""
    longest = max(len(e.token_ids) for e in examples)
    return min(-(-longest // ROW_MULTIPLE) * ROW_MULTIPLE, max(longest, max_len))


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """Which examples each optimizer step takes (shuffled per epoch by the seed), packed into
    micro-batches of `rows` rows of `length` tokens. Deterministic: a resumed job repeats it."""

    examples: tuple[Example, ...]
    batch_size: int
    n_epochs: int
    seed: int
    length: int  # L: tokens per row
    rows: int  # B: rows per micro-batch

    @classmethod
    def make(cls, examples: Sequence[Example], batch_size: int, n_epochs: int, seed: int,
             micro_batch_tokens: int, max_len: int) -> "TrainingPlan":
        length = row_length(examples, max_len)
        return cls(tuple(examples), batch_size, n_epochs, seed, length, max(1, micro_batch_tokens // length))

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.examples) // self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.n_epochs

    def step_examples(self, step: int) -> list[Example]:
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
        return [self.examples[i] for i in order[index * self.batch_size:(index + 1) * self.batch_size]]

    def micro_batches(self, step: int) -> list[dict[str, np.ndarray]]:
        """Step `step`'s examples packed into rows (first fit, longest first) and cut into micro-batches
        of `rows` rows (the last one padded with empty rows): the TrainBatch fields as numpy arrays."""
        rows: list[list[Example]] = []
        room: list[int] = []
        for example in sorted(self.step_examples(step), key=lambda e: -len(e.token_ids)):
            n = len(example.token_ids)
            at = next((i for i, free in enumerate(room) if free >= n), None)
            if at is None:
                rows.append([])
                room.append(self.length)
                at = len(rows) - 1
            rows[at].append(example)
            room[at] -= n
        return [self._arrays(rows[i:i + self.rows]) for i in range(0, len(rows), self.rows)]

    def _arrays(self, rows: list[list[Example]]) -> dict[str, np.ndarray]:
        shape = (self.rows, self.length)
        out = {name: np.zeros(shape, np.int32) for name in ("token_ids", "positions", "segment_ids", "labels")}
        out["weights"] = np.zeros(shape, np.float32)
        for r, row in enumerate(rows):
            at = 0
            for s, example in enumerate(row, 1):
                ids, n = example.token_ids, len(example.token_ids)
                out["token_ids"][r, at:at + n] = ids
                out["positions"][r, at:at + n] = np.arange(n)
                out["segment_ids"][r, at:at + n] = s
                out["labels"][r, at:at + n - 1] = ids[1:]
                out["weights"][r, at:at + n - 1] = example.learned[1:]
                at += n
        return out


def count_tokens(examples: Sequence[Example]) -> int:
    """Tokens the forward runs over per epoch (OpenAI's trained_tokens counts these)."""
    return sum(len(e.token_ids) for e in examples)
