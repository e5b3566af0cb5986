"""Tokenizers: a real one built from a GGUF file or a Hugging Face directory, and a byte tokenizer.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust BPE) and renders the model's own chat template
with a sandboxed jinja2 environment configured as transformers configures it, so prompts are
byte-for-byte what `apply_chat_template` gives. `ByteTokenizer` serves the random-weight presets,
which have no vocabulary: ids 0..255 are bytes.

Both expose `token_bytes(id)`, so a stream can be detokenized without cutting UTF-8 sequences
(`StreamDecoder`).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from typing import Protocol, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from orca_jax.chat_template import content_spans, overlaps, render_chat_template

# llama.cpp's tokenizer.ggml.token_type values.
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) whose split puts every digit on its own before
# the GPT-2 regex; SmolLM2's original tokenizer.json does the same with a `Digits` pre-tokenizer.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone",
                              "minerva"})
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2"})
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"})

_BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


class TokenizerError(ValueError):
    """A tokenizer description is missing or unusable; the message names the file."""


class ControlTokenError(ValueError):
    """Message content holds a control token that cannot be kept apart from the template's own."""


class TooManyTokensError(ValueError):
    """A text encodes to more than the `max_tokens` its caller can use; its ids were never built
    (1.98 M of them took ~0.3 s of the GIL in one call, stalling every other thread)."""

    def __init__(self, num_tokens: int, max_tokens: int):
        super().__init__(f"the text is {num_tokens} tokens, more than {max_tokens}")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens

    def __reduce__(self):  # from a tokenizer process (server/tokenizer_process.py), with its fields
        return TooManyTokensError, (self.num_tokens, self.max_tokens)


def _ids(encoding: tokenizers.Encoding, max_tokens: int | None) -> list[int]:
    """The encoding's ids; TooManyTokensError, without building them, past max_tokens."""
    if max_tokens is not None and len(encoding) > max_tokens:
        raise TooManyTokensError(len(encoding), max_tokens)
    return encoding.ids


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies use it)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


@functools.lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in byte_to_unicode().items()}


class BaseTokenizer(Protocol):
    """What the engine and server rely on; both tokenizers below satisfy it."""

    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False,
               split_special_tokens: bool = False, *, max_tokens: int | None = None) -> list[int]: ...
    def encode_prompt(self, text: str, split_special_tokens: bool = False, *,
                      max_tokens: int | None = None) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None) -> str: ...
    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    split_special_tokens: bool = True, tools: list[dict] | None = None,
                    max_tokens: int | None = None) -> list[int]: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...


