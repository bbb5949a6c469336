"""Engine options, validated on construction (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import BACKENDS

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


@dataclass(frozen=True)
class EngineConfig:
    """Everything LLMEngine needs besides requests. None means "derive from the model/machine"."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    load_format: str = "auto"
    device: str = "auto"  # "auto" = cuda when available, else cpu
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048
    max_model_len: int | None = None  # default: the model's context length
    kv_cache_memory: int | None = None  # bytes; default: min(4 GiB, RAM / 4) on CPU
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, reproducible plans)
    enable_prefix_caching: bool = True
    # "auto" = $PAGEDSERVE_ATTENTION_BACKEND, else triton on CUDA and torch on CPU
    attention_backend: str = "auto"
    # CUDA only: the share of the GPU's memory the engine may use (weights, activations at the
    # largest step, CUDA graphs and the KV cache, which gets whatever is left).
    gpu_memory_utilization: float = 0.9
    # CUDA only: run every step eagerly instead of replaying captured CUDA graphs for decode.
    enforce_eager: bool = False
    # Largest decode batch captured as a CUDA graph (default: max_num_seqs, at most 512).
    max_cuda_graph_batch_size: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.attention_backend not in ("auto", *BACKENDS):
            raise ValueError(
                f"attention_backend must be 'auto' or one of {list(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        utilization = self.gpu_memory_utilization
        if (
            isinstance(utilization, bool)
            or not isinstance(utilization, float | int)
            or not 0.0 < utilization <= 1.0
        ):
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1], the share of GPU memory to use, "
                f"got {utilization!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "kv_cache_memory",
            "num_kv_blocks",
            "max_cuda_graph_batch_size",
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

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
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        dtype = DTYPES[self.dtype]
        if device.type == "cpu" and dtype == torch.float16:
            raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
        return dtype
