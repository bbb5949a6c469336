"""Micro-benchmark of the multi-LoRA matmuls on CPU (kernels/lora.py): microseconds per projection
call for SmolLM2-135M's four projections of one layer, and their sum.

    python -m benchmarks.lora_cpu            # decode 16 tokens and prefill 512, bf16 and fp32
    python -m benchmarks.lora_cpu --smoke    # a tiny, fast run (a few iterations)

Adapters: --adapters of rank --rank in slots padded to --max-rank (the engine pads every slot to
the largest rank it serves). Batches:
  decode   --decode-tokens tokens, one per request, adapters interleaved (token i has adapter
           i % adapters), as requests of different adapters arrive mixed: scattered groups, the
           index path of lora_add_cpu
  prefill  --prefill-tokens tokens, --adapters requests of equal length, one adapter each:
           contiguous groups, the slice path

Columns, each the delta added to y in place for every token of the batch:
  base      the base projection the delta is added to (its weight oneDNN-packed, as the
            engine's), for scale
  grouped   lora_add_cpu: one shrink matmul over all parts at the actual rank, one expand per part
            (group_tokens, once per step for all layers, is timed on its own line)
  masked    lora_add_cpu_dense: every token against every slot at the padded rank, masked (the
            engine's path for steps of few tokens), on its oneDNN-packed weights
  naive     a loop over adapters: a boolean mask of its tokens (recomputed each call),
            x[mask] @ A_padded^T at the padded rank, @ B^T per part, y[mask] += delta
  per-token lora_add_reference, one token at a time (decode only)
A step adds about --num-layers x the "layer" line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.attention_cpu import time_ms
from benchmarks.options import add_int_options
from pagedserve.engine.models.cpu_linear import linear, pack
from pagedserve.kernels import lora

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def projections(args: argparse.Namespace) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (in_features, part_sizes) of one decoder layer's projections."""
    return {
        "qkv": (args.hidden, (args.q_size, args.kv_size, args.kv_size)),
        "o": (args.q_size, (args.hidden,)),
        "gate_up": (args.hidden, (args.intermediate, args.intermediate)),
        "down": (args.intermediate, (args.hidden,)),
    }


def time_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    """`attention_cpu.time_ms` (best of `repeats` means), in microseconds."""
    return time_ms(fn, iters, repeats) * 1e3


def naive_lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    token_slots: torch.Tensor,
    num_adapters: int,
    a_slots: torch.Tensor,
    b_slots: torch.Tensor,
    part_sizes: tuple[int, ...],
) -> None:
    """The straightforward per-adapter loop: padded rank, masks recomputed, one gather/scatter
    per adapter."""
    num_parts, rank, in_features = a_slots.shape[1:]
    offsets = lora.part_offsets(part_sizes)
    for slot in range(num_adapters):
        mask = token_slots == slot
        shrunk = x[mask] @ a_slots[slot].reshape(num_parts * rank, in_features).T
        delta = torch.cat(
            [
                shrunk[:, j * rank : (j + 1) * rank] @ b_slots[slot, offsets[j] : offsets[j + 1]].T
                for j in range(num_parts)
            ],
            dim=1,
        )
        y[mask] += delta


