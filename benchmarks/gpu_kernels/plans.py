"""The cases the kernel benchmark runs: the model shapes, the decode and prefill cases and the two
plans, FULL (the GPU run) and SMOKE (tiny shapes, seconds under TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kernels.triton_attention import KernelConfig


@dataclass(frozen=True)
class HeadShape:
    """Attention head layout of one model."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA_8B = HeadShape("llama-3.1-8b", 32, 8, 128)
LLAMA_1B = HeadShape("llama-3.2-1b", 32, 8, 64)
SMOLLM2 = HeadShape("smollm2", 9, 3, 64)
TINY = HeadShape("tiny", 4, 2, 64)


@dataclass(frozen=True)
class LayerShape:
    """The sizes of one decoder layer that the fused ops see."""

    heads: HeadShape
    hidden_size: int
    intermediate_size: int
    max_positions: int


LLAMA_1B_LAYER = LayerShape(LLAMA_1B, 2048, 8192, 131072)
TINY_LAYER = LayerShape(TINY, 96, 160, 256)  # rows that are not powers of two


@dataclass(frozen=True)
class MoeShape:
    """The experts of one mixture-of-experts layer."""

    name: str
    hidden_size: int
    intermediate_size: int  # one expert's
    num_experts: int
    top_k: int
    renormalize: bool  # the top-k weights, as the model's router does


QWEN3_30B_A3B_MOE = MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, True)
MIXTRAL_8X7B_MOE = MoeShape("mixtral-8x7b", 4096, 14336, 8, 2, True)
TINY_MOE = MoeShape("tiny-moe", 96, 80, 8, 2, True)  # not multiples of the tiles


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int
    target: float | None  # minimum triton/SDPA bandwidth ratio


@dataclass(frozen=True)
class PrefillCase:
    num_seqs: int
    new_tokens: int
    prefix: int
    target: float | None  # minimum triton/SDPA TFLOP/s ratio


@dataclass(frozen=True)
class Plan:
    """The cases one run checks and measures."""

    decode_shapes: tuple[HeadShape, ...]
    decode_cases: tuple[DecodeCase, ...]
    # Sliding-window attention is checked (not timed) once, on this (shape, batch, context).
    window_case: tuple[HeadShape, int, int]
    # Decode shapes also run over an fp8 cache (every decode case), against the kernel over the
    # cache in --dtype.
    fp8_decode_shapes: tuple[HeadShape, ...]
    sliding_window: int
    prefill_shapes: tuple[HeadShape, ...]
    prefill_cases: tuple[PrefillCase, ...]
    cache_shape: HeadShape
    cache_tokens: int
    # copy_blocks: each of copy_counts blocks per call, in each of copy_layers x (K, V) caches of
    # copy_pool_blocks blocks (at least twice the most copies: sources and destinations differ)
    copy_shape: HeadShape
    copy_layers: int
    copy_pool_blocks: int
    copy_counts: tuple[int, ...]
    fused_layer: LayerShape
    fused_tokens: tuple[int, ...]
    moe_shapes: tuple[MoeShape, ...]
    moe_tokens: tuple[int, ...]
    # --sweep: launch configurations timed on these cases (see run_sweep)
    sweep_decode: tuple[tuple[HeadShape, DecodeCase], ...] = ()
    sweep_prefill: tuple[tuple[HeadShape, PrefillCase], ...] = ()
    sweep_splits: tuple[int, ...] = ()
    decode_configs: tuple[KernelConfig, ...] = ()
    prefill_configs: tuple[KernelConfig, ...] = ()
    # --invariance (see invariance.py): a stream of invariance_length tokens checked bit for bit
    # as a decode among invariance_batch - 1 others, its prompt in chunks of invariance_chunk
    # tokens (not a multiple of any query tile's tokens), ...; then these cases timed by default
    # and with PAGEDSERVE_BATCH_VARIANT=1, on each of invariance_shapes (the first for the checks)
    invariance_shapes: tuple[HeadShape, ...] = ()
    invariance_length: int = 0
    invariance_batch: int = 0
    invariance_chunk: int = 0
    invariance_decode: tuple[DecodeCase, ...] = ()
    invariance_prefill: tuple[PrefillCase, ...] = ()
    # The checks in float32 and windowed + soft-capped too, or only --dtype's plain ones (the
    # smoke run's: tests/kernels/test_triton_batch_invariance.py checks the rest on CPU).
    invariance_every_check: bool = True


