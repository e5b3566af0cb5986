"""The offline API: `LLM(model).generate(prompts, sampling_params)`, for scripts and notebooks."""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Iterator, Sequence

from orca_jax.config import (AttentionBackend, CacheConfig, EngineConfig, FineTuningConfig, KVAllocation, KVCacheDtype,
                             LoRAConfig, ParallelConfig, Quantization, SamplingConfig, SchedulerConfig,
                             SchedulingPolicy)
from orca_jax.engine import Engine, EngineStats
from orca_jax.engine.defaults import UsageContext, batch_defaults
from orca_jax.engine.replicas import EngineReplicas, replica_builds
from orca_jax.finetune.hparams import TrainingHyperparameters
from orca_jax.finetune.offline import run_fine_tune
from orca_jax.lora.request import LoRARequest
from orca_jax.models.loader import LoadedModel, load_model, read_model_config
from orca_jax.worker import xla_setup
from orca_jax.outputs import PromptLogprobs, RequestOutput, TokenLogprob
from orca_jax.progress import StartupBar, tqdm
from orca_jax.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    """One generated continuation (vLLM's name, so `out.outputs[0].text` reads the same)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass(slots=True)
class GenerationOutput:
    """A finished request: its prompt and its one completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (vLLM's name)
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs was set

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    """Load a model once, then generate for many prompts with iteration-level batching.

    Arguments follow vLLM's names: tensor_parallel_size splits every layer over that many devices
    (ORCA's intra-layer parallelism), pipeline_parallel_size splits the layer stack into stages;
    enable_lora serves peft adapters (generate's lora_request) from max_loras device slots of
    max_lora_rank, keeping up to max_cpu_loras more in host memory. enable_fine_tuning (LoRA implied)
    lets fine_tune train adapters on the served model, keeping its jobs under fine_tuning_dir.
    enable_prompt_logprobs lets SamplingParams.prompt_logprobs be asked for (up to max_logprobs, which
    also caps logprobs; None: SamplingConfig's default); each such request costs one more forward over
    its prompt (worker/prompt_logprobs.py).
    max_num_seqs and max_num_batched_tokens default to the device's and the model's (engine/defaults.py).
    precompile compiles every program a batch can need before the first generate (False: each on its
    first use, which a notebook exploring one prompt may prefer; generate then pauses to compile).
    data_parallel_size runs that many whole engines, each in a process of its own on its own
    tensor x pipeline devices (replica r gets slice r of CUDA_VISIBLE_DEVICES), a prompt going to the
    replica holding its prefix, else the least loaded (engine/replicas.py); generate, chat, stream and
    stats work as with one engine (the same outputs for the same seeds), while what needs the engine
    in this process (`engine`, fine-tuning, `loaded=`) is refused. shutdown() stops the replicas. The
    replicas are spawned processes, which import the caller's main module: a script builds its LLM under
    `if __name__ == "__main__":`.
    quantization="fp8" stores the projections in e4m3 (an untied LM head too; quantize_lm_head=False
    keeps the head in dtype, trading ~2x its read for accuracy).
    use_tqdm shows the start on a progress bar: loading, compiling (with an estimate of the time left:
    minutes on a small CPU), first runs.
    """

    def __init__(self, model: str = "smollm2-135m", *, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, page_size: int = 16, num_kv_pages: int | None = None,
                 kv_cache_memory_gib: float | None = None, max_model_len: int | None = None,
                 dtype: str | None = None, attention_backend: str = "auto",
                 scheduling_policy: str = "fcfs", kv_allocation: str = "reserve", tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, seed: int = 0, enable_prefix_caching: bool = True,
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, enable_fine_tuning: bool = False,
                 fine_tuning_dir: str | None = None, enable_prompt_logprobs: bool = False,
                 max_logprobs: int | None = None, precompile: bool = True, data_parallel_size: int = 1,
                 quantization: str | None = None, quantize_lm_head: bool = True, kv_cache_dtype: str = "auto",
                 engine_config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 use_tqdm: bool = True):
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
        if data_parallel_size > 1 and loaded is not None:
            raise ValueError(f"LLM(loaded=...) hands this process's weights to its engine; with data_parallel_size="
                             f"{data_parallel_size} each replica loads the model in its own process: pass its name or path")
        if data_parallel_size == 1:  # before anything starts jax (each replica's engine does it in its process)
            xla_setup.prepare(engine_config.parallel if engine_config is not None else
                              ParallelConfig(num_stages=pipeline_parallel_size, tensor_parallel=tensor_parallel_size))
        bar = StartupBar(engine_config.model if engine_config is not None else model,
                         enabled=use_tqdm and data_parallel_size == 1)
        try:  # the bar shows loading, then the engine's precompile
            if engine_config is None and (max_num_seqs is None or max_num_batched_tokens is None):
                # The defaults depend on the model's size; replicas load the weights in their own processes.
                if data_parallel_size == 1:
                    loaded = loaded or load_model(model, dtype=dtype)
                num_params = read_model_config(model).num_params if loaded is None else loaded.config.num_params
                defaults = batch_defaults(UsageContext.OFFLINE, num_params)  # engine/defaults.py
                max_num_seqs = max_num_seqs or defaults.max_num_seqs
                max_num_batched_tokens = max_num_batched_tokens or defaults.max_num_batched_tokens
            config = engine_config or EngineConfig(
                model=model,
                cache=CacheConfig(page_size=page_size, num_pages=num_kv_pages, kv_memory_gib=kv_cache_memory_gib,
                                  enable_prefix_caching=enable_prefix_caching),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          policy=SchedulingPolicy(scheduling_policy),
                                          kv_allocation=KVAllocation(kv_allocation)),
                parallel=ParallelConfig(num_stages=pipeline_parallel_size, tensor_parallel=tensor_parallel_size),
                attention=AttentionBackend(attention_backend), dtype=dtype, max_model_len=max_model_len,
                quantization=None if quantization is None else Quantization(quantization),
                quantize_lm_head=quantize_lm_head, kv_cache_dtype=KVCacheDtype(kv_cache_dtype), seed=seed, sampling=SamplingConfig(enable_prompt_logprobs=enable_prompt_logprobs,
                                                   **({} if max_logprobs is None else {"max_logprobs": max_logprobs})),
                lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora or enable_fine_tuning else None,
                fine_tuning=FineTuningConfig(directory=fine_tuning_dir) if enable_fine_tuning else None,
                precompile=precompile)
            self.data_parallel_size = data_parallel_size
            if data_parallel_size == 1:
                self._engine: Engine | EngineReplicas = Engine(config, loaded, precompile_progress=bar)
            else:
                self._engine = EngineReplicas(replica_builds(config, data_parallel_size))
                self._stop_replicas = weakref.finalize(self, self._engine.shutdown)  # once: here, at exit or when collected
        finally:
            bar.close()
        self.tokenizer = self._engine.tokenizer

    @property
    def engine(self) -> Engine:
        """The engine, in this process; ValueError with data_parallel_size > 1 (each replica's is in its own)."""
        if self.data_parallel_size > 1:
            raise ValueError(f"LLM.engine is the engine in this process; with data_parallel_size="
                             f"{self.data_parallel_size} each replica's engine runs in its own process")
        return self._engine

    def shutdown(self) -> None:
        """Stop the replicas' processes (data_parallel_size > 1; one engine in this process needs nothing)."""
        if self.data_parallel_size > 1:
            self._stop_replicas()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int = 0, deadline_ms: float | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (a string or a token-id list); results come in input order.

        priority and deadline_ms (from now) apply to every prompt; a prompt still waiting at its
        deadline ends with finish_reason "deadline" and no tokens. lora_request: the adapter every
        prompt runs with, or one per prompt (None: the base model).
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        loras = _per_prompt_lora(lora_request, len(prompts))
        deadline = None if deadline_ms is None else time.monotonic() + deadline_ms / 1000
        ids = []
        try:
            for p, sp, lora in zip(prompts, params, loras):
                ids.append(self._engine.add_request(p, sp, priority=priority, deadline=deadline, lora_request=lora))
        except BaseException:  # e.g. a bad adapter for a later prompt: none of them runs
            for request_id in ids:
                self._engine.abort(request_id)
            raise
        finished = self._run_to_completion(set(ids), use_tqdm)
        return [_to_generation_output(*finished[i], p, self._engine) for i, p in zip(ids, prompts)]

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[GenerationOutput]:
        """Generate replies to one conversation or several, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after each iteration that produced tokens."""
        request_id = self._engine.add_request(prompt, sampling_params or SamplingParams())
        try:
            while True:
                for out in self._engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self._engine.abort(request_id)  # a consumer that stops early frees the KV

    def fine_tune(self, dataset, *, lora_request: LoRARequest | None = None, n_epochs: int = 3,
                  batch_size: int = 8, learning_rate_multiplier: float = 1.0, lora_rank: int | None = None,
                  lora_alpha: float | None = None, target_modules: Sequence[str] | None = None,
                  suffix: str | None = None, hyperparameters: TrainingHyperparameters | None = None,
                  use_tqdm: bool = True) -> LoRARequest:
        """Train a LoRA adapter on `dataset` (a JSONL path, or its records as dicts: chat "messages" or
        "prompt"/"completion") and return it, served already: pass it to generate's lora_request.

        lora_request: an adapter to train further (its rank, alpha and targets apply); else a new one of
        lora_rank (default 16, or max_lora_rank if lower; alpha 2 x rank unless given) on target_modules
        (default: every projection).
        hyperparameters overrides n_epochs, batch_size and learning_rate_multiplier when given.
        DatasetError (a ValueError) names the first bad line; RuntimeError if the job fails.
        """
        if self.data_parallel_size > 1:
            raise ValueError(f"LLM.fine_tune trains in the engine's process: not with data_parallel_size="
                             f"{self.data_parallel_size}")
        return run_fine_tune(self._engine, dataset, lora_request=lora_request, suffix=suffix, use_tqdm=use_tqdm,
                             hyperparameters=hyperparameters or TrainingHyperparameters(
                                 n_epochs=n_epochs, batch_size=batch_size,
                                 learning_rate_multiplier=learning_rate_multiplier),
                             rank=lora_rank, alpha=lora_alpha,
                             target_modules=None if target_modules is None else tuple(target_modules))

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def _run_to_completion(self, pending: set[str], use_tqdm: bool) -> dict[str, tuple[RequestOutput, _Collected]]:
        """Each request's final output, with what its earlier outputs carried."""
        finished: dict[str, tuple[RequestOutput, _Collected]] = {}
        collected = {request_id: _Collected() for request_id in pending}
        bar = tqdm(total=len(pending), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while len(finished) < len(pending):
                for out in self._engine.step():
                    if out.request_id not in pending:
                        continue
                    collected[out.request_id].add(out)
                    if out.finished:
                        finished[out.request_id] = out, collected[out.request_id]
                        bar.update(1)
        except BaseException:
            for request_id in pending - finished.keys():
                self._engine.abort(request_id)
            raise
        finally:
            bar.close()
        return finished


@dataclasses.dataclass(slots=True)
class _Collected:
    """What a request's outputs carry only once or piece by piece: its prompt logprobs (on the first)
    and the logprobs of its tokens (with each output's new tokens)."""

    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, out: RequestOutput) -> None:
        if out.new_logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _per_prompt_lora(lora_request, n: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
    return loras


def _to_generation_output(out: RequestOutput, collected: _Collected, prompt: Prompt,
                          engine: Engine | EngineReplicas) -> GenerationOutput:
    prompt_ids = engine.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else list(prompt)
    completion = CompletionOutput(index=0, text=out.text, token_ids=out.output_token_ids,
                                  finish_reason=out.finish_reason, logprobs=collected.logprobs)
    return GenerationOutput(request_id=out.request_id, prompt=prompt if isinstance(prompt, str) else None,
                            prompt_token_ids=prompt_ids, outputs=[completion],
                            num_cached_tokens=out.num_cached_tokens, prompt_logprobs=collected.prompt_logprobs)
