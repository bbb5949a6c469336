"""`pagedserve bench`: throughput (offline), serve (load-test a running server), soak (many
mixed, partly invalid or dropped requests against a running server, then leak checks) and
quality (a server's agreement with the model's own float32 values).

`pagedserve bench ...` hands its arguments here, importing this module only then, so that
nothing outside bench/ loads the benchmarks or their dependencies (the `bench` extra).
"""

from __future__ import annotations

import argparse

from pagedserve.bench import quality, serve, soak, throughput
from pagedserve.engine.engine_config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench_command", required=True)
    tp = sub.add_parser("throughput", help="offline throughput with random-token prompts")
    EngineConfig.add_cli_args(tp)
    throughput.add_arguments(tp)
    tp.set_defaults(func=throughput.run)
    bs = sub.add_parser("serve", help="load-test a running server, like vllm bench serve")
    serve.add_arguments(bs)
    bs.set_defaults(func=serve.run)
    sk = sub.add_parser(
        "soak", help="mixed, partly invalid or dropped requests, then checks for leaks"
    )
    soak.add_arguments(sk)
    sk.set_defaults(func=soak.run)
    qa = sub.add_parser(
        "quality", help="a server's top-1 agreement with the model's own float32 values"
    )
    quality.add_arguments(qa)
    qa.set_defaults(func=quality.run)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    # The soak test's verdict is the exit status; the benchmarks have none.
    return 1 if result.get("passed") is False else 0
