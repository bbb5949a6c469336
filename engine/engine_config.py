"""Engine options: each defined once, as an `EngineConfig` field with its default and its help.

The command line's engine flags are generated from these fields (`EngineConfig.add_cli_args`,
`EngineConfig.from_cli_args`), the way `vllm serve` derives its flags from `EngineArgs`: adding
an option is one new field. Validation happens on construction; there is no I/O here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
# `pagedserve serve` on CPU: a prompt chunk of 2048 tokens stalls every running stream for ~1.4 s
# there, so while streams decode, a step's prompt tokens are capped at the prompts' share of the
# budget or this floor (Scheduler._prefill_cap; BENCHMARKS.md, "Prefill while decoding on CPU").
CPU_SERVING_PREFILL_WHILE_DECODING = 256
GiB = 1 << 30
# The choices of --quantization (engine/models/quantized_linear.py acts on them).
QUANTIZATIONS = ("auto", "none", "gguf")


def gib_to_bytes(text: str) -> int:
    """A size in GiB as typed on the command line ("4", "0.25") to bytes."""
    return int(float(text) * GiB)


def option(
    default: Any,
    doc: str,
    *,
    choices: Sequence[str] | None = None,
    cli_type: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    aliases: Sequence[str] = (),
) -> Any:
    """A field of EngineConfig with what the command line needs to offer it.

    `doc` is the field's documentation and the flag's help text. `cli_type` parses the flag's
    text when it differs from the field's type (kv_cache_memory: GiB on the command line, bytes in
    the field); `aliases` are further spellings of the flag."""
    metadata = {"help": doc, "choices": choices, "cli_type": cli_type, "metavar": metavar}
    return dataclasses.field(default=default, metadata={**metadata, "aliases": tuple(aliases)})


@dataclass(frozen=True)
class EngineConfig:
    """Everything LLMEngine needs besides requests. None means "derive from the model/machine"."""

    model: str = option(
        "smollm2-135m-instruct",
        "local Hugging Face folder, .gguf file, smollm2-135m-instruct (embedded), or for random "
        "weights a config.json file or a built-in shape (llama-3.2-1b, llama-3.1-8b, "
        "qwen2.5-0.5b, smollm2-135m)",
    )
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)")
    load_format: str = option(
        "auto",
        "how to read the weights; dummy = random weights of the model's shapes",
        choices=LOAD_FORMATS,
    )
    quantization: str = option(
        "auto",
        "a GGUF file's Q4_0/Q4_1/Q8_0 matmul weights: gguf = kept quantized (int4/int8, about 3x "
        "fewer bytes than bfloat16 to hold and to read per step; CPU in bfloat16 only), none = "
        "dequantized to the dtype at load (the reference), auto = gguf where it can be and the "
        "compiled GEMM for many rows runs (AVX512-BF16), else none",
        choices=QUANTIZATIONS,
    )
    device: str = option("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    dtype: str = option(
        "auto",
        "weights, activations and KV cache; auto = bfloat16 on CUDA and on CPUs that compute "
        "it natively (AVX512-BF16 or AMX), float32 on other CPUs",
        choices=("auto", *DTYPES),
    )
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
        f"(default: no cap; `serve` on CPU: {CPU_SERVING_PREFILL_WHILE_DECODING})",
    )
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens (default: the model's context length)"
    )
    kv_cache_memory: int | None = option(
        None,
        "KV-cache budget: GiB on the command line, bytes in EngineConfig (default: on CPU "
        "min(4 GiB, RAM / 4); on CUDA what gpu_memory_utilization leaves)",
        cli_type=gib_to_bytes,
        metavar="GiB",
    )
    num_kv_blocks: int | None = option(
        None, "exact number of KV-cache blocks; overrides kv_cache_memory (reproducible plans)"
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
        True, "reuse the KV blocks of prompt prefixes seen before", aliases=("--prefix-caching",)
    )
    attention_backend: str = option(
        "auto",
        "paged-attention kernels: triton (default on CUDA), cpu (compiled for this CPU on first "
        "use; default on CPU), or torch (the reference; CPU's default without a C++ compiler); "
        "auto also reads $PAGEDSERVE_ATTENTION_BACKEND",
        choices=("auto", *BACKENDS),
    )
    gpu_memory_utilization: float = option(
        0.9,
        "CUDA: share of GPU memory for weights, activations at the largest step, CUDA graphs and "
        "the KV cache, which gets whatever is left; ignored on CPU",
    )
    enforce_eager: bool = option(
        False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs"
    )
    max_cuda_graph_batch_size: int | None = option(
        None, "largest decode batch captured as a CUDA graph (default: max_num_seqs, at most 512)"
    )
    async_scheduling: bool | None = option(
        None,
        "schedule and prepare step N+1 while step N runs, its new tokens filled in on the device "
        "(default: on with CUDA; off on CPU, where the host's own cores run the model); outputs "
        "are the same either way, --no-async-scheduling is for debugging",
    )
    speculative_ngram: int = option(
        0,
        "speculative decoding by prompt lookup: draft up to this many tokens per step from an "
        "earlier occurrence of the sequence's last tokens (in its prompt or output) and verify "
        "them in the same forward pass; greedy requests without logprobs or penalties only; "
        "0 = off",
    )
    speculative_ngram_min: int = option(2, "shortest n-gram matched for speculative drafts")
    speculative_ngram_max: int = option(4, "longest n-gram matched for speculative drafts")
    json_any_whitespace: bool = option(
        False,
        "structured outputs: let JSON outputs put any whitespace between their tokens (xgrammar's "
        "default) instead of one space after ':' and ','; small models can loop on whitespace",
    )
    seed: int = option(0, "seed of the sampler for requests without their own")
    tensor_parallel_size: int = option(
        1,
        "split the model over this many ranks (processes; GPUs on CUDA), each holding its share "
        "of the heads, MLP and vocabulary and of the KV cache; rank 0 starts the others on this "
        "node, or torchrun starts them across nodes (README)",
    )

    def __post_init__(self) -> None:
        # Every field: its type (None only where the type allows it), then its choices.
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if value is None and isinstance(hints[f.name], types.UnionType):
                continue  # unset: derived from the model or the machine
            kind = _scalar_type(hints[f.name])
            if not _is_a(value, kind):
                raise ValueError(f"{f.name} must be {_TYPE_NAMES[kind]}, got {value!r}")
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1], the share of GPU memory to use, "
                f"got {self.gpu_memory_utilization!r}"
            )
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_prefill_tokens_while_decoding",
            "max_model_len",
            "kv_cache_memory",
            "num_kv_blocks",
            "swap_space",
            "max_cuda_graph_batch_size",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.speculative_ngram < 0:
            raise ValueError(
                f"speculative_ngram must be >= 0 (0 = off), got {self.speculative_ngram!r}"
            )
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError(
                "need 1 <= speculative_ngram_min <= speculative_ngram_max, got "
                f"{self.speculative_ngram_min} and {self.speculative_ngram_max}"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype not in FP8_KV_DTYPES:
            raise ValueError(
                "calculate_kv_scales scales an fp8 KV cache: add --kv-cache-dtype fp8 "
                f"(kv_cache_dtype is {self.kv_cache_dtype!r})"
            )
        if self.speculative_ngram and self.async_scheduling:
            raise ValueError(
                "speculative_ngram needs synchronous scheduling (each step's drafts come from "
                "the tokens the previous step accepted): drop --async-scheduling"
            )

    @property
    def step_token_budget(self) -> int:
        """max_num_batched_tokens, or its default when unset."""
        return self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)

    def for_serving(self) -> EngineConfig:
        """This config as `pagedserve serve` runs it: on CPU an unset
        max_prefill_tokens_while_decoding becomes CPU_SERVING_PREFILL_WHILE_DECODING, so a long
        prompt's prefill does not stall the streams already decoding. (Offline batches keep no
        cap: it would cost them throughput, and nobody watches their inter-token latency.)"""
        if self.max_prefill_tokens_while_decoding is not None:
            return self
        if self.torch_device().type != "cpu":
            return self
        cap = CPU_SERVING_PREFILL_WHILE_DECODING
        return dataclasses.replace(self, max_prefill_tokens_while_decoding=cap)

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

    def torch_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the model's dtype, or the fp8 type asked for."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return FP8_KV_DTYPES[self.kv_cache_dtype]

    # ---- command line ----------------------------------------------------------------------------

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, names: Sequence[str] | None = None
    ) -> None:
        """One flag per field (or per field in `names`): `--max-num-seqs` for max_num_seqs; a bool
        gets `--flag` and `--no-flag`. Types, defaults, choices and help come from the field."""
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine options")
        for f in dataclasses.fields(cls):
            if names is not None and f.name not in names:
                continue
            meta = f.metadata
            flags = [f"--{f.name.replace('_', '-')}", *meta.get("aliases", ())]
            help_text = meta.get("help", "")
            if f.default is not None:
                shown = f.default
                if meta.get("cli_type") is gib_to_bytes:
                    shown = f"{f.default / GiB:g}"  # in the flag's unit
                help_text += f" (default: {shown})"
            kind = _scalar_type(hints[f.name])
            if kind is bool:
                group.add_argument(
                    *flags,
                    dest=f.name,
                    default=f.default,
                    action=argparse.BooleanOptionalAction,
                    help=help_text,
                )
                continue
            group.add_argument(
                *flags,
                dest=f.name,
                default=f.default,
                type=meta.get("cli_type") or kind,
                choices=meta.get("choices"),
                metavar=meta.get("metavar"),
                help=help_text,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config the parsed flags describe (raises ValueError for invalid values)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a bool"}


def _is_a(value: Any, kind: type) -> bool:
    # bool is an int to Python, but `block_size=True` is a bug; an int is a fine float.
    if kind is bool or isinstance(value, bool):
        return isinstance(value, bool) and kind is bool
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _scalar_type(hint: Any) -> type:
    """int for `int` and `int | None`: the type a flag's text is parsed to."""
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    if hint not in (str, int, float, bool):
        raise TypeError(f"EngineConfig fields must be str, int, float or bool, got {hint!r}")
    return hint
