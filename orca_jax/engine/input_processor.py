"""Request intake: a prompt and its SamplingParams checked and turned into a Request (its token ids,
seed, logits rules and detokenizer) before the scheduler sees it.

It needs the tokenizer and the configs only, not the runner or the scheduler, so it can run wherever
requests arrive. Every refusal is a ValueError naming the SamplingParams field (or the prompt).
"""

from __future__ import annotations

import functools
import itertools
import time
import zlib

from orca_jax.config import EngineConfig, ModelConfig
from orca_jax.core.request import Request
from orca_jax.engine.detokenizer import IncrementalDetokenizer
from orca_jax.engine.stop_strings import StopStringAutomaton
from orca_jax.lora.request import LoRARequest
from orca_jax.sample.rules import LogitsRules
from orca_jax.sampling_params import SamplingParams

# Stop-string automata kept for reuse: the n choices of one request (and a client's repeated list)
# build theirs once.
NUM_REMEMBERED_STOP_LISTS = 16


class InputProcessor:
    """Checks what a request asks for against an engine's configs and builds its Request."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer, logits_width: int):
        self.config = config
        self.model_config = model_config  # the model's own vocabulary (prompt ids, logit_bias ids)
        self.tokenizer = tokenizer
        self.logits_width = logits_width  # V of the logits: the vocabulary padded for tensor parallelism
        self._ids = itertools.count()  # request ids for those given none (numbered once accepted here)
        self._stop_automaton = functools.lru_cache(NUM_REMEMBERED_STOP_LISTS)(StopStringAutomaton)

    def process(self, prompt: str | list[int], sampling: SamplingParams, request_id: str | None = None, *,
                priority: int = 0, deadline: float | None = None, arrival_time: float | None = None,
                lora_request: LoRARequest | None = None) -> Request:
        """The Request for a prompt (text, or token ids); ValueError for what the engine cannot honour.
        arrival_time None: now (time.monotonic)."""
        self.config.sampling.check_stop(sampling.stop)  # before anything costs in proportion to it
        token_ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        rules = self.logits_rules(sampling)
        self.check_prompt_logprobs(sampling, lora_request)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if lora_request is not None and self.config.lora is None:
            raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r}, "
                             "but LoRA is not enabled (EngineConfig.lora, --enable-lora)")
        return Request(request_id=request_id, prompt_token_ids=token_ids, sampling=sampling,
                       arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                       priority=priority, deadline=deadline,
                       eos_token_ids=tuple(self.tokenizer.eos_token_ids), seed=self.seed(sampling, request_id),
                       detokenizer=IncrementalDetokenizer(self.tokenizer,
                                                          self._stop_automaton(sampling.stop) if sampling.stop else (),
                                                          sampling.include_stop_str_in_output,
                                                          sampling.skip_special_tokens),
                       logits_rules=rules)

    def seed(self, sampling: SamplingParams, request_id: str) -> int:
        """SamplingParams.seed, or one fixed per request, so a rerun of the engine repeats itself."""
        return sampling.seed if sampling.seed is not None else zlib.crc32(f"{self.config.seed}:{request_id}".encode())

    def logits_rules(self, sampling: SamplingParams) -> LogitsRules | None:
        """The request's logits processing in token ids; ValueError (naming the SamplingParams field)
        for what this engine cannot honour."""
        max_logprobs = self.config.sampling.max_logprobs
        if sampling.logprobs is not None and sampling.logprobs > max_logprobs:
            raise ValueError(f"SamplingParams.logprobs must be between 0 and {max_logprobs} "
                             f"(SamplingConfig.max_logprobs), got {sampling.logprobs}")
        return LogitsRules.resolve(sampling, self.tokenizer, self.tokenizer.eos_token_ids,
                                   self.model_config.vocab_size, self.logits_width,
                                   self.config.sampling.logit_table_width)

    def check_prompt_logprobs(self, sampling: SamplingParams, lora_request: LoRARequest | None) -> None:
        """ValueError (naming the SamplingParams field) if this engine cannot compute the prompt logprobs asked for."""
        if sampling.prompt_logprobs is None:
            return
        if not self.config.sampling.enable_prompt_logprobs:
            raise ValueError("SamplingParams.prompt_logprobs needs an engine started with prompt logprobs enabled "
                             "(SamplingConfig.enable_prompt_logprobs, LLM(enable_prompt_logprobs=True), "
                             "--enable-prompt-logprobs)")
        max_logprobs = self.config.sampling.max_logprobs
        if sampling.prompt_logprobs > max_logprobs:
            raise ValueError(f"SamplingParams.prompt_logprobs must be between 0 and {max_logprobs} "
                             f"(SamplingConfig.max_logprobs), got {sampling.prompt_logprobs}")
        if lora_request is not None:
            raise ValueError("SamplingParams.prompt_logprobs are not supported with a LoRA adapter yet: they are "
                             "computed by the base model's forward without the adapter term")