FULL = Plan(
    decode_shapes=(LLAMA_8B, LLAMA_1B, SMOLLM2),
    decode_cases=(
        DecodeCase(1, 8192, 0.70),
        DecodeCase(32, 2048, None),
        DecodeCase(64, 2048, 0.90),
        DecodeCase(256, 1024, 0.90),
    ),
    window_case=(LLAMA_8B, 32, 2048),
    fp8_decode_shapes=(LLAMA_8B,),
    sliding_window=1024,
    prefill_shapes=(LLAMA_8B, LLAMA_1B),
    prefill_cases=(PrefillCase(8, 2048, 0, 0.60), PrefillCase(8, 512, 2048, 0.60)),
    cache_shape=LLAMA_8B,
    cache_tokens=65536,
    copy_shape=LLAMA_8B,
    copy_layers=32,
    copy_pool_blocks=1024,  # 64 caches x 1024 blocks x 32 KiB: 2 GiB, twice (Triton, reference)
    copy_counts=(1, 64, 256),
    fused_layer=LLAMA_1B_LAYER,
    fused_tokens=(1, 256, 4096),
    moe_shapes=(QWEN3_30B_A3B_MOE, MIXTRAL_8X7B_MOE),
    moe_tokens=(1, 16, 256),
    sweep_decode=(
        (LLAMA_8B, DecodeCase(1, 8192, 0.70)),
        (LLAMA_8B, DecodeCase(64, 2048, 0.90)),
        (LLAMA_1B, DecodeCase(256, 1024, 0.90)),
        (SMOLLM2, DecodeCase(64, 2048, 0.90)),
    ),
    sweep_prefill=(
        (LLAMA_8B, PrefillCase(8, 2048, 0, 0.60)),
        (LLAMA_1B, PrefillCase(8, 512, 2048, 0.60)),
    ),
    sweep_splits=(4, 8, 16, 32, 64),
    decode_configs=tuple(
        KernelConfig(tile, warps, stages)
        for tile, warps, stages in [
            (32, 2, 4),
            (32, 4, 4),
            (64, 4, 2),
            (64, 4, 3),
            (64, 4, 4),
            (64, 8, 3),
            (128, 4, 2),
            (128, 4, 3),
            (128, 8, 3),
            (256, 8, 2),
        ]
    ),  # fmt: skip
    prefill_configs=tuple(
        KernelConfig(tile, warps, stages, block_m)
        for block_m, tile, warps, stages in [
            (128, 64, 8, 2),
            (128, 64, 8, 3),
            (128, 128, 8, 2),
            (128, 32, 4, 3),
            (128, 64, 4, 3),
            (64, 64, 4, 3),
            (64, 128, 4, 2),
            (64, 32, 4, 4),
        ]
    ),  # fmt: skip
    invariance_shapes=(LLAMA_8B,),
    invariance_length=2000,
    invariance_batch=64,
    invariance_chunk=509,
    invariance_decode=(
        DecodeCase(64, 2048, None),
        DecodeCase(256, 1024, None),
        DecodeCase(1, 8192, None),
    ),
    invariance_prefill=(PrefillCase(8, 2048, 0, None), PrefillCase(8, 512, 2048, None)),
)

# Tiny shapes that run in seconds under TRITON_INTERPRET=1; no speed targets.
SMOKE = Plan(
    decode_shapes=(TINY,),
    decode_cases=(DecodeCase(2, 64, None),),
    window_case=(TINY, 2, 64),
    fp8_decode_shapes=(TINY,),
    sliding_window=32,
    prefill_shapes=(TINY,),
    prefill_cases=(PrefillCase(2, 32, 0, None), PrefillCase(2, 32, 32, None)),
    cache_shape=TINY,
    cache_tokens=256,
    copy_shape=TINY,
    copy_layers=2,
    copy_pool_blocks=8,
    copy_counts=(1, 3),
    fused_layer=TINY_LAYER,
    fused_tokens=(1, 5),
    moe_shapes=(TINY_MOE,),
    moe_tokens=(1, 12),  # 16-row tiles, then 64 (more tokens than experts)
    sweep_decode=((TINY, DecodeCase(2, 64, None)),),
    sweep_prefill=((TINY, PrefillCase(2, 32, 32, None)),),
    sweep_splits=(2,),
    decode_configs=(KernelConfig(32, 4, 2), KernelConfig(64, 4, 3)),
    prefill_configs=(KernelConfig(32, 4, 2, 32), KernelConfig(64, 4, 2, 64)),
    invariance_shapes=(TINY,),
    invariance_length=80,  # two 64-key tiles
    invariance_batch=8,
    invariance_chunk=13,
    invariance_decode=(DecodeCase(2, 64, None), DecodeCase(1, 160, None)),
    invariance_prefill=(PrefillCase(2, 32, 32, None),),
    invariance_every_check=False,
)
