"""`pagedserve` command line: serve, generate, kv-plan, bench throughput, bench serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

GiB = 1 << 30


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="local HF folder, .gguf file, smollm2-135m-instruct (embedded), or for random "
        "weights a config.json file or built-in shape (llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b, "
        "smollm2-135m)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument(
        "--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"]
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="KV cache budget in GiB (default on CPU: min(4, RAM/4))",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="paged attention kernels: triton (default on CUDA) or torch (default on CPU); "
        "auto also reads $PAGEDSERVE_ATTENTION_BACKEND",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: share of GPU memory for weights, activations, CUDA graphs and the KV cache "
        "(the KV cache gets what the profiling step leaves); ignored on CPU",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    p.add_argument(
        "--max-cuda-graph-batch-size",
        type=int,
        default=None,
        help="largest decode batch captured as a CUDA graph (default: --max-num-seqs, <= 512)",
    )
    p.add_argument("--seed", type=int, default=0)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "load_format": args.load_format,
        "device": args.device,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": None
        if args.kv_cache_memory is None
        else int(args.kv_cache_memory * GiB),
        "enable_prefix_caching": not args.no_prefix_caching,
        "attention_backend": args.attention_backend,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        "max_cuda_graph_batch_size": args.max_cuda_graph_batch_size,
        "seed": args.seed,
    }


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def _cmd_kv_plan(args: argparse.Namespace) -> int:
    from engine.config import ModelConfig
    from engine.engine_config import DTYPES
    from engine.kv_cache import dtype_bytes
    from engine.model_source import resolve_model

    config: ModelConfig = resolve_model(args.model).config
    s = dtype_bytes(DTYPES[args.dtype])
    L, H, D = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    per_layer = 2 * H * D * s
    per_token = L * per_layer
    B, T = args.num_seqs, args.max_model_len
    total = 2 * B * L * T * H * D * s
    blocks_per_seq = -(-T // args.block_size)
    print(
        f"model: {args.model} ({config.architecture}), {L} layers, {H} KV heads, head_dim {D}, "
        f"dtype {args.dtype} ({s} bytes)"
    )
    print(f"per layer per token: 2 x {H} x {D} x {s} = {per_layer} bytes (K and V)")
    print(f"per token: {L} layers x {per_layer} = {per_token} bytes ({per_token / 1024:.1f} KiB)")
    print(
        f"total for {B} sequences x {T} tokens: M = 2*B*L*T*H_kv*D*s = 2*{B}*{L}*{T}*{H}*{D}*{s} "
        f"= {total} bytes ({total / GiB:.3f} GiB)"
    )
    print(
        f"blocks: {blocks_per_seq} per sequence of block_size {args.block_size}, "
        f"{blocks_per_seq * B} in all"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from engine.engine_config import EngineConfig
    from server.api_server import run_server

    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {args.max_queue_len}")
    run_server(
        EngineConfig(**_engine_kwargs(args)),
        host=args.host,
        port=args.port,
        served_model_names=args.served_model_name,
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        log_level=args.log_level,
        access_log=not args.no_access_log,
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench import throughput

    throughput.run(args, _engine_kwargs(args))
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from bench import serve

    serve.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in `model` (default: the --model value)",
    )
    srv.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDSERVE_API_KEY)",
    )
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="answer 503 while this many requests wait to be scheduled (default: no limit)",
    )
    srv.add_argument("--no-access-log", action="store_true")
    srv.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_engine_arguments(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=_cmd_generate)

    plan = sub.add_parser("kv-plan", help="KV-cache bytes for a model and workload")
    plan.add_argument("--model", default="smollm2-135m-instruct")
    plan.add_argument("--max-model-len", type=int, required=True)
    plan.add_argument("--num-seqs", type=int, required=True)
    plan.add_argument("--dtype", default="bfloat16")
    plan.add_argument("--block-size", type=int, default=16)
    plan.set_defaults(func=_cmd_kv_plan)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput with random-token prompts")
    _add_engine_arguments(tp)
    from bench import throughput

    throughput.add_arguments(tp)
    tp.set_defaults(func=_cmd_bench)
    bs = bench_sub.add_parser("serve", help="load-test a running server, like vllm bench serve")
    from bench import serve

    serve.add_arguments(bs)
    bs.set_defaults(func=_cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
