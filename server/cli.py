"""`pagedserve` command line: serve, generate, kv-plan, and bench (throughput, serve, soak).

The engine flags come from `EngineConfig`'s fields, the server's from `ServerConfig`'s
(engine/options.py). `bench` is
parsed by `bench.cli`, imported only when that command runs: the server never loads the
benchmarks or their dependencies.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap
from pagedserve.engine.engine_config import DTYPES, EngineConfig
from pagedserve.engine.tp_endpoint import TPEndpoint
from pagedserve.server.server_config import ServerConfig


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM.from_config(args.config_cls.from_cli_args(args))
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
    from pagedserve.engine.models.model_source import resolve_model
    from pagedserve.engine.worker.kv_cache import kv_plan_report

    if args.num_seqs < 1:
        raise ValueError(f"--num-seqs must be >= 1, got {args.num_seqs}")
    options = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )
    config = resolve_model(options.model.model).config
    # A plan is arithmetic: lengths past the model's context are planned too, with a note (a
    # server refuses them).
    max_model_len = options.model.max_model_len or config.max_position_embeddings
    report = kv_plan_report(
        options.model.model,
        config,
        options.cache.torch_kv_cache_dtype(DTYPES[args.dtype]),
        args.num_seqs,
        max_model_len,
        args.block_size,
        options.parallel.tensor_parallel_size,
    )
    print(report)
    if options.lora.enable_lora:
        from pagedserve.engine.lora.adapter import lora_slot_bytes
        from pagedserve.engine.models.parallel import plan_shards

        itemsize = DTYPES[args.dtype].itemsize
        tp = options.parallel.tensor_parallel_size
        # With tensor parallelism each rank holds its slice's slots; rank 0's is the largest.
        rank_config = config if tp == 1 else plan_shards(config, tp)[0].local_config(config)
        lora_bytes = lora_slot_bytes(
            rank_config, options.lora.max_loras, options.lora.max_lora_rank, itemsize
        )
        per_rank = "" if tp == 1 else " per rank"
        lora = options.lora
        print(
            f"LoRA slots: {lora.max_loras} adapters up to rank {lora.max_lora_rank}, "
            f"{lora_bytes} bytes ({lora_bytes / 2**20:.1f} MiB){per_rank} in {args.dtype} "
            "beside the weights (on a GPU the KV cache gets what they leave)"
        )
    if max_model_len > config.max_position_embeddings:
        print(
            f"note: {max_model_len} tokens exceed the model's context length "
            f"{config.max_position_embeddings}; `serve` would refuse this --max-model-len"
        )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.api_server import run_server

    server = ServerConfig.from_cli_args(args)
    config = args.config_cls.from_cli_args(args)
    endpoint = TPEndpoint.from_torchrun()
    if endpoint is not None:  # every rank of a tensor-parallel engine started by torchrun
        if server.data_parallel_size != 1:
            raise ValueError("--data-parallel-size is not for torchrun: its ranks are one engine")
        if endpoint.rank != 0:  # only rank 0 serves HTTP; the others run its steps
            from pagedserve.engine.worker.tp_worker import run_worker

            run_worker(config, endpoint)
            return 0
    run_server(config, server, log_level=args.log_level)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        from pagedserve.bench.cli import main as bench_main
    except ModuleNotFoundError as e:
        raise ValueError(
            f"{e}: the benchmarks' dependencies come with pip install 'pagedserve[bench]'"
        ) from e
    return bench_main(args.bench_args)


def build_parser(config_cls: type[EngineConfig] = EngineConfig) -> argparse.ArgumentParser:
    """The `pagedserve` parser; `config_cls` (EngineConfig or a subclass) supplies the engine
    flags of `serve` and `generate`."""
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(config_cls=config_cls)
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    ServerConfig.add_cli_args(srv, groups=config_cls.add_cli_args(srv))
    srv.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    config_cls.add_cli_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=_cmd_generate)

    plan = sub.add_parser("kv-plan", help="KV-cache bytes for a model and workload")
    config_cls.add_cli_args(
        plan,
        names=(
            "model",
            "max_model_len",
            "block_size",
            "kv_cache_dtype",
            "tensor_parallel_size",
            "enable_lora",
            "max_loras",
            "max_lora_rank",
        ),  # fmt: skip
    )
    plan.add_argument("--num-seqs", type=int, required=True, help="sequences held at once")
    plan.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    plan.set_defaults(func=_cmd_kv_plan)

    # Everything after `bench` goes to bench.cli (see main).
    bench = sub.add_parser(
        "bench",
        help="benchmarks: `bench throughput` (offline), `bench serve` (load-test a server), "
        "`bench soak` (mixed, dropped and invalid requests, then leak checks)",
        add_help=False,
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None, config_cls: type[EngineConfig] = EngineConfig) -> int:
    parser = build_parser(config_cls)
    # parse_known_args: `pagedserve bench --help` must reach bench's parser, not this one.
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = unknown + args.bench_args
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    # A process-wide allocator setting: the command line's to make, not the engine's (a library
    # object someone may embed). Why it matters on CPU: engine/cpu_allocator.py.
    keep_large_allocations_in_heap()
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def console_main() -> int:
    """The `pagedserve` command (pyproject's script): `main`, then the exit."""
    try:
        return main()
    finally:
        # The process is about to exit: its last collections need not walk every object torch
        # and transformers made (0.6-0.9 s of each exit on the 2-core dev VM, 0.1 s so). Not
        # where Triton is loaded (a GPU run in one process): its bindings report objects that
        # outlive the interpreter as leaks.
        if "triton" not in sys.modules:
            gc.freeze()


if __name__ == "__main__":
    sys.exit(console_main())