class Tokenizer:
    """A real vocabulary: BPE via the `tokenizers` library plus the model's chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None,
                 bos_token_id: int | None, eos_token_ids: tuple[int, ...], source: str = "?"):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # token id -> its bytes, filled as tokens are first decoded: the stream decoder asks once per
        # output token of every request (2 us uncached, ~0.1 cached); at most one entry per vocabulary id.
        self._bytes_of: dict[int, bytes] = {}

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str, reader=None) -> "Tokenizer":
        """From a GGUF file's tokenizer.ggml.* metadata (byte-level BPE, llama.cpp's `gpt2` model).

        Pass an open `gguf.GGUFReader` of `path` to skip parsing the file a second time.
        """
        if reader is None:
            from gguf import GGUFReader  # local: only GGUF users pay for the import

            reader = GGUFReader(path)

        def field(name, default=None):
            f = reader.fields.get(name)
            return default if f is None else f.contents()

        model_type = field("tokenizer.ggml.model")
        if model_type != "gpt2":
            raise TokenizerError(f"{path}: tokenizer.ggml.model is {model_type!r}; only byte-level BPE "
                                 "('gpt2') GGUF tokenizers are supported")
        tokens = field("tokenizer.ggml.tokens")
        merges = field("tokenizer.ggml.merges")
        if not tokens or not merges:
            raise TokenizerError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        token_types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _byte_level_bpe(tokens, merges, token_types, field("tokenizer.ggml.pre", "default"),
                                  path)
        eos = [field(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return cls(backend, chat_template=field("tokenizer.chat_template"),
                   bos_token_id=field("tokenizer.ggml.bos_token_id"),
                   eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)), source=path)

    @classmethod
    def from_hf_dir(cls, directory: str, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """From a Hugging Face directory: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
        tokenizer_file = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise TokenizerError(f"{tokenizer_file}: no such file")
        try:
            backend = tokenizers.Tokenizer.from_file(tokenizer_file)
        except Exception as err:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{tokenizer_file}: not a valid tokenizers file ({err})") from err
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        template = config.get("chat_template")
        if isinstance(template, list):  # older files: a list of named templates
            template = {t["name"]: t["template"] for t in template}.get("default")
        template_file = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(template_file):
            with open(template_file, encoding="utf-8") as f:
                template = f.read()

        def token_id(key):
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return None if token is None else backend.token_to_id(token)

        # The model config's eos ids first (Llama 3 lists several), then the tokenizer's own.
        eos = tuple(dict.fromkeys(t for t in (*eos_token_ids, token_id("eos_token")) if t is not None))
        return cls(backend, chat_template=template, bos_token_id=token_id("bos_token"),
                   eos_token_ids=eos, source=tokenizer_file)

    def save_hf(self, directory: str) -> None:
        """Write tokenizer.json and tokenizer_config.json that from_hf_dir reads back."""
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        config = {"chat_template": self.chat_template,
                  "bos_token": self._token_text(self.bos_token_id) or None,
                  "eos_token": self._token_text(self.eos_token_ids[0]) if self.eos_token_ids else None}
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)

    # --- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False,
               split_special_tokens: bool = False, *, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text` (TooManyTokensError past `max_tokens`).

        Special tokens written in the text are recognised unless `split_special_tokens`, which
        encodes them as the plain text they are (transformers' flag of the same name).
        """
        backend = self._plain_backend if split_special_tokens else self.backend
        return _ids(backend.encode(text, add_special_tokens=add_special_tokens), max_tokens)

    def encode_prompt(self, text: str, split_special_tokens: bool = False, *,
                      max_tokens: int | None = None) -> list[int]:
        """A completion prompt's ids, as transformers' `tokenizer(text)` gives them: with the prefix
        the directory's tokenizer.json adds (Llama's and Mistral's BOS; nothing for GPT-2 or Qwen2).
        Chat prompts get theirs from the template instead (encode_chat)."""
        return self.encode(text, add_special_tokens=True, split_special_tokens=split_special_tokens,
                           max_tokens=max_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    split_special_tokens: bool = True, tools: list[dict] | None = None,
                    max_tokens: int | None = None) -> list[int]:
        """Token ids of the chat prompt; control tokens typed in message content stay plain text.

        Only the template's own control tokens become control tokens, so no message can forge a
        turn. With `split_special_tokens=False` the rendered prompt is encoded as a whole (trusted
        callers). ControlTokenError when the template rewrites content so that it cannot be found
        in the prompt and some content holds a control token; TooManyTokensError past `max_tokens`
        (control tokens typed as text only add tokens, so the whole prompt's count is checked first).
        """
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools=tools)
        encoding = self.backend.encode(prompt, add_special_tokens=False)
        whole = _ids(encoding, max_tokens)  # raises before anything is built from a long one
        if not split_special_tokens:
            return whole
        spans = content_spans(
            lambda marked: self.apply_chat_template(marked, add_generation_prompt, tools=tools), messages, prompt)
        if spans is None:
            typed = next((token for m in messages for token in self._special_texts
                          if token in (m.get("content") or "")), None)
            if typed is not None:
                raise ControlTokenError(
                    f"message content contains the control token {typed!r}, and this model's chat "
                    "template changes message content, so it cannot be kept apart from the template's "
                    "own control tokens; remove it from the content")
            return whole
        specials = [(token_id, start, end) for token_id, (start, end) in zip(whole, encoding.offsets)
                    if token_id in self._special_ids]
        if not any(overlaps(start, end, spans) for _, start, end in specials):
            return whole
        # Added tokens cut the text before BPE runs, so the pieces between the template's own control
        # tokens encode independently; in them, typed control tokens are plain text.
        ids: list[int] = []
        cursor = 0
        for token_id, start, end in specials:
            if not overlaps(start, end, spans):
                ids += self._plain_backend.encode(prompt[cursor:start], add_special_tokens=False).ids
                ids.append(token_id)
                cursor = end
        return ids + self._plain_backend.encode(prompt[cursor:], add_special_tokens=False).ids

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special tokens as text (built once, on first use)."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        return tuple(added.content for added in self.backend.get_added_tokens_decoder().values()
                     if added.special)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for a conversation (and the tools it may call), from the model's own template."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, tools=tools,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None))

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a piece of a UTF-8 character, possibly)."""
        data = self._bytes_of.get(token_id)
        if data is None:
            data = self._bytes_of[token_id] = self._token_bytes(token_id)
        return data

    def _token_bytes(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._special_ids or not self._byte_level:
            return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        table = unicode_to_byte()
        if all(char in table for char in token):
            return bytes(table[char] for char in token)
        return token.encode("utf-8")

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes; for random-weight presets, which have no real vocabulary."""

    vocab_size = 256

    def __init__(self, eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None):
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = _BYTE_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = False,
               split_special_tokens: bool = False, *, max_tokens: int | None = None) -> list[int]:
        # No text spells a special token here: every byte is its own id.
        prefix = [self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []
        data = text.encode("utf-8")
        if max_tokens is not None and len(prefix) + len(data) > max_tokens:
            raise TooManyTokensError(len(prefix) + len(data), max_tokens)
        return prefix + list(data)

    def encode_prompt(self, text: str, split_special_tokens: bool = False, *,
                      max_tokens: int | None = None) -> list[int]:
        """The bytes alone: byte-level vocabularies, like GPT-2's, put nothing before a prompt."""
        return self.encode(text, max_tokens=max_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    split_special_tokens: bool = True, tools: list[dict] | None = None,
                    max_tokens: int | None = None) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools=tools),
                           max_tokens=max_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        kept = [i for i in ids if not (skip_special_tokens and self.is_special(i))]
        return b"".join(self.token_bytes(i) for i in kept).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt, tools=tools)

    def id_to_token(self, token_id: int) -> str | None:
        return byte_to_unicode().get(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.eos_token_ids or token_id == self.bos_token_id

    def token_bytes(self, token_id: int) -> bytes:
        # A random model's vocabulary is larger than 256: show those ids as U+FFFD, not silence.
        return bytes([token_id]) if 0 <= token_id < 256 else "\ufffd".encode("utf-8")


def with_chat_template(tokenizer: BaseTokenizer, template: str) -> BaseTokenizer:
    """A copy of `tokenizer` that renders chats with `template` instead (serve's --chat-template)."""
    clone = copy.copy(tokenizer)
    clone.chat_template = template
    return clone


class StreamDecoder:
    """Incremental detokenization: feed ids one at a time, get back only complete UTF-8 text."""

    def __init__(self, tokenizer: BaseTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pending = b""  # bytes of an unfinished UTF-8 character
        # Bound once: push runs per output token of every request.
        self._is_special = tokenizer.is_special if skip_special_tokens else None
        self._token_bytes = tokenizer.token_bytes

    def push(self, token_id: int) -> str:
        if self._is_special is not None and self._is_special(token_id):
            return ""
        data = self._token_bytes(token_id)
        if not self._pending:  # the common case, once per token of every request: whole characters
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                pass
        pending = self._pending + data
        try:
            text, self._pending = pending.decode("utf-8"), b""
            return text
        except UnicodeDecodeError as error:
            # Everything before the first bad byte decodes and nothing longer does: emit that when
            # at most the last 3 bytes (a UTF-8 character's unfinished head) wait, else give up on them.
            valid = error.start
        if valid >= len(pending) - 3:
            self._pending = pending[valid:]
            return pending[:valid].decode("utf-8")
        self._pending = b""
        return pending.decode("utf-8", errors="replace")

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return text


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], pre: str,
                    path: str) -> tokenizers.Tokenizer:
    """A byte-level BPE with the split rule `pre` names, and the file's control tokens kept whole."""
    alphabet = unicode_to_byte()
    to_unicode = byte_to_unicode()
    # Tokens are stored in the byte alphabet; respell any that is not (as transformers does).
    vocab = {(token if all(c in alphabet for c in token)
              else "".join(to_unicode[b] for b in token.encode("utf-8"))): index
             for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ")) for merge in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                              byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _GPT2_PRE:
        backend.pre_tokenizer = byte_level
    else:
        raise TokenizerError(f"{path}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}")
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                for tok, kind in zip(tokens, token_types) if kind == _GGUF_TOKEN_CONTROL])
    backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                        for tok, kind in zip(tokens, token_types) if kind == _GGUF_TOKEN_USER_DEFINED])
    return backend


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path}: cannot read JSON ({err})") from err
