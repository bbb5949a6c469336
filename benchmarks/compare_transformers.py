"""pagedserve against transformers on the same prompts, each engine in a fresh subprocess:

    python -m benchmarks.compare_transformers --num-prompts 64 --input-len 128 \
        --output-len 64 --dtypes float32 bfloat16 --json bench_results/compare.json

    python -m benchmarks.compare_transformers --model llama-3.2-1b --load-format dummy \
        --device cuda --dtypes bfloat16 --num-prompts 256 --input-len 512 --output-len 256 \
        --engines pagedserve transformers transformers-static --transformers-num-prompts 64

Engines (--engines):
  pagedserve           `LLM.generate` through `bench.throughput.measure` (what `pagedserve bench
                       throughput` times)
  transformers         transformers' continuous batching, `model.generate_batch`
  transformers-static  plain `model.generate` on padded-free static batches of
                       --static-batch-size prompts (all prompts have the same length)

All sample with temperature 1 (no top-k/top-p), ignore EOS and produce exactly output-len tokens
per prompt. The model is the embedded SmolLM2 GGUF file by default (both engines load it), or a
built-in shape / config folder with `--load-format dummy`: pagedserve draws its dummy weights and
transformers' model gets the same ones (`engine.models.weights.dummy_weights`, seed 0). Each
measurement runs in a fresh subprocess, so neither engine's threads, allocator or GPU memory can
slow the other down. generate_batch may run on the first --transformers-num-prompts prompts only (it
is slow); rates are per second either way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.options import add_int_options, flags
from pagedserve.bench.throughput import measure, random_token_prompts
from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap
from pagedserve.engine.models.hf_config import hf_dict_of
from pagedserve.engine.models.model_source import resolve_model
from pagedserve.scheduler.utils import cdiv

ENGINES = ("pagedserve", "transformers", "transformers-static")
# Row keys of each engine's output tokens/s (the first two are the historical names).
RATE_KEYS = {
    "pagedserve": "pagedserve_output_tok_s",
    "transformers": "transformers_generate_batch_output_tok_s",
    "transformers-static": "transformers_generate_output_tok_s",
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_pagedserve(
    prompts: list[list[int]], output_len: int, dtype: str, model: str, **engine_kwargs: Any
) -> dict[str, Any]:
    from pagedserve.engine import LLM

    keep_large_allocations_in_heap()  # as `pagedserve` does; transformers' worker runs without
    engine_kwargs.setdefault("device", "cpu")
    llm = LLM(model, dtype=dtype, **engine_kwargs)
    # No per-request seeds: transformers' requests have none either (and a seeded row costs the
    # sampler a host-side generator per step).
    result = measure(llm, prompts, output_len, seed=None)
    assert result["num_output_tokens"] == len(prompts) * output_len, result
    return {
        "output_tokens_per_s": result["output_tokens_per_s"],
        "num_prompts": len(prompts),
        "num_output_tokens": result["num_output_tokens"],
        "elapsed_s": result["elapsed_s"],
        "num_preemptions": result["num_preemptions"],
        "kv_cache_blocks": llm.engine.core.worker.kv_plan.num_blocks,
    }


def hf_config_for(config) -> Any:
    """transformers' config for an engine `ModelConfig`, with no EOS or BOS: generation must not
    stop early (our runs ignore EOS), and nothing else in the forward pass reads them."""
    from transformers import AutoConfig

    d = hf_dict_of(config)
    d.update(eos_token_id=None, bos_token_id=None, pad_token_id=None)
    d.pop("architectures", None)
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


def hf_model_from_weights(config, weights, dtype: torch.dtype, device: str):
    """transformers' `*ForCausalLM` for an engine `ModelConfig`, on `device` in `dtype`, loaded
    from `(name, tensor)` pairs in Hugging Face naming (e.g. `dummy_weights(config)`).

    Built under `dtype` as default (as `from_pretrained(dtype=...)` does), so buffers such as the
    rotary inverse frequencies keep the float32 values transformers computes for them."""
    from transformers import AutoModelForCausalLM

    hf_config = hf_config_for(config)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    state = {name: tensor for name, tensor in weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = config.tie_word_embeddings
    # Tied embeddings: lm_head.weight is the embedding matrix, which was loaded.
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(
            f"weights do not fit transformers' model: missing {missing}, extra {unexpected}"
        )
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    return model.eval()


def load_hf_model(model: str, dtype: str, device: str, load_format: str):
    """transformers' model for `--model`: from the GGUF file, a folder's safetensors, or (dummy
    load format or a built-in shape) the engine's dummy weights."""
    from transformers import AutoModelForCausalLM

    from pagedserve.engine.models.weights import dummy_weights

    source = resolve_model(model)
    torch_dtype = getattr(torch, dtype)
    if load_format == "dummy" or source.kind == "dummy":
        return hf_model_from_weights(
            source.config, dummy_weights(source.config, torch_dtype), torch_dtype, device
        )
    if source.kind == "gguf":
        path = source.gguf_file
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch_dtype, trust_remote_code=False
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(
            source.path, dtype=torch_dtype, trust_remote_code=False
        )
    return hf.to(device).eval()


def _sampling_config(output_len: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=output_len,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )


def _cpu_cache_kwargs(prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """On the CPU, a `generate_batch` cache sized for the workload: left alone, transformers
    sizes it from the machine's whole RAM (0.9 of it), which a shared machine may not have. On a
    GPU its own sizing (a share of free memory, in a fresh process) is what we compare with."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # older transformers take the sizes on GenerationConfig
        return {}
    defaults = ContinuousBatchingConfig()
    # The page size is `page_size` in transformers 5.24, `block_size` in 5.17 (the GPU machine).
    page = getattr(defaults, "page_size", None) or defaults.block_size
    num_blocks = sum(cdiv(len(p) + output_len, page) for p in prompts) + 4
    return {
        "continuous_batching_config": ContinuousBatchingConfig(
            num_blocks=num_blocks, max_batch_tokens=max(256, max(map(len, prompts)))
        )
    }


def run_transformers(
    prompts: list[list[int]], output_len: int, hf, device: str = "cpu"
) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`) on all prompts at once."""
    from transformers import GenerationConfig

    cache = _cpu_cache_kwargs(prompts, output_len) if device == "cpu" else {}
    hf.generate_batch(
        [p[::-1] for p in prompts[:2]],
        generation_config=GenerationConfig(
            max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0
        ),
        **cache,
    )  # warm-up
    _sync(device)
    start = time.perf_counter()
    outs = hf.generate_batch(prompts, generation_config=_sampling_config(output_len), **cache)
    _sync(device)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outs.values())
    return _run_record(prompts, output_len, num_out, elapsed)


def run_transformers_static(
    prompts: list[list[int]], output_len: int, hf, device: str = "cpu", batch_size: int = 64
) -> dict[str, Any]:
    """Plain `model.generate` on batches of `batch_size` prompts, one after the other. The
    prompts all have one length, so a batch needs no padding (and no attention-mask games)."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("transformers-static needs prompts of one length (no padding)")
    config = _sampling_config(output_len)
    with torch.inference_mode():
        warm = torch.tensor([p[::-1] for p in prompts[:2]], device=device)
        hf.generate(
            input_ids=warm,
            attention_mask=torch.ones_like(warm),
            generation_config=_sampling_config(2),
        )
        _sync(device)
        start = time.perf_counter()
        num_out = 0
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size], device=device)
            out = hf.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            num_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        _sync(device)
        elapsed = time.perf_counter() - start
    return {**_run_record(prompts, output_len, num_out, elapsed), "batch_size": batch_size}


def _run_record(
    prompts: list[list[int]], output_len: int, num_out: int, elapsed: float
) -> dict[str, Any]:
    """A transformers run's record; every prompt must have had all its `output_len` tokens."""
    assert num_out == len(prompts) * output_len, num_out
    return {
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "num_prompts": len(prompts),
        "num_output_tokens": num_out,
        "elapsed_s": round(elapsed, 3),
    }


def _worker(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    dtype = args.dtypes[0]
    if args.worker == "pagedserve":
        kwargs: dict[str, Any] = {"device": args.device, "load_format": args.load_format}
        if args.max_model_len is not None:
            kwargs["max_model_len"] = args.max_model_len
        if args.num_kv_blocks is not None:
            kwargs["num_kv_blocks"] = args.num_kv_blocks
        return run_pagedserve(prompts, args.output_len, dtype, args.model, **kwargs)
    hf = load_hf_model(args.model, dtype, args.device, args.load_format)
    if args.worker == "transformers":
        prompts = prompts[: args.transformers_num_prompts or len(prompts)]
        return run_transformers(prompts, args.output_len, hf, args.device)
    return run_transformers_static(
        prompts, args.output_len, hf, args.device, args.static_batch_size
    )


# What the parent hands its worker, beside the engine and the dtype.
WORKER_OPTIONS = (
    "model", "load_format", "device", "num_prompts", "input_len", "output_len", "seed",
    "static_batch_size", "transformers_num_prompts", "max_model_len", "num_kv_blocks",
)  # fmt: skip


def measure_in_subprocess(engine: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine's measurement (the worker's JSON) in a fresh Python; `args` from
    build_parser()."""
    cmd = [sys.executable, "-m", "benchmarks.compare_transformers", "--worker", engine]
    cmd += flags(dtypes=dtype, **{name: getattr(args, name) for name in WORKER_OPTIONS})
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{engine} ({dtype}) failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def comparison_row(dtype: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each engine's output tok/s and pagedserve's ratio to each transformers engine measured."""
    row: dict[str, Any] = {"dtype": dtype}
    for engine, run in runs.items():
        row[RATE_KEYS[engine]] = round(run["output_tokens_per_s"], 1)
    ours = runs.get("pagedserve")
    for engine, key in (("transformers", "ratio"), ("transformers-static", "ratio_vs_static")):
        if ours is not None and engine in runs:
            row[key] = round(ours["output_tokens_per_s"] / runs[engine]["output_tokens_per_s"], 2)
    row["runs"] = runs
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    add_int_options(parser, num_prompts=64, input_len=128, output_len=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=["pagedserve", "transformers"],
        help="what to measure; ratios are pagedserve's rate over each other engine's",
    )
    parser.add_argument(
        "--transformers-num-prompts", type=int, default=None,
        help="generate_batch runs on the first N prompts only (default: all)",
    )  # fmt: skip
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None, help="pagedserve's")
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None,
        help="pagedserve's KV cache (default: sized by the engine)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure, print one JSON row per dtype, write the report if --json; return the rows."""
    args = build_parser().parse_args(argv)
    vocab = resolve_model(args.model).config.vocab_size
    prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, args.seed, {2})
    if args.worker is not None:  # one measurement, printed as the last line
        print(json.dumps(_worker(args, prompts)))
        return []

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes:
        runs = {engine: measure_in_subprocess(engine, dtype, args) for engine in args.engines}
        row = comparison_row(dtype, runs)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "device": args.device,
        "workload": f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out",
        "threads": torch.get_num_threads(),
        "results": results,
    }
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return results


if __name__ == "__main__":
    main()