def token_slots_of(scenario: str, num_tokens: int, num_adapters: int) -> np.ndarray:
    if scenario == "decode":
        return np.arange(num_tokens) % num_adapters
    per_request = -(-num_tokens // num_adapters)
    return np.minimum(np.arange(num_tokens) // per_request, num_adapters - 1)


def measure(
    args: argparse.Namespace,
    per_token: bool,
    host_slots: np.ndarray,
    in_features: int,
    part_sizes: tuple[int, ...],
    dtype: torch.dtype,
    gen: torch.Generator,
) -> list[float]:
    """Microseconds per call of one projection: [base, grouped, masked, naive, per-token (NaN
    unless `per_token`)]."""
    num_tokens, out_features = len(host_slots), sum(part_sizes)
    token_slots = torch.from_numpy(host_slots)
    groups = lora.group_tokens(host_slots, [args.rank] * args.adapters)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.02).to(dtype)
    a = torch.randn(args.adapters, len(part_sizes), args.max_rank, in_features, generator=gen)
    b = torch.randn(args.adapters, out_features, args.max_rank, generator=gen)
    a[:, :, args.rank :] = 0  # the padding of the slots
    b[:, :, args.rank :] = 0
    a, b = (a * 0.02).to(dtype), (b * 0.02).to(dtype)
    b_out_major = b.permute(1, 0, 2).contiguous().permute(1, 0, 2)  # the engine's layout
    a_flat, b_parts = lora.dense_weights(a, b_out_major, part_sizes)
    for w in (weight, a_flat, *b_parts):  # oneDNN-packed, as the engine's weights are
        pack(w)
    mask = lora.slot_mask(host_slots, args.adapters, dtype)
    # The paths must agree before they are timed (fp32: only the order of the sums differs).
    want, got = y.clone(), y.clone()
    naive_lora_add(want, x, token_slots, args.adapters, a, b, part_sizes)
    lora.lora_add_cpu(got, x, groups, a, b, part_sizes)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    got = y.clone()
    lora.lora_add_cpu_dense(got, x, mask, a_flat, b_parts, linear)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    iters, repeats = args.iters, args.repeats
    return [
        time_us(lambda: linear(x, weight), iters, repeats),
        time_us(lambda: lora.lora_add_cpu(y, x, groups, a, b, part_sizes), iters, repeats),
        time_us(
            lambda: lora.lora_add_cpu_dense(y, x, mask, a_flat, b_parts, linear), iters, repeats
        ),
        time_us(
            lambda: naive_lora_add(y, x, token_slots, args.adapters, a, b, part_sizes),
            iters,
            repeats,
        ),
        time_us(
            lambda: lora.lora_add_reference(y, x, token_slots, a, b, part_sizes),
            max(iters // 4, 1),
            repeats,
        )
        if per_token
        else math.nan,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_int_options(parser, hidden=576, q_size=576, kv_size=192, intermediate=1536)
    parser.add_argument("--num-layers", type=int, default=30, help="for the per-step estimate")
    add_int_options(parser, adapters=4, rank=16)
    parser.add_argument("--max-rank", type=int, default=64, help="the slots' padded rank")
    parser.add_argument(
        "--decode-tokens", default="16", help="comma-separated token counts, one table each"
    )
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--scenarios", default="decode,prefill")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    add_int_options(parser, iters=20, repeats=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny, fast run: 64 prefill tokens, 2 iterations"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.prefill_tokens, args.iters, args.repeats = min(args.prefill_tokens, 64), 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.rank <= args.max_rank:
        raise SystemExit(f"--rank must be in [1, --max-rank {args.max_rank}]")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.adapters} adapters "
        f"of rank {args.rank} in slots of rank {args.max_rank}; microseconds per call"
    )
    header = (
        f"{'scenario':<8} {'dtype':<5} {'proj':<8} {'tokens':>6} {'base':>9} {'grouped':>9} "
        f"{'masked':>9} {'naive':>9} {'per-token':>10} {'naive/grp':>10} {'grp/mask':>9} "
        f"{'best/base':>9}"
    )
    gen = torch.Generator().manual_seed(0)
    slot_ranks = [args.rank] * args.adapters
    runs = [
        (scenario, int(n))
        for scenario in args.scenarios.split(",")
        for n in (args.decode_tokens.split(",") if scenario == "decode" else [args.prefill_tokens])
    ]
    for scenario, num_tokens in runs:
        host_slots = token_slots_of(scenario, num_tokens, args.adapters)
        group_us = time_us(lambda h=host_slots: lora.group_tokens(h, slot_ranks), 200, args.repeats)
        print(f"\n{scenario}: {num_tokens} tokens; group_tokens once per step {group_us:.1f} us")
        print(header)
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES[dtype_name]
            totals = [0.0] * 5
            for proj, (in_features, part_sizes) in projections(args).items():
                times = measure(args, scenario == "decode", host_slots, in_features, part_sizes,
                                dtype, gen)  # fmt: skip
                totals = [t + u for t, u in zip(totals, times, strict=True)]
                print(_row(scenario, dtype_name, proj, num_tokens, times))
            print(_row(scenario, dtype_name, "layer", num_tokens, totals))
            per_step = [
                "-" if math.isnan(v) else f"{v * args.num_layers / 1e3:.2f} ms" for v in totals
            ]
            print(
                f"{'':<8} {'':<5} {'x' + str(args.num_layers):<8} {'':>6} {per_step[0]:>9} "
                f"{per_step[1]:>9} {per_step[2]:>9} {per_step[3]:>9} {per_step[4]:>10}"
            )


def _row(scenario: str, dtype: str, proj: str, tokens: int, times: list[float]) -> str:
    base, grouped, masked, naive, per_token = times
    per_token_text = "-" if math.isnan(per_token) else f"{per_token:.1f}"
    return (
        f"{scenario:<8} {dtype:<5} {proj:<8} {tokens:>6} {base:>9.1f} {grouped:>9.1f} "
        f"{masked:>9.1f} {naive:>9.1f} {per_token_text:>10} {naive / grouped:>9.2f}x "
        f"{grouped / masked:>8.2f}x {min(grouped, masked) / base:>8.2f}x"
    )


if __name__ == "__main__":
    main()
