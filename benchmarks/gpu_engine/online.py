"""online: `pagedserve serve` and `pagedserve bench serve` at several concurrencies, against
offline `LLM.generate` on the same requests (offline_serve_worker, in a subprocess)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_engine import harness

ONLINE_TARGET_RATIO = 0.9


def write_wordlevel_tokenizer(folder: Path, vocab_size: int) -> str:
    """A tokenizer whose token i is "t{i}" (decoded with spaces between), for an engine version
    that serves a model without a tokenizer of its own with none: the server streams text only,
    so per-token timing needs one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)
    return str(folder)


def tokenizer_args(model: str, scratch: Path) -> list[str]:
    """[] when the engine gives the model a tokenizer, else --tokenizer with a word-level one."""
    from pagedserve.engine.models.model_source import resolve_model
    from pagedserve.engine.models.tokenizer import load_tokenizer

    source = resolve_model(model)
    if load_tokenizer(source) is not None:
        return []
    folder = write_wordlevel_tokenizer(scratch / "wordlevel-tokenizer", source.config.vocab_size)
    return ["--tokenizer", folder]


def offline_serve_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Offline `LLM.generate` on exactly the requests `bench serve` sends with --seed: random
    ids from bench.serve, greedy, ignore_eos, all at once. Printed as one JSON line."""
    from pagedserve.bench import serve as bench_serve
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=args.max_model_len,
        kv_cache_memory=None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30),
    )
    prompts = bench_serve.random_token_ids(args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = bench_serve.random_token_ids(17, args.input_len, args.seed + 10**6)
    for size in (1, 16, 17):
        llm.generate(warm[:size], params.clone(max_tokens=4))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_prompts": args.num_prompts,
        "elapsed_s": round(elapsed, 3),
        "num_output_tokens": num_out,
        "output_throughput": round(num_out / elapsed, 2),
        **harness.engine_info(llm),
    }


def _bench_serve(base_url: str, argv: list[str]) -> dict[str, Any]:
    from pagedserve.bench import serve as bench_serve

    return bench_serve.run(bench_serve.parse_args(["--base-url", base_url, *argv]))


ONLINE_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "total_output_tokens",
)


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def step_online(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    from pagedserve.server.launch import DEFAULT_COMMAND, server_process

    model = harness.model_path(args.model, args.scratch)
    max_model_len = sizes.online_input_len + sizes.online_output_len + 256
    last_seed = len(sizes.online_runs)  # run i uses seed i + 1: no prefix-cache hits across runs
    top_concurrency, top_requests = sizes.online_runs[-1]
    base = {
        "model": args.model,
        "dtype": sizes.dtype,
        "input_len": sizes.online_input_len,
        "output_len": sizes.online_output_len,
    }

    offline: dict[str, Any] | None = None
    with rec.part(**base, kind="offline"):
        cmd = [
            sys.executable, "-m", "benchmarks.gpu_engine", "offline-serve-worker",
            "--model", model,
            "--device", sizes.device,
            "--dtype", sizes.dtype,
            "--num-prompts", str(top_requests),
            "--input-len", str(sizes.online_input_len),
            "--output-len", str(sizes.online_output_len),
            "--seed", str(last_seed),
            "--max-model-len", str(max_model_len),
        ]  # fmt: skip
        if sizes.kv_cache_gib is not None:
            cmd += ["--kv-cache-gib", str(sizes.kv_cache_gib)]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=harness.REPO)
        if done.returncode != 0:
            raise RuntimeError(f"offline worker failed:\n{done.stderr[-3000:]}")
        offline = json.loads(done.stdout.strip().splitlines()[-1])
        rec.write({**base, "kind": "offline", "seed": last_seed, **offline})

    with rec.part(**base, kind="server"):
        serve_args = [
            "--model", model,
            "--load-format", "dummy",
            "--device", sizes.device,
            "--dtype", sizes.dtype,
            "--max-model-len", str(max_model_len),
            "--no-access-log",
            *tokenizer_args(model, args.scratch),
        ]  # fmt: skip
        if sizes.kv_cache_gib is not None:
            serve_args += ["--kv-cache-memory", str(sizes.kv_cache_gib)]
        log = args.out / "online_server.log"
        with server_process(serve_args, log, command=DEFAULT_COMMAND, timeout=300) as url:
            common = [
                "--input-len", str(sizes.online_input_len),
                "--output-len", str(sizes.online_output_len),
                "--timeout", "300",
            ]  # fmt: skip
            # Warm-up on other prompts: first-request costs, and Triton's compiles for the
            # batch sizes (1, 16, 17) a run meets, must not be timed.
            for warm in (1, 17):
                _bench_serve(url, [*common, "--num-prompts", str(warm), "--seed", str(10**6)])
            for i, (concurrency, num_requests) in enumerate(sizes.online_runs):
                with rec.part(**base, kind="serve", max_concurrency=concurrency):
                    argv = [
                        *common,
                        "--num-prompts", str(num_requests),
                        "--max-concurrency", str(concurrency),
                        "--seed", str(i + 1),
                    ]  # fmt: skip
                    cpu0 = time.process_time()
                    result = _bench_serve(url, argv)
                    client_cpu = time.process_time() - cpu0
                    record = {
                        **base,
                        "kind": "serve",
                        "max_concurrency": concurrency,
                        "num_requests": num_requests,
                        "seed": i + 1,
                        **{k: _round(result.get(k)) for k in ONLINE_KEYS},
                        # Near 1: the Python client, not the server, set the pace.
                        "client_cpu_fraction": round(client_cpu / result["duration"], 3),
                    }
                    if concurrency == top_concurrency and offline is not None:
                        ratio = result["output_throughput"] / offline["output_throughput"]
                        record["offline_output_throughput"] = offline["output_throughput"]
                        record["ratio_online_to_offline"] = round(ratio, 3)
                        record["target_ratio"] = ONLINE_TARGET_RATIO
                        record["meets_target"] = ratio >= ONLINE_TARGET_RATIO
                    rec.write(record)
