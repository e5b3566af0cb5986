"""Frozen configuration dataclasses; each checks itself in __post_init__ and is never mutated."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from orca_jax.finetune_config import FineTuningConfig, FineTuningMemory  # noqa: F401 (part of this module's names)

DTYPES = ("float32", "bfloat16", "float16")  # what weights, activations and the KV cache may be


class ModelFamily(enum.Enum):
    """Which decoder variant the config switches select."""

    GPT = "gpt"  # learned positions, LayerNorm, GeLU MLP, MHA
    LLAMA = "llama"  # RoPE, RMSNorm, SwiGLU, GQA


class Quantization(enum.Enum):
    """How the projection weights are stored (vLLM's --quantization)."""

    # e4m3 weights with one f32 scale per output channel (models/fp8.py), the untied LM head's too unless
    # ModelConfig.quantize_lm_head is off; embeddings, norms and biases stay in the model's dtype. From a
    # 16/32-bit checkpoint (quantized at load) or an FP8 one (compressed-tensors, Hugging Face's "fp8").
    FP8 = "fp8"


class KVCacheDtype(enum.Enum):
    """What the KV pages hold (vLLM's --kv-cache-dtype)."""

    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # e4m3 with one per-tensor scale (KV_FP8_SCALE): half of bf16's bytes per token


# The per-tensor scale of FP8 K/V pages: stored = value / scale, clipped to e4m3's range. vLLM's default
# when a checkpoint gives none; K and V of the models measured stay well inside +-448.
KV_FP8_SCALE = 1.0


class AttentionBackend(enum.Enum):
    """Which ragged attention implementation the runner uses."""

    AUTO = "auto"  # PALLAS on GPU, JNP elsewhere
    JNP = "jnp"  # jnp attention and XLA's ops throughout
    PALLAS = "pallas"  # the Pallas attention and layer kernels (RoPE + K/V page write)
    PALLAS_ATTENTION = "pallas-attention"  # the Pallas attention only, XLA's ops around it (an A/B baseline)


class SchedulingPolicy(enum.Enum):
    """How the scheduler orders requests (ORCA Algorithm 1 is FCFS)."""

    FCFS = "fcfs"
    PRIORITY = "priority"  # higher priority first (aged, so nothing starves); may preempt lower
    EDF = "edf"  # earliest deadline first
    SJF = "sjf"  # shortest job (prompt + max_tokens) first
    DAS = "das"  # TCB's deadline-aware scheduler, admitting per iteration

    @classmethod
    def _missing_(cls, value):
        return cls.EDF if value == "deadline" else None  # the old flag value keeps working


@dataclasses.dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling ("rope_type": "llama3" in a Hugging Face config.json).

    Wavelengths longer than original_max_position / low_freq_factor are stretched by `factor`, those
    shorter than original_max_position / high_freq_factor are kept, and the band between is blended.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position <= 0:
            raise ValueError("RopeScaling.factor and original_max_position must be positive")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor}, {self.high_freq_factor}")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and switches of one decoder-only transformer."""

    family: ModelFamily
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # LLAMA only
    rope_scaling: RopeScaling | None = None  # LLAMA only; None: plain RoPE
    qkv_bias: bool = False  # LLAMA only (Qwen2): biases on the q/k/v projections; GPT always has them
    tie_embeddings: bool = True
    dtype: str = "float32"  # activations, weights and KV: one of DTYPES
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Quantization | None = None  # None: every weight in dtype
    quantize_lm_head: bool = True  # under a quantization, an untied LM head too (lm_head_quantized)
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.family is ModelFamily.GPT and self.num_kv_heads != self.num_heads:
            raise ValueError("GPT models use multi-head attention: num_kv_heads must equal num_heads")
        if self.family is ModelFamily.GPT and (self.rope_scaling is not None or self.qkv_bias):
            raise ValueError("rope_scaling and qkv_bias are Llama-family switches (GPT has biases anyway)")
        if self.dtype not in DTYPES:
            raise ValueError(f"ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_itemsize

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one K or V element in the pages."""
        if self.kv_cache_dtype is KVCacheDtype.FP8:
            return 1
        return 4 if self.dtype == "float32" else 2

    @property
    def kv_dtype_name(self) -> str:
        """The pages' dtype, as jnp.dtype reads it."""
        return "float8_e4m3fn" if self.kv_cache_dtype is KVCacheDtype.FP8 else self.dtype

    @property
    def lm_head_quantized(self) -> bool:
        """Whether the LM head is stored quantized: untied only (a tied table is also the embedding lookup)."""
        return self.quantization is not None and self.quantize_lm_head and not self.tie_embeddings

    @property
    def num_projection_params(self) -> int:
        """The parameters Quantization.FP8 stores in e4m3: every layer's q/k/v, o and MLP kernels (and the
        LM head where lm_head_quantized)."""
        h, f, d = self.hidden_size, self.ffn_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        head = self.vocab_size * h if self.lm_head_quantized else 0
        return self.num_layers * (attn + h * f * (3 if self.family is ModelFamily.LLAMA else 2)) + head

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights as stored: e4m3 projections (plus their f32 scales) under FP8."""
        itemsize = 4 if self.dtype == "float32" else 2
        if self.quantization is None:
            return self.num_params * itemsize
        projections = self.num_projection_params
        return (self.num_params - projections) * itemsize + projections + 4 * self.num_output_channels

    @property
    def num_output_channels(self) -> int:
        """Output channels of the projections, all layers and a quantized LM head (one FP8 scale each)."""
        h, f, d = self.hidden_size, self.ffn_size, self.head_dim
        # q|k|v, then o and down (H each), then gate|up (or GPT's up)
        per_layer = d * (self.num_heads + 2 * self.num_kv_heads) + 2 * h + f * (2 if self.family is ModelFamily.LLAMA else 1)
        return self.num_layers * per_layer + (self.vocab_size if self.lm_head_quantized else 0)

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        h, f, d = self.hidden_size, self.ffn_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += d * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        mlp = h * f * (3 if self.family is ModelFamily.LLAMA else 2)
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        pos = self.max_seq_len * h if self.family is ModelFamily.GPT else 0
        return self.num_layers * (attn + mlp) + embed + pos


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache. page_size=1 is FineInfer's token-granular manager."""

    page_size: int = 16
    num_pages: int | None = None  # None: size the pool from kv_memory_gib
    kv_memory_gib: float | None = None  # None: from device memory (kv_pool.num_pages_for)
    # vLLM's meaning: weights + KV + workspace take at most this fraction of a GPU's memory. None:
    # what XLA was given (XLA_PYTHON_CLIENT_MEM_FRACTION, jax's default 0.75). Ignored on CPU.
    gpu_memory_utilization: float | None = None
    # Requests sharing a prefix share its full pages (core/kv/prefix_index.py); on by default, as in vLLM v1.
    enable_prefix_caching: bool = True

    def __post_init__(self):
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("CacheConfig.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.page_size <= 0:
            raise ValueError(f"CacheConfig.page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"CacheConfig.num_pages must be at least 2, got {self.num_pages}")
        if self.kv_memory_gib is not None and self.kv_memory_gib <= 0:
            raise ValueError(f"CacheConfig.kv_memory_gib must be positive, got {self.kv_memory_gib}")


class KVAllocation(enum.Enum):
    """When a request gets its KV pages."""

    # ORCA Algorithm 1: reserve prompt + max_tokens at admission; the pool can never run dry, but a
    # request with a large max_tokens holds pages it may never use (and blocks others meanwhile).
    RESERVE = "reserve"
    # vLLM's way: pages as the request grows; when the pool runs dry, the lowest-ranked running
    # request is preempted (pages freed, recomputed later from prompt + its outputs so far).
    ON_DEMAND = "on_demand"


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """ORCA Algorithm 1's knobs plus the per-iteration token budget."""

    max_num_seqs: int = 64  # requests per iteration (ORCA's max batch size)
    max_num_batched_tokens: int = 512  # token budget per iteration; longer prompts take several
    # The most prompt tokens one request feeds per iteration it shares with other requests (vLLM's
    # long_prefill_token_threshold), so a long prompt shares its iterations with decodes and other
    # prompts; alone in its batch it takes the whole budget. None: no cap but the budget.
    long_prefill_token_threshold: int | None = None
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_waiting: int = 1024  # bounded request pool: add_request refuses beyond this
    # Plan iteration k+1 while iteration k runs: a request of k that will sample a token feeds it in
    # k+1 straight from the device (its id reaches the host one iteration later). Needs two batch
    # slots; the engine turns it off for pipeline stages, where in-flight batches are disjoint.
    async_scheduling: bool = True
    kv_allocation: KVAllocation = KVAllocation.RESERVE
    # ON_DEMAND admits a request only while this fraction of the pool stays unreserved after it, so
    # running requests have room to grow before anyone must be preempted (vLLM uses 1%).
    kv_watermark: float = 0.01
    # PRIORITY: a request's effective priority grows by 1 per this many seconds since its arrival,
    # so a request of priority p overtakes every later arrival of priority <= p + k after k steps.
    priority_aging_s: float = 10.0
    # PRIORITY: a request that does not fit may preempt running requests it outranks (their KV is
    # freed and they recompute later). Off here, so Algorithm 1's runs stay as they were; serve turns
    # it on, so an interactive chat need not wait for batch work to drain the pool.
    priority_preemption: bool = False
    # DAS (TCB): eta of the free slots go to the highest-utility requests; of the rest, those whose
    # utility reaches q x the mean of that set go in deadline order; eta + q = 1.
    das_eta: float = 0.5
    das_q: float = 0.5

    def __post_init__(self):
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"SchedulerConfig.kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.priority_aging_s <= 0:
            raise ValueError(f"SchedulerConfig.priority_aging_s must be positive, got {self.priority_aging_s}")
        if not (0.0 < self.das_eta <= 1.0 and 0.0 <= self.das_q < 1.0) \
                or abs(self.das_eta + self.das_q - 1.0) > 1e-9:
            raise ValueError(f"SchedulerConfig.das_eta + das_q must be 1 with eta in (0, 1], got "
                             f"{self.das_eta} + {self.das_q}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("SchedulerConfig.max_num_batched_tokens must be at least max_num_seqs "
                             "so every running request can get its one increment token")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold <= 0:
            raise ValueError("SchedulerConfig.long_prefill_token_threshold must be positive, got "
                             f"{self.long_prefill_token_threshold}")
        if self.max_waiting <= 0:
            raise ValueError(f"SchedulerConfig.max_waiting must be positive, got {self.max_waiting}")


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Mesh shape: inter-layer (pipeline stages) x intra-layer (tensor) parallelism."""

    num_stages: int = 1
    tensor_parallel: int = 1
    # Several controller processes (jax.distributed): one per host, or one per GPU. Process 0 schedules.
    coordinator_address: str | None = None  # "host:port" of process 0's coordinator
    num_processes: int = 1
    process_id: int = 0
    # Where process 0 takes its workers' control connections (multihost.py); None: the coordinator's
    # port + 1.
    control_port: int | None = None
    # Seconds after which jax's heartbeat declares a silent process dead (a closed connection is
    # noticed at once, see multihost.py, so this only catches a frozen host): long enough that a
    # loaded host's stall is not taken for a death.
    peer_timeout_s: float = 60.0
    # How long a process that finished waits at exit for the others to finish too (jax.distributed's
    # shutdown barrier, which aborts the process past it): 10 s aborted a finished process (SIGABRT,
    # "Barrier timed out") while its peer was still printing its results on a busy 2-core machine.
    # A peer that is gone ends the others at once, barrier or not (multihost.py).
    shutdown_timeout_s: float = 300.0

    def __post_init__(self):
        if self.num_stages <= 0 or self.tensor_parallel <= 0:
            raise ValueError("ParallelConfig sizes must be positive")
        if self.num_processes <= 0 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"ParallelConfig needs 0 <= process_id ({self.process_id}) < num_processes "
                             f"({self.num_processes})")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("ParallelConfig with several processes needs coordinator_address (host:port)")
        for name in ("peer_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ParallelConfig.{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's names): a device table of max_loras adapter slots of max_lora_rank.

    Every program is compiled for the table's shape, so which adapters are loaded never changes a
    program; an adapter of a smaller rank is zero-padded. Adapters beyond the slots wait in host
    memory (up to max_cpu_loras that no request needs; None: max_loras) and are swapped in, least
    recently used first, when a request needs them.
    """

    max_loras: int = 1  # adapter slots on the device
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        if self.max_loras <= 0 or self.max_lora_rank <= 0:
            raise ValueError(f"LoRAConfig.max_loras and max_lora_rank must be positive, got "
                             f"{self.max_loras}, {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"LoRAConfig.max_cpu_loras ({self.max_cpu_loras}) must be at least "
                             f"max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory while no request needs them."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingConfig:
    """Caps on what one request may ask of the sampler (each sizes the sampling programs' inputs)."""

    # The most top logprobs a request may ask for (vLLM's --max-logprobs); the top-K width of the
    # sampling programs that return them.
    max_logprobs: int = 20
    # Entries of the per-row logit table one request may use in one iteration: its logit_bias, its
    # bad words (one entry per tokenized word) and, below min_tokens, its stop and EOS tokens.
    logit_table_width: int = 64
    # Requests may ask for prompt_logprobs (vLLM's SamplingParams field): one more program per prompt
    # length bucket (worker/prompt_logprobs.py), compiled at start-up only when this is on.
    enable_prompt_logprobs: bool = False
    # Stop strings one request may give, and their characters together. Matching costs the same
    # whatever their number (engine/stop_strings.py's automaton reads each output character once);
    # building the automaton, at intake on the engine's thread, costs ~1-2 us per character.
    max_stop_strings: int = 256
    max_stop_chars: int = 4096
    # A decode batch sampled plainly (no penalties, grammar, bias or top logprobs) samples inside its
    # forward's program, one launch fewer an iteration (worker/stage.py); two more programs per decode
    # bucket. Off: the sampling programs run after the forward, as for every other batch.
    fuse_decode_sampling: bool = True

    def __post_init__(self):
        if self.max_logprobs < 0:
            raise ValueError(f"SamplingConfig.max_logprobs must be >= 0, got {self.max_logprobs}")
        for name in ("logit_table_width", "max_stop_strings", "max_stop_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SamplingConfig.{name} must be positive, got {getattr(self, name)}")

    def check_stop(self, stop: Sequence[str]) -> None:
        """ValueError naming SamplingParams.stop when a request's stop strings pass max_stop_strings or
        max_stop_chars (the server answers it with a 400 before tokenizing anything)."""
        if len(stop) > self.max_stop_strings:
            raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most {self.max_stop_strings} are "
                             "allowed (SamplingConfig.max_stop_strings, --max-stop-strings)")
        num_chars = sum(map(len, stop))
        if num_chars > self.max_stop_chars:
            raise ValueError(f"SamplingParams.stop has {num_chars} characters in all; at most {self.max_stop_chars} "
                             "are allowed (SamplingConfig.max_stop_chars, --max-stop-chars)")


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one structured-output grammar may cost, at compile and per output token: llguidance's
    LLParserLimits, named as there (speeds from its documentation). A compile or a token's mask that
    passes one stops with an error (a request then ends with it). CPU time and crashes are the
    server's grammar workers' to bound (structured/sandbox.py): these limits do not bound everything
    (a Lark grammar of 10,000 chained rules ran for minutes before its size check; 3,000 overflowed
    the stack)."""

    max_grammar_size: int = 500_000  # symbols in the grammar's productions
    max_items_in_row: int = 2_000  # branching of one production row
    initial_lexer_fuel: int = 1_000_000  # building the lexer's regexes at compile (~50k/ms)
    step_lexer_fuel: int = 200_000  # lexer work for one token's mask (~14k/ms)
    step_max_items: int = 50_000  # Earley items for one token's mask (~20k/ms)
    max_lexer_states: int = 250_000  # lexer states (~1-2 kB each)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GrammarLimits.{field.name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; built once by the entry point."""

    model: str = "smollm2-135m"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    sampling: SamplingConfig = SamplingConfig()
    attention: AttentionBackend = AttentionBackend.AUTO
    dtype: str | None = None  # one of DTYPES; None ("auto"): the checkpoint's (a preset's own)
    max_model_len: int | None = None  # caps the preset's max_seq_len when set
    seed: int = 0
    # Batches in flight at once (Algorithm 1's n_workers); None: effective_max_in_flight decides.
    max_in_flight: int | None = None
    # Compile every bucket's programs when the engine starts, so nothing compiles while serving.
    precompile: bool = True
    # Launch the programs on a thread of their own, beside the engine's planning (engine/dispatcher.py).
    dispatch_thread: bool = True
    # JAX's persistent compilation cache: "auto" keeps jax's own setting if one is made, else a
    # per-user directory (compilation.default_cache_dir()); a path uses it; None turns it off.
    compilation_cache_dir: str | None = "auto"
    # Multi-LoRA serving (vLLM's enable_lora); None: off, and no program reads an adapter table.
    lora: LoRAConfig | None = None
    # Fine-tuning jobs in the engine (needs lora: finished adapters are served from its slots); None: off.
    fine_tuning: FineTuningConfig | None = None
    # What one structured-output grammar may cost the engine, at compile and per token (llguidance's limits).
    grammar_limits: GrammarLimits = GrammarLimits()
    # FP8 projection weights (vLLM's --quantization); None: the checkpoint's own (an FP8 checkpoint stays
    # FP8), else every weight in dtype.
    quantization: Quantization | None = None
    quantize_lm_head: bool = True  # ModelConfig.quantize_lm_head; off: in dtype (vLLM's choice), for accuracy
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO  # FP8: e4m3 KV pages (vLLM's --kv-cache-dtype fp8)

    @property
    def async_scheduling(self) -> bool:
        """Overlapped planning (SchedulerConfig.async_scheduling): batch k+1 planned and dispatched before
        batch k's tokens reach the host, its requests' tokens read on the device."""
        return self.scheduler.async_scheduling

    @property
    def effective_max_in_flight(self) -> int:
        """Algorithm 1's n_workers: max_in_flight if set, else one batch per pipeline stage, and at least
        two with async scheduling (the host builds iteration k+1 while the devices run k)."""
        if self.max_in_flight is not None:
            return self.max_in_flight
        return max(self.parallel.num_stages, 2 if self.async_scheduling else 1)

    def __post_init__(self):
        if self.max_in_flight is not None and self.max_in_flight <= 0:
            raise ValueError("EngineConfig.max_in_flight must be positive")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be None (the checkpoint's) or one of {DTYPES}, "
                             f"got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be positive, got {self.max_model_len}")
        if self.sampling.enable_prompt_logprobs and (self.parallel.num_stages > 1 or self.parallel.num_processes > 1):
            raise ValueError("prompt logprobs run the model as one program on one stage's devices: they are not "
                             "supported with pipeline parallelism (num_stages > 1) or several controller "
                             "processes yet (SamplingConfig.enable_prompt_logprobs, --enable-prompt-logprobs)")
        if self.lora is not None and self.parallel.num_processes > 1:
            raise ValueError("LoRA adapters are not supported with several controller processes yet")
        if self.fine_tuning is not None:
            if self.lora is None:
                raise ValueError("fine-tuning serves its adapters through LoRA slots: enable LoRA too "
                                 "(EngineConfig.lora, --enable-lora)")
            # Several controller processes are refused above: fine-tuning needs LoRA.
            if self.parallel.num_stages != 1:
                raise ValueError("fine-tuning runs on one pipeline stage for now (tensor parallelism is "
                                 "supported; pipeline stages are not): drop --pipeline-parallel-size or "
                                 "--enable-fine-tuning")
