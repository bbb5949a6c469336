"""Micro-benchmark of the attention kernels on CPU: milliseconds per call, i.e. per layer, for
each backend side by side (the compiled `cpu` kernel and the `torch` reference by default).

    python -m benchmarks.attention_cpu               # SmolLM2-135M shapes, fp32 and bf16
    python -m benchmarks.attention_cpu --threads 1 --iters 50 --backends cpu
    python -m benchmarks.attention_cpu --from-memory --scenarios decode --context 160

Scenarios (each over a paged cache with the sequences' blocks scattered at random):
  decode   --batch sequences, one new token each, context ~--context tokens (+-25%)
  prefill  --batch sequences of --prefill-len new tokens, nothing cached
  mixed    --batch - 1 decode sequences plus one --prefill-len prompt chunk
The engine calls both kernels once per layer per step, so a step costs about
num_layers x (reshape_and_cache + paged_attention).
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

from benchmarks.options import add_int_options
from pagedserve import kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(
    seqs: list[tuple[int, int]], args: argparse.Namespace, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Tensors for one step; `seqs` lists (num_cached, num_new) per sequence."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs = args.block_size
    blocks_per_seq = [math.ceil((c + n) / bs) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) * 2  # half of the cache is other sequences' blocks
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    max_blocks = max(blocks_per_seq)
    tables, slots = [], []
    for (cached, new), n in zip(seqs, blocks_per_seq, strict=True):
        own, physical = physical[:n], physical[n:]
        tables.append(own + [0] * (max_blocks - n))
        slots += [own[p // bs] * bs + p % bs for p in range(cached, cached + new)]
    num_tokens = sum(n for _, n in seqs)
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    return {
        "q": torch.randn(num_tokens, args.num_heads, args.head_dim, generator=gen).to(dtype),
        "k": torch.randn(num_tokens, args.num_kv_heads, args.head_dim, generator=gen).to(dtype),
        "v": torch.randn(num_tokens, args.num_kv_heads, args.head_dim, generator=gen).to(dtype),
        "k_cache": torch.randn(shape, generator=gen).to(dtype),
        "v_cache": torch.randn(shape, generator=gen).to(dtype),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "block_tables": torch.tensor(tables, dtype=torch.int32),
        "seq_lens": torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
    }


def time_ms(fn, iters: int, repeats: int) -> float:
    """Best-of-`repeats` mean over `iters` calls: the machine is shared, the minimum is stable."""
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_options(
        parser, batch=64, context=192, prefill_len=128, num_heads=9, num_kv_heads=3, head_dim=64,
        block_size=16,
    )  # fmt: skip
    parser.add_argument("--num-layers", type=int, default=30, help="for the per-step estimate")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--scenarios", default="decode,prefill,mixed")
    parser.add_argument(
        "--backends", default="cpu,torch", help="comma-separated; the last is the ratio's base"
    )
    add_int_options(parser, iters=10, repeats=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--from-memory",
        action="store_true",
        help="a cache per layer, as in a model, so that a step's K/V come from memory: times the "
        "attention of all --num-layers layers in turn (attn ms: their mean)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    rng = random.Random(1)
    spread = args.context // 4
    decode = [
        (rng.randint(args.context - spread, args.context + spread) - 1, 1)
        for _ in range(args.batch)
    ]
    scenarios = {
        "decode": decode,
        "prefill": [(0, args.prefill_len)] * args.batch,
        "mixed": decode[: args.batch - 1] + [(0, args.prefill_len)],
    }
    scale = 1 / math.sqrt(args.head_dim)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{args.num_heads} q heads / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, "
        f"block {args.block_size}; backends {args.backends}"
    )
    backends = [kernels.get_backend(kernels.resolve_backend(b, torch.device("cpu")))
                for b in args.backends.split(",")]  # fmt: skip
    base = args.backends.split(",")[-1]
    print(
        f"{'scenario':<9} {'dtype':<5} {'backend':<7} {'tokens':>6} {'cache ms':>9} "
        f"{'attn ms':>9} {'x' + str(args.num_layers) + ' layers ms':>15} {base + ' / this':>12}"
    )
    for name in args.scenarios.split(","):
        seqs = scenarios[name]
        for dtype_name in args.dtypes.split(","):
            t = build(seqs, args, DTYPES[dtype_name])
            out = torch.empty_like(t["q"])
            layers = [(t["k_cache"], t["v_cache"])]
            if args.from_memory:  # the other layers' caches: copies, the same keys and values
                layers += [(k.clone(), v.clone()) for k, v in layers * (args.num_layers - 1)]

            results = []
            for ops in backends:

                def write(t=t, ops=ops) -> None:
                    ops.reshape_and_cache(
                        t["k"], t["v"], t["k_cache"], t["v_cache"], t["slot_mapping"]
                    )

                def attend(t=t, out=out, ops=ops, layers=layers) -> None:
                    for k_cache, v_cache in layers:
                        ops.paged_attention(
                            t["q"], k_cache, v_cache, t["block_tables"], t["seq_lens"],
                            t["query_start_loc"], scale, out=out,
                        )  # fmt: skip

                write()
                cache_ms = time_ms(write, args.iters, args.repeats)
                attn_ms = time_ms(attend, args.iters, args.repeats) / len(layers)
                results.append((cache_ms, attn_ms, args.num_layers * (cache_ms + attn_ms)))
            for backend, (cache_ms, attn_ms, step_ms) in zip(
                args.backends.split(","), results, strict=True
            ):
                print(
                    f"{name:<9} {dtype_name:<5} {backend:<7} {t['q'].shape[0]:>6} "
                    f"{cache_ms:>9.3f} {attn_ms:>9.3f} {step_ms:>15.1f} "
                    f"{results[-1][1] / attn_ms:>11.2f}x"
                )


if __name__ == "__main__":
    main()
