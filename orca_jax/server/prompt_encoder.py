"""Prompts to token ids for the OpenAI routes, bounded by the context before and while tokenizing.

Completions' texts, chats through the model's template (tools into a system message where the
template drops them), vLLM's /tokenize and /detokenize. A text longer than the context can hold in
any tokenization is refused by its length in characters (tokenizer_bounds.py) without being
tokenized; a large one that may fit is tokenized by a worker process (tokenizer_process.py); the
ids of a prompt past the context are never built. Every method here blocks: the serving layer runs
them on its front-end threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jinja2

from orca_jax.chat_template import renders_tools
from orca_jax.server.errors import APIError
from orca_jax.server.protocol import ChatMessage, TokenizeChatRequest, TokenizeCompletionRequest
from orca_jax.server.responses import DetokenizeResponse, TokenizeResponse
from orca_jax.server.structured import ToolCallSettings
from orca_jax.server.tokenizer_process import IN_PROCESS_CHARS, TokenizerProcess, TokenizerProcessDied
from orca_jax.structured.tool_prompt import with_calls_as_text, with_tools_in_system_message
from orca_jax.tokenizer import BaseTokenizer, TooManyTokensError
from orca_jax.tokenizer_bounds import max_prompt_chars

RETRY_AFTER_SECONDS = "1"


class PromptEncoder:
    """`tokenizer`'s encodings of requests' prompts for a context of `max_model_len` tokens.

    `split_special_tokens`: control tokens typed in text stay plain text (no caller can forge a
    turn); `tool_calls`: the parser's settings, whose format tools and earlier calls are written in
    when the template drops them."""

    def __init__(self, tokenizer: BaseTokenizer, max_model_len: int, vocab_size: int, *, split_special_tokens: bool,
                 tool_calls: ToolCallSettings):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.split_special_tokens = split_special_tokens
        self.tool_calls = tool_calls
        template = tokenizer.chat_template
        # A template that drops `tools` (SmolLM2's): they go into a system message in the parser's format.
        self.tools_in_system_message = template is not None and not renders_tools(template)
        # A prompt text longer than this cannot fit the context in any tokenization (None: no bound).
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)
        self.process = TokenizerProcess(tokenizer)
        # Built on first use, holding the GIL (1.5 s for SmolLM2's): now, not at the first request.
        tokenizer.encode("", split_special_tokens=True)

    def close(self) -> None:
        """Stop the tokenizer process (a later large prompt starts it again)."""
        self.process.close()

    def check_chars(self, num_chars: int, *, param: str) -> None:
        """400 for a prompt text too long for the context however it is tokenized (before tokenizing it)."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, and "
                           f"the prompt's {num_chars} characters cannot fit in it (no token of this tokenizer "
                           f"stands for more than {self.max_prompt_chars // self.max_model_len} characters). "
                           "Shorten the prompt.", param=param, code="context_length_exceeded")

    def check_token_ids(self, token_ids: list[int], *, param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                           param=param, code="token_id_out_of_range")

    def prompts(self, texts: list[str | list[int]]) -> list[list[int]]:
        """A completion's prompts (texts or ids) as ids."""
        with self._tokenizing("prompt"):
            return [self._encoder(len(p)).encode_prompt(p, split_special_tokens=self.split_special_tokens,
                                                        max_tokens=self.max_model_len)
                    if isinstance(p, str) else list(p) for p in texts]

    def chat(self, messages: list[ChatMessage], tools: list[dict] | None, add_generation_prompt: bool,
             may_call_tools: bool = True) -> list[int]:
        """The chat's prompt; `tools` go to the template, or into a system message when it drops them
        (nowhere when the request may not call them: tool_choice "none"), and then earlier calls and
        tool results are written as text in the parser's format."""
        template_messages = [m.template_message() for m in messages]
        if self.tools_in_system_message:  # such a template drops calls and tool turns' links too
            call_format = self.tool_calls.call_format
            template_messages = with_calls_as_text(template_messages, call_format)
            if tools and may_call_tools:
                template_messages = with_tools_in_system_message(template_messages, tools, call_format)
            tools = None
        try:
            content_chars = sum(len(m["content"]) for m in template_messages if isinstance(m.get("content"), str))
            if self.max_prompt_chars is not None and content_chars > self.max_prompt_chars:
                # Content alone past the bound (rare): what the template makes of it is measured exactly.
                prompt = self.tokenizer.apply_chat_template(template_messages, add_generation_prompt, tools=tools)
                self.check_chars(len(prompt), param="messages")
            with self._tokenizing("messages"):
                return self._encoder(content_chars).encode_chat(
                    template_messages, add_generation_prompt=add_generation_prompt,
                    split_special_tokens=self.split_special_tokens, tools=tools, max_tokens=self.max_model_len)
        except (ValueError, jinja2.TemplateError) as error:  # e.g. a template that checks role order
            raise APIError(400, f"cannot apply the chat template: {error}", param="messages") from None

    def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """vLLM's /tokenize; a prompt past the context is refused, as everywhere (its ids are not built)."""
        if isinstance(body, TokenizeChatRequest):
            tools = [tool.model_dump(by_alias=True, exclude_none=True) for tool in body.tools] if body.tools else None
            ids = self.chat(body.messages, tools, body.add_generation_prompt)
            if body.add_special_tokens:  # what the tokenizer puts before any prompt (a BOS), again, as vLLM does
                ids = self.tokenizer.encode_prompt("") + ids
        else:
            self.check_chars(len(body.prompt), param="prompt")
            encoder = self._encoder(len(body.prompt))
            encode = encoder.encode_prompt if body.add_special_tokens else encoder.encode
            with self._tokenizing("prompt"):
                ids = encode(body.prompt, split_special_tokens=self.split_special_tokens, max_tokens=self.max_model_len)
        strs = [self.tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        self.check_token_ids(tokens, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(tokens, skip_special_tokens=False))

    def _encoder(self, num_chars: int) -> BaseTokenizer | TokenizerProcess:
        """The tokenizer for a text of `num_chars` characters: this thread's, or the process's for a
        large one (the library holds the GIL while it encodes)."""
        return self.process if num_chars > IN_PROCESS_CHARS else self.tokenizer

    @contextlib.contextmanager
    def _tokenizing(self, param: str) -> Iterator[None]:
        """A prompt past the context (its ids never built) is a 400; a tokenizer process that died, a 503."""
        try:
            yield
        except TooManyTokensError as error:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens, and the "
                           f"prompt is {error.num_tokens} tokens. Shorten the prompt.", param=param,
                           code="context_length_exceeded") from None
        except TokenizerProcessDied as error:
            raise APIError(503, str(error), code="tokenizer_unavailable",
                           headers={"Retry-After": RETRY_AFTER_SECONDS}) from None
