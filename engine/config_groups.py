"""The engine's options by concern: one frozen dataclass per group, each field an `option()` with
its default and help, checked on construction with no I/O; its `--help` section is its group's
field name in EngineConfig.
`EngineConfig` (engine/engine_config.py) is made of them; each component is handed the groups it
reads (tests/engine/test_config_groups.py says which).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.kv_events_config import KVEventsConfig, parse_kv_events_config
from pagedserve.engine.options import GiB, Options, gib_to_bytes, option
from pagedserve.kernels import BACKENDS, FP8_KV_DTYPES, cpu_features

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The choices of --quantization (engine/models/quantized_linear.py acts on them).
QUANTIZATIONS = ("auto", "none", "gguf")


def check_positive(options: Options, *names: str) -> None:
    """ValueError unless each named field is unset (None) or an integer >= 1."""
    for name in names:
        value = getattr(options, name)
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelOptions(Options):
    """What to load and how to run it: the weights, their format and dtype, the device, the
    kernels, the context length, and the sampler's seed."""

    model: str = option(
        "smollm2-135m-instruct",
        "local Hugging Face folder, .gguf file, smollm2-135m-instruct (embedded), or for random "
        "weights a config.json file or a built-in shape (llama-3.2-1b, llama-3.1-8b, "
        "qwen2.5-0.5b, smollm2-135m)",
    )
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)")
    task: str = option(
        "auto",
        "generate (text) or embed (pooled hidden states: POST /v1/embeddings); auto = embed for "
        "an encoder-only model (BertModel) or a sentence-transformers folder (modules.json), "
        "else generate",
        choices=("auto", "generate", "embed"),
    )
    load_format: str = option(
        "auto",
        "how to read the weights; dummy = random weights of the model's shapes",
        choices=LOAD_FORMATS,
    )
    quantization: str = option(
        "auto",
        "a GGUF file's quantized matmul weights (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q4_K/Q5_K/Q6_K): gguf "
        "= kept as the file's blocks (about 3x "
        "fewer bytes than bfloat16, 6x than float32, to hold and to read per step; on CPU, in "
        "float32 or bfloat16), none = dequantized to the dtype at load (the reference), auto = "
        "gguf where it can be (an x86 CPU with AVX2 and the compiled kernels), else none",
        choices=QUANTIZATIONS,
    )
    device: str = option(
        "auto",
        "auto (cuda when available, else cpu), cpu, cuda or cuda:N",
    )
    dtype: str = option(
        "auto",
        "weights, activations and KV cache; auto = bfloat16 on CUDA and on CPUs that compute "
        "it natively (AVX512-BF16 or AMX), float32 on other CPUs",
        choices=("auto", *DTYPES),
    )
    max_model_len: int | None = option(
        None,
        "longest prompt + output in tokens (default: the model's context length)",
    )
    attention_backend: str = option(
        "auto",
        "paged-attention kernels: triton (default on CUDA), cpu (compiled for this CPU on first "
        "use; default on CPU), or torch (the reference; CPU's default without a C++ compiler); "
        "auto also reads $PAGEDSERVE_ATTENTION_BACKEND",
        choices=("auto", *BACKENDS),
    )
    enforce_eager: bool = option(
        False,
        "run decode steps layer by layer: on CUDA instead of replaying captured CUDA graphs, on "
        "CPU instead of one compiled call per step (GGUF weights kept quantized)",
    )
    max_cuda_graph_batch_size: int | None = option(
        None,
        "largest decode batch captured as a CUDA graph (default: max_num_seqs, at most 512)",
    )
    json_any_whitespace: bool = option(
        False,
        "structured outputs: let JSON outputs put any whitespace between their tokens (xgrammar's "
        "default) instead of one space after ':' and ','; small models can loop on whitespace",
    )
    seed: int = option(0, "seed of the sampler for requests without their own")

    def __post_init__(self) -> None:
        super().__post_init__()  # every field's type and choices
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_positive(self, "max_model_len", "max_cuda_graph_batch_size")

    def model_len(self, context_length: int) -> int:
        """max_model_len, or when unset the model's `context_length`; ValueError beyond it."""
        max_model_len = self.max_model_len or context_length
        if max_model_len > context_length:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length {context_length}"
            )
        return max_model_len

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "device 'cuda' was requested but torch sees no CUDA device; use --device cpu"
            )
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            native = device.type == "cuda" or cpu_features.bf16_is_native()
            return torch.bfloat16 if native else torch.float32
        dtype = DTYPES[self.dtype]
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
        return dtype


@dataclass(frozen=True)
class CacheOptions(Options):
    """The KV cache: its element type, block size, budget, prefix caching and preemption."""

    kv_cache_dtype: str = option(
        "auto",
        "KV-cache element type: auto = the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 keep one "
        "byte per value, half of bf16's, so a memory budget holds twice the blocks; values are "
        "divided by a per-layer K and V scale (1.0, the checkpoint's k_scale/v_scale, or "
        "--calculate-kv-scales) on write and multiplied back on read",
        choices=("auto", *FP8_KV_DTYPES),
    )
    calculate_kv_scales: bool = option(
        False,
        "fp8 KV cache: set each layer's K and V scales from the first step's values (largest "
        "magnitude x 2 / the format's largest value) instead of the checkpoint's or 1.0",
    )
    block_size: int = option(16, "tokens per KV-cache block")
    kv_cache_memory: int | None = option(
        None,
        "KV-cache budget: GiB on the command line, bytes in EngineConfig (default: on CPU "
        "min(4 GiB, RAM / 4); on CUDA what gpu_memory_utilization leaves)",
        cli_type=gib_to_bytes,
        metavar="GiB",
    )
    num_kv_blocks: int | None = option(
        None,
        "exact number of KV-cache blocks; overrides kv_cache_memory (reproducible plans)",
    )
    preemption_mode: str = option(
        "recompute",
        "what a request preempted for room loses: recompute (its blocks are freed and its tokens "
        "computed again when it resumes) or swap (its blocks move to a host-memory pool of "
        "--swap-space GiB and back; recompute when that pool is full)",
        choices=PREEMPTION_MODES,
    )
    swap_space: int = option(
        4 * GiB,
        "swap preemption's host pool: GiB on the command line, bytes in EngineConfig (pinned "
        "memory on CUDA; only allocated with --preemption-mode swap)",
        cli_type=gib_to_bytes,
        metavar="GiB",
    )
    enable_prefix_caching: bool = option(
        True,
        "reuse the KV blocks of prompt prefixes seen before",
        aliases=("--prefix-caching",),
    )
    gpu_memory_utilization: float = option(
        0.9,
        "CUDA: share of GPU memory for weights, activations at the largest step, CUDA graphs and "
        "the KV cache, which gets whatever is left; ignored on CPU",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1], the share of GPU memory to use, "
                f"got {self.gpu_memory_utilization!r}"
            )
        check_positive(self, "block_size", "kv_cache_memory", "num_kv_blocks", "swap_space")
        if self.calculate_kv_scales and self.kv_cache_dtype not in FP8_KV_DTYPES:
            raise ValueError(
                "calculate_kv_scales scales an fp8 KV cache: add --kv-cache-dtype fp8 "
                f"(kv_cache_dtype is {self.kv_cache_dtype!r})"
            )

    def torch_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or the fp8 type asked for."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return FP8_KV_DTYPES[self.kv_cache_dtype]


@dataclass(frozen=True)
class SchedulerOptions(Options):
    """A step's limits, and whether the next step is scheduled while one runs."""

    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = option(
        None,
        "most tokens in one step; longer prompts are prefilled in chunks "
        f"(default: max({DEFAULT_MAX_NUM_BATCHED_TOKENS}, max_num_seqs))",
    )
    max_prefill_tokens_while_decoding: int | None = option(
        None,
        "in a step where streams decode, prompt tokens (new prompts and prefill chunks) take at "
        "most the prompts' per-request share of the token budget, or this many if more, so long "
        "prompts do not stall the streams; a step without decodes takes the whole budget "
        "(default: no cap: every step may take the whole budget, as vLLM's scheduler does)",
    )
    async_scheduling: bool | None = option(
        None,
        "schedule and prepare step N+1 while step N runs, its new tokens filled in on the device "
        "(default: on with CUDA; off on CPU, where the host's own cores run the model); outputs "
        "are the same either way, --no-async-scheduling is for debugging",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(
            self, "max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens_while_decoding"
        )

    @property
    def step_token_budget(self) -> int:
        """max_num_batched_tokens, or its default when unset."""
        return self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)


@dataclass(frozen=True)
class ParallelOptions(Options):
    """Tensor parallelism within an engine core, and this server's data-parallel rank."""

    tensor_parallel_size: int = option(
        1,
        "split the model over this many ranks (processes; GPUs on CUDA), each holding its share "
        "of the heads, MLP and vocabulary and of the KV cache; rank 0 starts the others on this "
        "node, or torchrun starts them across nodes (README)",
    )
    data_parallel_rank: int = option(
        0,
        "the data-parallel rank of this server's first engine core, for servers started apart "
        "behind one router: KV events carry it and their ports are offset by it",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "tensor_parallel_size")
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be >= 0, got {self.data_parallel_rank}")


@dataclass(frozen=True)
class SpeculativeOptions(Options):
    """Speculative decoding by prompt lookup (n-grams)."""

    speculative_ngram: int = option(
        0,
        "speculative decoding by prompt lookup: draft up to this many tokens per step from an "
        "earlier occurrence of the sequence's last tokens (in its prompt or output) and verify "
        "them in the same forward pass; greedy requests without logprobs or penalties only; "
        "0 = off",
    )
    speculative_ngram_min: int = option(
        2,
        "shortest n-gram matched for speculative drafts",
    )
    speculative_ngram_max: int = option(
        4,
        "longest n-gram matched for speculative drafts",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.speculative_ngram < 0:
            raise ValueError(
                f"speculative_ngram must be >= 0 (0 = off), got {self.speculative_ngram!r}"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "need 1 <= speculative_ngram_min <= speculative_ngram_max, got "
                f"{self.speculative_ngram_min} and {self.speculative_ngram_max}"
            )


@dataclass(frozen=True)
class LoRAOptions(Options):
    """LoRA adapters: whether they are served, and the device and host slots for them."""

    enable_lora: bool = option(
        False,
        "serve LoRA adapters of this model (implied by the server's --lora-modules): requests "
        "name one in `model`, and the adapters of a step are applied together",
    )
    max_loras: int = option(
        4,
        "adapters on the device at once (its slots); more wait for a free slot",
    )
    max_lora_rank: int = option(
        64,
        "largest adapter rank accepted (the slots are sized for it)",
    )
    max_cpu_loras: int | None = option(
        None,
        "adapters kept loaded in host memory, least recently used dropped first (default: "
        "max_loras); a dropped one is read from its path again when next used",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "max_loras", "max_lora_rank", "max_cpu_loras")
        fewer = self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras
        if self.enable_lora and fewer:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every adapter in a device slot is also kept in host memory"
            )

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept in host memory: max_cpu_loras, or max_loras when unset."""
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class ObservabilityOptions(Options):
    """What the engine publishes about itself besides its outputs: KV events for routers."""

    kv_events_config: str | None = option(
        None,
        "publish the prefix cache's changes (KV events) for KV-aware routers: vLLM's JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558", "topic": "kv-events"}\' (engine/kv_events_config.py)',
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kv_events  # noqa: B018 (parsed now: a bad JSON is an error at start-up)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed kv_events_config when it enables events, else None."""
        if self.kv_events_config is None:
            return None
        events = parse_kv_events_config(self.kv_events_config)
        return events if events.enabled else None
