"""The engine on an H200: correctness, decode step time, profile, offline and online
throughput, speculative decoding and shared blocks, as steps of one script.
`bench/gpu_engine.sh` runs them in order, each under its own time limit.

`python -m pagedserve.bench.gpu_engine STEP`, STEP one of:

    env          versions, GPU, commit
    correctness  greedy tokens against transformers' (fp32 exact, bf16
                 counted), CUDA graphs against eager
    decode       decode step time at batch 1 and 256 with ~1k context,
                 graphs and eager, against the memory roofline; the
                 host-time split of a step; a profiler summary
    offline      pagedserve against transformers' generate_batch and
                 generate (bench.compare_transformers)
    nano --model M   nano-vllm's workload (`pagedserve bench throughput`)
    online       `pagedserve serve` + `pagedserve bench serve` at
                 concurrency 1, 64 and 256, and offline on the same
                 requests
    spec         speculative decoding by prompt lookup against plain
                 decoding (speed, acceptance, equal greedy tokens);
                 n = 4 samples on shared blocks against 4 requests
    summary      a table of everything under --out

Each step appends JSON lines to OUT/<step>.jsonl (and prints them); OUT is --out, else $OUT,
else bench/results/gpu_engine. A part that fails writes a record with "error" and the step goes
on with the next part (exit status 1 at the end).

--smoke runs the same code on the CPU with a tiny Llama config and tiny sizes, so that the GPU
minutes go to measuring, not debugging (tests/bench/test_gpu_engine_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.scheduler.utils import cdiv

REPO = Path(__file__).resolve().parents[1]
STEPS = (
    "env", "correctness", "decode", "offline", "nano", "online", "spec", "moe", "structured",
    "kvcap", "tp", "whisper", "summary",
)  # fmt: skip
# Steps the default run of bench/gpu_engine.sh leaves out (its limits fill one device command):
# `ONLY=moe bash bench/gpu_engine.sh` runs them; the summary lists them when they have records.
OPTIONAL_STEPS = ("moe", "structured", "kvcap", "tp", "whisper")

# H200: ~4.3 TB/s measured copy bandwidth (GPU.md); the roofline of a decode step is the bytes it
# must read (weights and the KV cache) at this rate.
PEAK_BANDWIDTH = 4.3e12
DECODE_TARGET_MS_BATCH_1 = 0.9
ONLINE_TARGET_RATIO = 0.9

# A tiny Llama for the correctness check on the GPU and for every --smoke step.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    # bench serve draws prompt ids from [1000, 10000): the tiny vocabulary must hold them.
    "vocab_size": 16384,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
TINY = "tiny"

# A tiny Qwen3-MoE (8 experts, 2 per token) for the MoE correctness check and its smoke run.
TINY_QWEN3_MOE: dict[str, Any] = {
    **TINY_LLAMA,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
}
# The throughput model: Qwen3-30B-A3B's layer (128 experts of 768, 8 per token, hidden 2048)
# with fewer layers, so that its dummy weights are drawn in seconds (the per-layer cost is the
# model's own; the whole model has 48 layers).
MOE_THROUGHPUT_LAYERS = 4

# Output tok/s of nano-vllm's bench.py workload (256 requests, 100-1024 tokens in and out, seed 0:
# 133,966 output tokens) on one A800-SXM4-80GB, real weights, from
# https://github.com/cosmoliu2002/nano-vllm-triton/issues/1 (vLLM 0.10.2). The figure is
# output tokens / time (the sum of every request's max_tokens over the wall time).
NANO_VLLM_OUTPUT_TOKENS = 133_966
NANO_REFERENCE_SOURCE = "https://github.com/cosmoliu2002/nano-vllm-triton/issues/1 (A800)"
NANO_REFERENCE = {
    "qwen2.5-0.5b": {"vllm_0.10.2": 17711.01, "nano_vllm_triton": 24121.31},
    "llama-3.2-1b": {"vllm_0.10.2": 12627.36, "nano_vllm_triton": 15068.15},
}


@dataclass(frozen=True)
class Sizes:
    """How much each step does: the H200 run, or the CPU smoke run."""

    device: str
    dtype: str  # of the speed steps (correctness runs float32 and bfloat16)
    correctness_models: tuple[str, ...]
    correctness_prompt_lens: tuple[int, ...]
    correctness_tokens: int
    decode_batch_sizes: tuple[int, ...]
    decode_prompt_len: int
    decode_max_batched_tokens: int
    decode_steps: int
    split_steps: int
    profile_steps: int
    offline_prompts: int
    offline_input_len: int
    offline_output_len: int
    offline_transformers_prompts: int
    offline_static_batch: int
    nano_prompts: int
    nano_input_range: tuple[int, int]
    nano_output_range: tuple[int, int]
    nano_max_batched_tokens: int
    online_input_len: int
    online_output_len: int
    online_runs: tuple[tuple[int, int], ...]  # (max concurrency, number of requests)
    # KV cache of the single-engine steps (nano, online) in GiB; None: the engine sizes it
    # (--gpu-memory-utilization on a GPU; on a CPU 4 GiB, too much for a tiny smoke model).
    kv_cache_gib: float | None
    # spec: prompts that repeat a random pattern of spec_pattern_len ids up to spec_prompt_len,
    # spec_output_len greedy tokens each; spec_batch_sizes: how many prompts per generate call.
    spec_prompts: int
    spec_pattern_len: int
    spec_prompt_len: int
    spec_output_len: int
    spec_batch_sizes: tuple[int, ...]


GPU_SIZES = Sizes(
    device="cuda",
    dtype="bfloat16",
    correctness_models=(TINY, "llama-3.2-1b"),
    correctness_prompt_lens=(1, 5, 16, 17, 63, 128, 300, 700),
    correctness_tokens=32,
    decode_batch_sizes=(1, 256),
    decode_prompt_len=1024,
    decode_max_batched_tokens=16384,
    decode_steps=50,
    split_steps=20,
    profile_steps=10,
    offline_prompts=256,
    offline_input_len=512,
    offline_output_len=256,
    offline_transformers_prompts=64,
    offline_static_batch=256,
    nano_prompts=256,
    nano_input_range=(100, 1024),
    nano_output_range=(100, 1024),
    nano_max_batched_tokens=16384,
    online_input_len=512,
    online_output_len=128,
    online_runs=((1, 16), (64, 256), (256, 512)),
    kv_cache_gib=None,
    spec_prompts=16,
    spec_pattern_len=32,
    spec_prompt_len=256,
    # At batch 1 the 16 prompts run one after the other, 1024 tokens each way: ~2-5 s per
    # engine on an H200, which the step's 45 s limit affords beside start-up.
    spec_output_len=64,
    spec_batch_sizes=(1, 16),
)
SMOKE_SIZES = Sizes(
    device="cpu",
    dtype="float32",
    correctness_models=(TINY,),
    correctness_prompt_lens=(1, 5, 16, 17, 33, 40, 2, 9),
    correctness_tokens=8,
    decode_batch_sizes=(1, 4),
    decode_prompt_len=24,
    decode_max_batched_tokens=64,
    decode_steps=4,
    split_steps=3,
    profile_steps=2,
    offline_prompts=4,
    offline_input_len=16,
    offline_output_len=6,
    offline_transformers_prompts=2,
    offline_static_batch=2,
    nano_prompts=6,
    nano_input_range=(4, 24),
    nano_output_range=(2, 8),
    nano_max_batched_tokens=128,
    online_input_len=16,
    online_output_len=6,
    online_runs=((1, 2), (4, 6)),
    kv_cache_gib=0.0625,
    spec_prompts=4,
    spec_pattern_len=6,
    spec_prompt_len=20,
    spec_output_len=16,
    spec_batch_sizes=(1, 2),
)


# ---------------------------------------------------------------------------------------------
# Records and shared helpers
# ---------------------------------------------------------------------------------------------


class Recorder:
    """Appends records to OUT/<step>.jsonl as they come (a later crash keeps the earlier ones)
    and echoes them to stdout; counts the ones that carry an error."""

    def __init__(self, out_dir: Path, step: str, smoke: bool) -> None:
        self.path = out_dir / f"{step}.jsonl"
        self.step = step
        self.smoke = smoke
        self.num_errors = 0

    def write(self, record: dict[str, Any]) -> dict[str, Any]:
        record = {"step": self.step, "smoke": self.smoke, **record}
        line = json.dumps(record, default=_json_default)
        with open(self.path, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)
        return record

    @contextlib.contextmanager
    def part(self, **labels: Any) -> Iterator[None]:
        """Run one independent part; an exception becomes an error record and the step goes on."""
        try:
            yield
        except Exception as e:
            self.num_errors += 1
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            self.write({**labels, "error": f"{type(e).__name__}: {e}"[:2000], "trace": tb[-3000:]})


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def commit_id() -> str:
    """`git rev-parse HEAD` (with "-dirty" for local changes), else the COMMIT file the caller
    may write next to a tree copied without .git, else "unknown"."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    commit_file = REPO / "COMMIT"
    if commit_file.is_file():
        return commit_file.read_text().strip() or "unknown"
    return "unknown"


def write_tiny_model(folder: Path) -> str:
    """A config-only Hugging Face folder for TINY_LLAMA (weights are always dummy)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2))
    return str(folder)


def model_path(name: str, scratch: Path) -> str:
    """What to pass as `model=`: a built-in shape name as is, TINY as a config folder."""
    if name == TINY:
        return write_tiny_model(scratch / "tiny-llama")
    return name


def free_memory() -> None:
    """Give a dropped engine's GPU memory back before the next one sizes its KV cache."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kv_blocks_for(seq_lens: Sequence[int], max_model_len: int) -> int:
    """Enough KV blocks (of the engine's default block size) for all these sequences at once, and
    at least one of max_model_len: steps that run several engines in one process size each cache
    explicitly rather than letting every engine take --gpu-memory-utilization of the GPU."""
    from pagedserve.engine.engine_config import EngineConfig

    block_size = EngineConfig().block_size
    need = sum(cdiv(n, block_size) for n in seq_lens)
    return max(need, cdiv(max_model_len, block_size)) + 16


@contextlib.contextmanager
def reuse_dummy_weights() -> Iterator[dict[str, int]]:
    """Draw each config's dummy weights once per process and hand out copies after that.

    `engine.models.weights.load_weights` draws dummy weights with a CPU generator, ~8 s for the 1B
    shape; the correctness and decode steps build several engines (and transformers models) of
    the same shape. Values are identical to `dummy_weights`' own: float32 draws from seed 0,
    then cast. Yields counters: how many times the engine or we asked, and how many draws ran.
    """
    import torch

    import pagedserve.engine.models.weights as weights

    original = weights.dummy_weights
    cache: dict[tuple[Any, ...], list[tuple[str, torch.Tensor]]] = {}
    stats = {"calls": 0, "draws": 0}

    def cached(config, dtype=torch.float32, seed=0, *, device="cpu"):
        stats["calls"] += 1
        key = (config, seed, str(device))
        if key not in cache:
            stats["draws"] += 1
            cache[key] = list(original(config, torch.float32, seed, device=device))
        for name, tensor in cache[key]:
            yield name, tensor.to(dtype, copy=True)

    weights.dummy_weights = cached
    try:
        yield stats
    finally:
        weights.dummy_weights = original


def engine_info(llm) -> dict[str, Any]:
    """What the engine actually runs with (so a record says whether graphs were on)."""
    engine = llm.engine
    runner = getattr(engine, "runner", None)
    graphs = getattr(runner, "graphs", None)
    plan = getattr(engine, "kv_plan", None)
    return {
        "attention_backend": getattr(engine, "attention_backend", None),
        # On CUDA the default loop schedules step N+1 while step N runs.
        "async_scheduling": getattr(engine, "async_scheduling", None),
        "cuda_graphs": graphs is not None and bool(getattr(graphs, "graphs", None)),
        "graph_batch_sizes": list(getattr(graphs, "batch_sizes", []) or []) or None,
        "kv_cache_blocks": getattr(plan, "num_blocks", None),
        "max_model_len": getattr(engine, "max_model_len", None),
    }


def random_ids(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = 1000 if vocab_size > 2000 else 3
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------------
# env
# ---------------------------------------------------------------------------------------------


def step_env(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    import importlib.util
    import platform

    import torch

    info: dict[str, Any] = {
        "commit": commit_id(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    for module in ("triton", "transformers", "tokenizers", "numpy", "httpx"):
        with contextlib.suppress(Exception):
            info[module] = __import__(module).__version__
    # The GPU machine lacks these unless the .whl/ wheels were installed (gguf, msgspec: the engine
    # imports them).
    info["importable"] = {
        m: importlib.util.find_spec(m) is not None
        for m in ("fastapi", "starlette", "uvicorn", "pydantic", "gguf", "openai", "zmq", "msgspec")
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            num_sms=props.multi_processor_count,
        )
    rec.write(info)


# ---------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------


def transformers_greedy(
    config, prompts: list[list[int]], num_tokens: int, dtype: str, device: str
) -> tuple[list[list[int]], list[Any]]:
    """transformers' greedy tokens (`generate`, do_sample=False, no EOS) one prompt at a time,
    and the logits behind each step's choice ([num_tokens, vocab] per prompt, on the CPU)."""
    import torch

    from pagedserve.bench.compare_transformers import hf_model_from_weights
    from pagedserve.engine.models.weights import dummy_weights

    torch_dtype = getattr(torch, dtype)
    hf = hf_model_from_weights(config, dummy_weights(config, torch_dtype), torch_dtype, device)
    tokens, scores = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            new = out.sequences[0, len(prompt) :].tolist()
            if len(new) != num_tokens:
                raise RuntimeError(f"transformers stopped after {len(new)} of {num_tokens} tokens")
            tokens.append(new)
            scores.append(torch.stack([s[0] for s in out.scores]).float().cpu())
    del hf
    free_memory()
    return tokens, scores


def engine_greedy(
    model: str,
    prompts: list[list[int]],
    num_tokens: int,
    dtype: str,
    device: str,
    enforce_eager: bool,
) -> tuple[list[list[int]], dict[str, Any]]:
    """pagedserve's greedy tokens for all prompts generated together, and the engine's setup."""
    from pagedserve.engine import LLM, SamplingParams

    max_model_len = max(256, cdiv(max(map(len, prompts)) + num_tokens, 256) * 256)
    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        load_format="dummy",
        enforce_eager=enforce_eager,
        max_num_seqs=len(prompts),
        max_model_len=max_model_len,
        num_kv_blocks=kv_blocks_for([len(p) + num_tokens for p in prompts], max_model_len),
    )
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    info = engine_info(llm)
    del llm
    free_memory()
    return [list(o.outputs[0].token_ids) for o in outputs], info


def compare_tokens(
    expected: list[list[int]], got: list[list[int]], scores: list[Any] | None = None
) -> dict[str, Any]:
    """Per prompt: tokens equal up to the first difference (prefix_match) and position by
    position; at the first difference, the reference's logit margin of its token over ours
    (a near-tie, ~1e-5 in fp32, is rounding; a large margin is a bug)."""
    prefix, positionwise, mismatches = [], [], []
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        pairs = list(zip(e, g, strict=False))  # lengths may differ: compare the common part
        first = next((k for k, (a, b) in enumerate(pairs) if a != b), len(pairs))
        prefix.append(first)
        positionwise.append(sum(a == b for a, b in pairs))
        if first < len(e):
            entry: dict[str, Any] = {
                "prompt": i,
                "first_difference": first,
                "reference_token": e[first],
                "engine_token": g[first] if first < len(g) else None,
            }
            if scores is not None and first < len(g):
                row = scores[i][first]
                entry["reference_logit_margin"] = round(float(row[e[first]] - row[g[first]]), 6)
            mismatches.append(entry)
    n = len(expected)
    return {
        "equal": expected == got,
        "num_prompts": n,
        "num_equal_prompts": sum(e == g for e, g in zip(expected, got, strict=True)),
        "prefix_match": prefix,
        "mean_prefix_match": round(sum(prefix) / n, 3),
        "positionwise_match": positionwise,
        "mean_positionwise_match": round(sum(positionwise) / n, 3),
        "mismatches": mismatches,
    }


def step_correctness(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    from pagedserve.engine.models.model_source import resolve_model

    n = sizes.correctness_tokens
    with reuse_dummy_weights() as weight_stats:
        for name in sizes.correctness_models:
            model = model_path(name, args.scratch)
            config = resolve_model(model).config
            rng = random.Random(1234)
            low = 1000 if config.vocab_size > 2000 else 3
            prompts = [
                [rng.randrange(low, config.vocab_size) for _ in range(length)]
                for length in sizes.correctness_prompt_lens
            ]
            base = {"model": name, "num_tokens": n, "prompt_lens": [len(p) for p in prompts]}
            for dtype in ("float32", "bfloat16"):
                ref: tuple[list[list[int]], list[Any]] | None = None
                with rec.part(**base, check=f"{dtype}_transformers"):
                    ref = transformers_greedy(config, prompts, n, dtype, sizes.device)
                runs: dict[bool, list[list[int]]] = {}
                for eager in (False, True):
                    mode = "eager" if eager else "default"
                    with rec.part(**base, check=f"{dtype}_vs_transformers", engine=mode):
                        tokens, info = engine_greedy(
                            model, prompts, n, dtype, sizes.device, enforce_eager=eager
                        )
                        runs[eager] = tokens
                        if ref is not None:
                            rec.write(
                                {
                                    **base,
                                    "check": f"{dtype}_vs_transformers",
                                    "dtype": dtype,
                                    "engine": mode,
                                    **info,
                                    "reference": "transformers generate, greedy, one prompt at "
                                    "a time; ours: all prompts in one batch",
                                    **compare_tokens(ref[0], tokens, ref[1]),
                                }
                            )
                if len(runs) == 2:
                    rec.write(
                        {
                            **base,
                            "check": f"{dtype}_eager_vs_default",
                            "dtype": dtype,
                            **compare_tokens(runs[True], runs[False]),
                        }
                    )
    rec.write({"check": "dummy_weights", **weight_stats})


# ---------------------------------------------------------------------------------------------
# decode step time, host-time split, profile
# ---------------------------------------------------------------------------------------------


class _TimedCall:
    """Stands in for a function or callable object, adding its wall time to a total; every other
    attribute goes to the original."""

    def __init__(self, original: Callable[..., Any], totals: dict[str, float], label: str):
        self._original = original
        self._totals = totals
        self._label = label

    def __call__(self, *a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._original(*a, **kw)
        finally:
            self._totals[self._label] += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


@contextlib.contextmanager
def timed_parts(engine) -> Iterator[tuple[dict[str, float], list[str]]]:
    """Time the parts of `engine.step()` by wrapping them on this engine only (engine files stay
    as they are): schedule, execute (the launch; inside it: prepare_inputs, forward,
    compute_logits, sample) and update_from_output. Parts this engine version does not have are
    reported as missing. Host wall time: the first part that waits for the GPU (reading sampled
    ids) absorbs it."""
    runner = engine.worker.runner
    # "execute" is the launch of a step (prepare, forward, logits, sample: kernels queued); the
    # wait for its sampled ids (StepHandle.result) falls in step_other_ms.
    targets = [
        ("schedule", engine.scheduler, "schedule"),
        ("execute", runner, "launch"),
        ("update", engine.scheduler, "update_from_output"),
        ("execute.prepare_inputs", runner.input_batch, "prepare"),
        ("execute.forward", runner, "_forward"),
        ("execute.compute_logits", runner.model, "compute_logits"),
        ("execute.sample", runner.sampler, "sample"),
    ]
    totals: dict[str, float] = {label: 0.0 for label, _, _ in targets}
    patched, missing = [], []
    for label, owner, name in targets:
        original = getattr(owner, name, None)
        if original is None or not callable(original):
            missing.append(label)
            del totals[label]
            continue
        had_own = name in vars(owner)
        object.__setattr__(owner, name, _TimedCall(original, totals, label))
        patched.append((owner, name, original, had_own))
    try:
        yield totals, missing
    finally:
        for owner, name, original, had_own in reversed(patched):
            if had_own:
                object.__setattr__(owner, name, original)
            else:
                object.__delattr__(owner, name)


def _kernel_summary(prof, steps: int, wall_s: float, device: str) -> dict[str, Any]:
    """GPU time per step (kernels summed, and busy time = union of kernel intervals), the top 10
    kernels, and the top 10 host ops by self CPU time."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    summary: dict[str, Any] = {"wall_ms_per_step": round(wall_s * 1000 / steps, 4)}
    if device.startswith("cuda"):
        # Kernels, memcpys and memsets; not the GPU-side copies of record_function ranges,
        # which span kernels already counted.
        kernels = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA
            and "annotation" not in str(getattr(e, "activity_type", ""))
        ]
        intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy_us, cur_start, cur_end = 0.0, None, None
        for start, end in intervals:
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    busy_us += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            busy_us += cur_end - cur_start
        total_us = sum(e.time_range.elapsed_us() for e in kernels)
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
        summary.update(
            kernels_per_step=round(len(kernels) / steps, 1),
            kernel_ms_per_step=round(total_us / 1000 / steps, 4),
            gpu_busy_ms_per_step=round(busy_us / 1000 / steps, 4),
            cpu_gap_ms_per_step=round((wall_s * 1e6 - busy_us) / 1000 / steps, 4),
            top_kernels=[
                {
                    "name": name[:160],
                    "pct": round(100 * sum(times) / total_us, 2) if total_us else None,
                    "calls_per_step": round(len(times) / steps, 2),
                    "ms_per_step": round(sum(times) / 1000 / steps, 4),
                }
                for name, times in top
            ],
        )
    averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    summary["top_cpu_ops"] = [
        {
            "name": a.key[:120],
            "self_cpu_ms_per_step": round(a.self_cpu_time_total / 1000 / steps, 4),
            "calls_per_step": round(a.count / steps, 2),
        }
        for a in averages
    ]
    return summary


class _DecodeBatch:
    """`batch_size` requests of decode_prompt_len random tokens, stepped until every one is
    decoding (all prefill chunks done); `step()` then runs one pure decode step. Aborts its
    requests on exit."""

    def __init__(self, engine, batch_size: int, sizes: Sizes, num_steps: int) -> None:
        from pagedserve.engine import SamplingParams

        self.engine = engine
        self.batch_size = batch_size
        self.prompt_len = sizes.decode_prompt_len
        est_prefill = cdiv(batch_size * self.prompt_len, sizes.decode_max_batched_tokens) + 2
        # Early requests decode while later ones prefill: room for those tokens too.
        params = SamplingParams(
            temperature=0, max_tokens=est_prefill + num_steps + 16, ignore_eos=True
        )
        vocab = engine.model_config.vocab_size
        prompts = random_ids(batch_size, self.prompt_len, vocab, seed=batch_size)
        self.ids = [f"decode-{batch_size}-{i}" for i in range(batch_size)]
        for rid, prompt in zip(self.ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        self.counts = dict.fromkeys(self.ids, 0)
        self.prefill_steps = 0
        while min(self.counts.values()) == 0:
            self.step()
            self.prefill_steps += 1
            if self.prefill_steps > 100 * est_prefill:
                raise RuntimeError("requests never all started decoding")

    def step(self) -> None:
        for out in self.engine.step():
            self.counts[out.request_id] = len(out.outputs[0].token_ids)

    def __enter__(self) -> _DecodeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        for rid in self.ids:
            self.engine.abort(rid)


def _time_decode(llm, batch_size: int, sizes: Sizes, base: dict[str, Any], rec: Recorder) -> None:
    """Time decode_steps pure decode steps (engine.step() wall time, host work included) against
    the memory roofline, then split split_steps of them by part."""

    engine = llm.engine
    config = engine.model_config
    device = str(engine.worker.device)
    num_steps = 3 + sizes.decode_steps + sizes.split_steps
    with _DecodeBatch(engine, batch_size, sizes, num_steps) as batch:
        for _ in range(3):
            batch.step()
        start_counts = dict(batch.counts)
        times = []
        sync(device)
        for _ in range(sizes.decode_steps):
            t0 = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - t0)
        sync(device)
        all_decode = all(batch.counts[r] - start_counts[r] == sizes.decode_steps for r in batch.ids)
        # Context each sequence attends to, averaged over the timed steps.
        mean_context = (
            sum(batch.prompt_len + start_counts[r] for r in batch.ids) / batch_size
            + (sizes.decode_steps - 1) / 2
        )
        median = statistics.median(times)
        dtype_bytes = engine.worker.dtype.itemsize
        # Every weight is read once per step; an untied embedding only for the step's rows.
        untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size
        weight_bytes = (config.num_params() - untied_embedding * config.hidden_size) * dtype_bytes
        kv_bytes = batch_size * mean_context * config.kv_bytes_per_token(dtype_bytes)
        roofline_s = (weight_bytes + kv_bytes) / PEAK_BANDWIDTH
        record = {
            **base,
            "kind": "step_time",
            "batch_size": batch_size,
            "prompt_len": batch.prompt_len,
            "mean_context_len": round(mean_context, 1),
            "prefill_steps": batch.prefill_steps,
            "num_steps": len(times),
            "all_steps_pure_decode": all_decode,
            "step_ms_median": round(median * 1000, 4),
            "step_ms_mean": round(statistics.fmean(times) * 1000, 4),
            "step_ms_p90": round(percentile(times, 90) * 1000, 4),
            "step_ms_min": round(min(times) * 1000, 4),
            "output_tokens_per_s": round(batch_size / median, 1),
            "weight_bytes": weight_bytes,
            "kv_bytes_per_step": int(kv_bytes),
            "roofline_ms": round(roofline_s * 1000, 4),
            "peak_bandwidth_Bps": PEAK_BANDWIDTH,
            "fraction_of_roofline": round(roofline_s / median, 4),
            "achieved_GBps": round((weight_bytes + kv_bytes) / median / 1e9, 1),
        }
        if batch_size == 1:
            record["target_ms"] = DECODE_TARGET_MS_BATCH_1
            record["meets_target"] = median * 1000 <= DECODE_TARGET_MS_BATCH_1
        rec.write(record)
        if device.startswith("cuda"):
            with rec.part(**base, kind="host_syncs", batch_size=batch_size):
                rec.write(
                    {**base, "kind": "host_syncs", "batch_size": batch_size, **_count_syncs(batch)}
                )

        with rec.part(**base, kind="cpu_split", batch_size=batch_size):
            with timed_parts(engine) as (totals, missing):
                sync(device)
                t0 = time.perf_counter()
                for _ in range(sizes.split_steps):
                    batch.step()
                sync(device)
                wall = time.perf_counter() - t0
            per_step = {k: round(v * 1000 / sizes.split_steps, 4) for k, v in totals.items()}
            top = sum(per_step.get(k, 0.0) for k in ("schedule", "execute", "update"))
            inner = sum(v for k, v in per_step.items() if k.startswith("execute."))
            step_ms = wall * 1000 / sizes.split_steps
            rec.write(
                {
                    **base,
                    "kind": "cpu_split",
                    "batch_size": batch_size,
                    "num_steps": sizes.split_steps,
                    "step_ms": round(step_ms, 4),
                    "parts_ms": per_step,
                    "execute_other_ms": round(per_step.get("execute", 0.0) - inner, 4),
                    "step_other_ms": round(step_ms - top, 4),
                    "missing_parts": missing,
                }
            )


def _count_syncs(batch: _DecodeBatch, steps: int = 5) -> dict[str, Any]:
    """Host-device synchronisations per decode step, with the lines that cause them, from
    torch.cuda.set_sync_debug_mode("warn"). The goal is one: copying the sampled ids back."""
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                batch.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught)
    return {"num_steps": steps, "syncs_per_step": len(caught) / steps, "sites": dict(sites)}


def _profile_decode(
    llm, batch_size: int, sizes: Sizes, base: dict[str, Any], rec: Recorder
) -> None:
    """torch.profiler over profile_steps pure decode steps: GPU time against wall time."""
    from torch.profiler import ProfilerActivity, profile

    device = str(llm.engine.worker.device)
    with _DecodeBatch(llm.engine, batch_size, sizes, 2 + sizes.profile_steps) as batch:
        for _ in range(2):
            batch.step()
        activities = [ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(sizes.profile_steps):
                batch.step()
            sync(device)
            wall = time.perf_counter() - t0
    rec.write(
        {
            **base,
            "kind": "profile",
            "batch_size": batch_size,
            "num_steps": sizes.profile_steps,
            **_kernel_summary(prof, sizes.profile_steps, wall, device),
        }
    )


def step_decode(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """Timings first for both engines, profiles after (eager first): a profiler that fails or
    hangs with CUDA graphs cannot cost the timings."""
    from pagedserve.engine import LLM

    model = model_path(args.model, args.scratch)
    max_batch = max(sizes.decode_batch_sizes)
    longest = sizes.decode_prompt_len + 3 + sizes.decode_steps + sizes.split_steps + 64
    longest += cdiv(max_batch * sizes.decode_prompt_len, sizes.decode_max_batched_tokens)
    max_model_len = cdiv(longest, 256) * 256
    phases = ((False, _time_decode), (True, _time_decode), (True, _profile_decode))
    phases += ((False, _profile_decode),)
    llm, llm_eager = None, None
    with reuse_dummy_weights():
        for eager, measure in phases:
            base = {"model": args.model, "dtype": sizes.dtype, "enforce_eager": eager}
            with rec.part(**base, kind=measure.__name__.strip("_")):
                if llm is None or llm_eager != eager:
                    llm = None
                    free_memory()
                    llm = LLM(
                        model,
                        device=sizes.device,
                        dtype=sizes.dtype,
                        load_format="dummy",
                        enforce_eager=eager,
                        max_num_seqs=max_batch,
                        max_num_batched_tokens=sizes.decode_max_batched_tokens,
                        max_model_len=max_model_len,
                        num_kv_blocks=kv_blocks_for([max_model_len] * max_batch, max_model_len),
                    )
                    llm_eager = eager
                base.update(engine_info(llm))
                for batch_size in sizes.decode_batch_sizes:
                    with rec.part(**base, kind=measure.__name__.strip("_"), batch_size=batch_size):
                        measure(llm, batch_size, sizes, base, rec)
        llm = None
        free_memory()


# ---------------------------------------------------------------------------------------------
# offline: pagedserve against transformers
# ---------------------------------------------------------------------------------------------


def step_offline(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    from pagedserve.bench import compare_transformers

    model = model_path(args.model, args.scratch)
    max_model_len = sizes.offline_input_len + sizes.offline_output_len + 256
    argv = [
        "--model", model,
        "--load-format", "dummy",
        "--device", sizes.device,
        "--dtypes", sizes.dtype,
        "--num-prompts", str(sizes.offline_prompts),
        "--input-len", str(sizes.offline_input_len),
        "--output-len", str(sizes.offline_output_len),
        "--engines", *compare_transformers.ENGINES,
        "--transformers-num-prompts", str(sizes.offline_transformers_prompts),
        "--static-batch-size", str(sizes.offline_static_batch),
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip
    if args.smoke:  # the CPU default is a 4 GiB cache
        lens = [sizes.offline_input_len + sizes.offline_output_len] * sizes.offline_prompts
        argv += ["--num-kv-blocks", str(kv_blocks_for(lens, max_model_len))]
    options = compare_transformers.build_parser().parse_args(argv)
    base = {
        "model": args.model,
        "workload": f"{sizes.offline_prompts} requests x {sizes.offline_input_len} in / "
        f"{sizes.offline_output_len} out, temperature 1, ignore_eos; generate_batch on the first "
        f"{sizes.offline_transformers_prompts}",
    }
    # One record per engine as soon as it is measured, the slowest and least predictable
    # (generate_batch) last: a time-out then costs only its own number.
    runs: dict[str, dict[str, Any]] = {}
    for engine in ("pagedserve", "transformers-static", "transformers"):
        with rec.part(**base, kind="engine", engine=engine):
            runs[engine] = compare_transformers.measure_in_subprocess(engine, sizes.dtype, options)
            rec.write({**base, "kind": "engine", "engine": engine, **runs[engine]})
    rec.write(
        {**base, "kind": "comparison", **compare_transformers.comparison_row(sizes.dtype, runs)}
    )


# ---------------------------------------------------------------------------------------------
# mixture of experts
# ---------------------------------------------------------------------------------------------


def step_moe(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """A tiny Qwen3-MoE's fp32 greedy tokens against transformers' (the fused MoE kernel
    compiled, graphs and eager), then offline throughput of a Qwen3-30B-A3B-shaped model."""
    from pagedserve.engine.models.builtin_shapes import BUILTIN_SHAPES
    from pagedserve.engine.models.model_config import ModelConfig
    from pagedserve.server import cli

    tiny = args.scratch / "tiny-qwen3-moe"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    config = ModelConfig.from_hf_dict(TINY_QWEN3_MOE)
    prompts = [
        random_ids(1, n, config.vocab_size, i)[0]
        for i, n in enumerate(sizes.correctness_prompt_lens)
    ]
    n = sizes.correctness_tokens
    with rec.part(model="tiny-qwen3-moe", check="fp32_greedy"):
        expected, scores = transformers_greedy(config, prompts, n, "float32", sizes.device)
        for eager in (False, True):
            got, info = engine_greedy(str(tiny), prompts, n, "float32", sizes.device, eager)
            rec.write(
                {
                    "model": "tiny-qwen3-moe",
                    "check": "fp32_greedy",
                    "engine": "eager" if eager else "default",
                    **compare_tokens(expected, got, scores),
                    **info,
                    "num_tokens": n,
                }
            )

    shape = TINY_QWEN3_MOE if args.smoke else BUILTIN_SHAPES["qwen3-30b-a3b"]
    shape = {**shape, "num_hidden_layers": min(shape["num_hidden_layers"], MOE_THROUGHPUT_LAYERS)}
    folder = args.scratch / "qwen3-moe-shaped"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape))
    moe_config = ModelConfig.from_hf_dict(shape)
    out = args.scratch / "moe.json"
    argv = [
        "bench", "throughput",
        "--model", str(folder),
        "--load-format", "dummy",
        "--device", sizes.device,
        "--dtype", sizes.dtype,
        "--num-prompts", str(sizes.offline_prompts),
        "--input-len", str(sizes.offline_input_len),
        "--output-len", str(sizes.offline_output_len),
        "--max-model-len", str(sizes.offline_input_len + sizes.offline_output_len + 256),
    ]  # fmt: skip
    if sizes.kv_cache_gib is not None:
        argv += ["--kv-cache-memory", str(sizes.kv_cache_gib)]
    base = {
        "model": "qwen3-30b-a3b-shaped",
        "num_hidden_layers": moe_config.num_hidden_layers,
        "num_params": moe_config.num_params(),
        "num_active_params": moe_config.num_active_params(),
    }
    with rec.part(**base, kind="throughput"):
        rc = cli.main([*argv, "--json", str(out)])
        if rc != 0:
            raise RuntimeError(f"pagedserve bench throughput exited with {rc}")
        rec.write(
            {
                **json.loads(out.read_text()),
                **base,
                "kind": "throughput",
                "command": "pagedserve " + " ".join(argv),
            }
        )


# Structured outputs: one constraint of each kind for the tiny model's prompts (its synthetic
# tokenizer spells text with byte tokens, which is what the grammars match), and a long regex for
# the throughput run.
STRUCTURED_SPECS: dict[str, dict[str, Any]] = {
    "regex": {"regex": r"([a-z]{1,6} ){4,12}[a-z]{1,6}\."},
    "choice": {"choice": ["alpha", "beta", "gamma delta"]},
    "json": {
        "json": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 8},
                    "maxItems": 3,
                },
            },
            "required": ["id", "tags"],
        }
    },
    "grammar": {"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
}
STRUCTURED_THROUGHPUT_REGEX = r"([a-z]{1,8} ){16,400}[a-z]{1,8}\."


def offline_tok_s(llm, sizes: Sizes) -> float:
    """Output tokens per second of `sizes.offline_*` random prompts, greedy, after a short run
    that compiles out of the timing."""
    from pagedserve.engine import SamplingParams

    num, max_tokens = sizes.offline_prompts, sizes.offline_output_len
    ids = random_ids(num, sizes.offline_input_len, llm.engine.model_config.vocab_size, 11)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(ids[:8], params.clone(max_tokens=4))
    sync(sizes.device)
    start = time.perf_counter()
    llm.generate(ids, params)
    sync(sizes.device)
    return num * max_tokens / (time.perf_counter() - start)


def throughput_record(model: str, sizes: Sizes) -> dict[str, Any]:
    """What every A-against-B throughput record starts with: the model and the workload."""
    return {
        "model": model,
        "kind": "throughput",
        "dtype": sizes.dtype,
        "num_prompts": sizes.offline_prompts,
        "input_len": sizes.offline_input_len,
        "output_len": sizes.offline_output_len,
    }


def step_kvcap(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """KV capacity on the device: the tiny Llama's fp32 greedy tokens with swap
    preemption (4-token blocks, a pool too small for all at once, pinned host pool) equal the
    CPU engine's with a roomy pool, graphs and eager; with an fp8 cache calibrated on the first
    step (scales set in place after the graphs were captured), the share of positions that
    agree with the fp32 cache on the device; then the 1B shape, offline throughput with the fp8
    cache against bf16's in the same run."""
    from pagedserve.engine import LLM, SamplingParams

    tiny = write_tiny_model(args.scratch / "tiny-llama")
    vocab = TINY_LLAMA["vocab_size"]
    prompts = [random_ids(1, n, vocab, i)[0] for i, n in enumerate(sizes.correctness_prompt_lens)]
    params = SamplingParams(temperature=0, max_tokens=sizes.correctness_tokens, ignore_eos=True)
    lengths = [len(p) + sizes.correctness_tokens for p in prompts]
    max_model_len = cdiv(max(lengths), 16) * 16  # the longest fits; the pool is sized by it
    roomy = kv_blocks_for(lengths, max_model_len)
    # 4-token blocks (many block boundaries to cross), a quarter of what all hold at once or
    # the longest alone: preemptions either way.
    block = 4
    tight = max(sum(cdiv(n, block) for n in lengths) // 4, cdiv(max_model_len, block))

    def run(device: str, eager: bool, **kwargs) -> tuple[list[list[int]], dict[str, Any]]:
        llm = LLM(
            tiny, device=device, dtype="float32", load_format="dummy", enforce_eager=eager,
            max_num_seqs=len(prompts), max_model_len=max_model_len, **kwargs,
        )  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        s = llm.engine.scheduler
        info = {
            **engine_info(llm),
            "num_kv_blocks": llm.engine.worker.kv_plan.num_blocks,
            "preemptions": s.num_preemptions,
            "swap_outs": s.num_swap_outs,
            "swap_ins": s.num_swap_ins,
            "swapped_blocks_left": s.kv_cache_manager.num_swapped_blocks,
        }
        del llm
        free_memory()
        return tokens, info

    with rec.part(model="tiny", check="fp32_swap_greedy"):
        expected, _ = run("cpu", True, num_kv_blocks=roomy)
        for eager in (False, True):
            got, info = run(
                sizes.device, eager, block_size=block, num_kv_blocks=tight,
                preemption_mode="swap", swap_space=1 << 30,
            )  # fmt: skip
            rec.write(
                {
                    "model": "tiny",
                    "check": "fp32_swap_greedy",
                    "engine": "eager" if eager else "default",
                    **compare_tokens(expected, got),
                    **info,
                }
            )
    with rec.part(model="tiny", check="fp8_greedy_agreement"):
        exact, _ = run(sizes.device, False, num_kv_blocks=roomy)
        got, info = run(
            sizes.device, False, num_kv_blocks=roomy, kv_cache_dtype="fp8",
            calculate_kv_scales=True,
        )  # fmt: skip
        pairs = [(a, b) for g, e in zip(got, exact, strict=True) for a, b in zip(g, e, strict=True)]
        same = sum(a == b for a, b in pairs)
        rec.write(
            {
                "model": "tiny",
                "check": "fp8_greedy_agreement",
                "engine": "default",
                "agreement": round(same / len(pairs), 3),
                **info,
            }
        )

    model = model_path(args.model, args.scratch)
    num, input_len = sizes.offline_prompts, sizes.offline_input_len
    max_tokens = sizes.offline_output_len
    model_len = cdiv(input_len + max_tokens, 256) * 256
    throughput = {}
    for kv in ("auto", "fp8"):
        with (
            rec.part(model=args.model, kind="throughput", kv_cache_dtype=kv),
            reuse_dummy_weights(),
        ):
            llm = LLM(
                model, device=sizes.device, dtype=sizes.dtype, load_format="dummy",
                max_num_seqs=num, max_model_len=model_len, kv_cache_dtype=kv,
                num_kv_blocks=kv_blocks_for([input_len + max_tokens] * num, model_len),
            )  # fmt: skip
            throughput[kv] = offline_tok_s(llm, sizes)
            del llm
            free_memory()
    if len(throughput) == 2:
        rec.write(
            {
                **throughput_record(args.model, sizes),
                "bf16_tok_s": round(throughput["auto"], 1),
                "fp8_tok_s": round(throughput["fp8"], 1),
                "ratio": round(throughput["fp8"] / throughput["auto"], 3),
            }
        )


# The whisper step's smoke model: whisper-tiny's vocabulary and special tokens (so its
# generation config's suppressed ids are real ones) at a size the CPU decodes in seconds.
SMOKE_WHISPER = dict(
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    max_source_positions=150, max_target_positions=64,
)  # fmt: skip
# (concurrency, requests) of the served whisper-large-v3 shape, one 30 s window of audio each,
# which decodes to the decoder's last position (random weights): 447 tokens.
WHISPER_RUNS = ((1, 4), (16, 32), (64, 128))
SMOKE_WHISPER_RUNS = ((1, 2), (2, 4))


def step_whisper(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """Whisper on the device. The whisper-tiny shape with peaked random weights saved
    by transformers: fp32 greedy tokens of 4 synthetic audio windows decoded together by the
    engine (Triton's kernels, the generation config's suppressed tokens) equal transformers'
    `generate` on the same device. Then the whisper-large-v3 shape with random weights, bf16,
    served: audio seconds per wall second through /v1/audio/transcriptions at concurrency 1, 16
    and 64 (bench/transcriptions.py)."""
    import torch
    import transformers

    from pagedserve.bench.transcriptions import serve_and_measure, synthetic_wav
    from pagedserve.engine.core.whisper_engine import TranscriptionRequest
    from pagedserve.engine.engine_config import EngineConfig
    from pagedserve.engine.frontend.audio import decode_audio, log_mel, windows
    from pagedserve.engine.frontend.whisper_service import TranscriptionService
    from pagedserve.engine.models.whisper_config import WHISPER_SHAPES, WhisperConfig

    shape = {**WHISPER_SHAPES["whisper-tiny"], **(SMOKE_WHISPER if args.smoke else {})}
    c = WhisperConfig(**shape)
    folder = args.scratch / "whisper-tiny"
    with rec.part(model="whisper-tiny", check="fp32_greedy"):
        torch.manual_seed(0)
        hf_config = transformers.WhisperConfig(
            **shape, bos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id, init_std=0.2
        )
        hf = transformers.WhisperForConditionalGeneration(hf_config).eval()
        hf.save_pretrained(folder)
        features = torch.cat([
            log_mel(windows(decode_audio(synthetic_wav(c.window_seconds, seed)),
                            c.window_seconds), c.num_mel_bins, c.num_frames)
            for seed in range(4)
        ])  # fmt: skip
        max_new = sizes.correctness_tokens
        with torch.inference_mode():
            hf = hf.to(sizes.device)
            out = hf.generate(features.to(sizes.device), max_new_tokens=max_new).tolist()
        expected = [row[: row.index(c.eos_token_id) + 1] if c.eos_token_id in row else row
                    for row in out]  # fmt: skip
        del hf
        free_memory()
        config = EngineConfig(model=str(folder), device=sizes.device, dtype="float32")
        engine = TranscriptionService.from_config(config).engine
        requests = [TranscriptionRequest(f"r{i}", f, [c.decoder_start_token_id], max_new)
                    for i, f in enumerate(features)]  # fmt: skip
        for r in requests:
            engine.add(r)
        engine.run()
        rec.write({
            "model": "whisper-tiny", "check": "fp32_greedy", "engine": engine.ops.__name__,
            **compare_tokens(expected, [r.output for r in requests]), "num_tokens": max_new,
            "blocks_free_after": engine.pool.num_free_blocks == engine.pool.num_blocks,
        })  # fmt: skip
        del engine
        free_memory()

    model, label = (str(folder), "whisper-tiny-smoke") if args.smoke else ("whisper-large-v3",) * 2
    serve_args = ["--device", sizes.device, "--dtype", sizes.dtype,
                  "--max-num-batched-tokens", "16384"]  # fmt: skip
    runs = SMOKE_WHISPER_RUNS if args.smoke else WHISPER_RUNS
    with rec.part(model=label, kind="transcription"):
        for record in serve_and_measure(model, serve_args, list(runs), c.window_seconds,
                                        args.out / "whisper_server.log"):  # fmt: skip
            rec.write({"kind": "transcription", **record, "model": label})


def step_tp(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """Tensor parallelism on the device. With one GPU: the tiny Llama's fp32 greedy
    tokens through the distributed path at one rank (its all-reduces, the logits' gather and the
    ids' broadcast over an NCCL group of one, captured in the CUDA graphs) equal the plain
    engine's, graphs and eager; then the 1B shape's offline throughput both ways in the same run
    (target: the distributed path < 3% slower). Two ranks when there are two devices (on CPU,
    the --smoke run, always): the tiny Llama's greedy tokens equal one rank's."""
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.engine_config import EngineConfig
    from pagedserve.engine.tp_endpoint import TPEndpoint, free_port

    def build(distributed: bool, model: str, **kwargs) -> LLM:
        config = EngineConfig(model, device=sizes.device, load_format="dummy", **kwargs)
        endpoint = TPEndpoint(0, 1, "127.0.0.1", free_port(), 0) if distributed else None
        return LLM.from_config(config, endpoint)

    tiny = write_tiny_model(args.scratch / "tiny-llama")
    vocab = TINY_LLAMA["vocab_size"]
    prompts = [random_ids(1, n, vocab, i)[0] for i, n in enumerate(sizes.correctness_prompt_lens)]
    params = SamplingParams(temperature=0, max_tokens=sizes.correctness_tokens, ignore_eos=True)
    lengths = [len(p) + sizes.correctness_tokens for p in prompts]
    max_model_len = cdiv(max(lengths), 16) * 16
    tiny_args = dict(
        dtype="float32", max_num_seqs=len(prompts), max_model_len=max_model_len,
        num_kv_blocks=kv_blocks_for(lengths, max_model_len),
    )  # fmt: skip

    def tokens_of(llm: LLM) -> list[list[int]]:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        llm.engine.close()
        return tokens

    with rec.part(model="tiny", check="fp32_tp1_greedy"):
        expected = tokens_of(build(False, tiny, **tiny_args))
        free_memory()
        for eager in (False, True):
            got = tokens_of(build(True, tiny, enforce_eager=eager, **tiny_args))
            free_memory()
            rec.write(
                {
                    "model": "tiny",
                    "check": "fp32_tp1_greedy",
                    "engine": "eager" if eager else "default",
                    **compare_tokens(expected, got),
                }
            )
    with rec.part(model="tiny", check="fp32_tp2_greedy"):
        import torch

        record = {"model": "tiny", "check": "fp32_tp2_greedy", "engine": "default"}
        if sizes.device == "cuda" and torch.cuda.device_count() < 2:
            rec.write({**record, "skipped": "one device: two ranks need two"})
        else:
            got = tokens_of(build(False, tiny, tensor_parallel_size=2, **tiny_args))
            free_memory()
            rec.write({**record, **compare_tokens(expected, got)})

    model = model_path(args.model, args.scratch)
    num, input_len = sizes.offline_prompts, sizes.offline_input_len
    max_tokens = sizes.offline_output_len
    model_len = cdiv(input_len + max_tokens, 256) * 256
    throughput = {}
    for path in ("plain", "distributed"):
        with rec.part(model=args.model, kind="throughput", path=path), reuse_dummy_weights():
            llm = build(
                path == "distributed", model, dtype=sizes.dtype, max_num_seqs=num,
                max_model_len=model_len,
                num_kv_blocks=kv_blocks_for([input_len + max_tokens] * num, model_len),
            )  # fmt: skip
            throughput[path] = offline_tok_s(llm, sizes)
            llm.engine.close()
            del llm
            free_memory()
    if len(throughput) == 2:
        rec.write(
            {
                **throughput_record(args.model, sizes),
                "plain_tok_s": round(throughput["plain"], 1),
                "tp1_tok_s": round(throughput["distributed"], 1),
                "ratio": round(throughput["distributed"] / throughput["plain"], 3),
            }
        )


def step_structured(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """Structured outputs on the device (xgrammar's Triton mask kernel, matchers on the host):
    the tiny Llama's fp32 constrained greedy tokens, one constraint of each kind, equal the CPU
    engine's (which equal transformers' masked by the same grammar,
    tests/engine/test_structured_outputs.py), graphs and eager; then the 1B shape, a regex
    constraint against free generation of the same token counts (the constrained engine steps
    synchronously, the free one with async scheduling)."""
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.scheduler import StructuredOutputs

    tiny = write_tiny_model(args.scratch / "tiny-llama")
    vocab = TINY_LLAMA["vocab_size"]
    prompts = [random_ids(1, n, vocab, i)[0] for i, n in enumerate(sizes.correctness_prompt_lens)]
    kinds = list(STRUCTURED_SPECS)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=2 * sizes.correctness_tokens,
            structured_outputs=StructuredOutputs(**STRUCTURED_SPECS[kinds[i % len(kinds)]]),
        )
        for i in range(len(prompts))
    ]
    max_model_len = 1024

    def constrained(device: str, eager: bool) -> tuple[list[list[int]], dict[str, Any]]:
        llm = LLM(
            tiny, device=device, dtype="float32", load_format="dummy", enforce_eager=eager,
            max_num_seqs=len(prompts), max_model_len=max_model_len,
            num_kv_blocks=kv_blocks_for([max_model_len] * len(prompts), max_model_len),
        )  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        info = {**engine_info(llm), "live_matchers": len(llm.engine.structured.matchers)}
        del llm
        free_memory()
        return tokens, info

    with rec.part(model="tiny", check="fp32_constrained_greedy"):
        expected, _ = constrained("cpu", True)
        for eager in (False, True):
            got, info = constrained(sizes.device, eager)
            rec.write(
                {
                    "model": "tiny",
                    "check": "fp32_constrained_greedy",
                    "engine": "eager" if eager else "default",
                    "kinds": kinds,
                    **compare_tokens(expected, got),
                    **info,
                }
            )

    model = model_path(args.model, args.scratch)
    num, input_len = sizes.offline_prompts, sizes.offline_input_len
    max_tokens = sizes.offline_output_len
    model_len = cdiv(input_len + max_tokens, 256) * 256
    spec = StructuredOutputs(regex=STRUCTURED_THROUGHPUT_REGEX)
    with rec.part(model=args.model, kind="throughput"), reuse_dummy_weights():
        llm = LLM(
            model, device=sizes.device, dtype=sizes.dtype, load_format="dummy",
            max_num_seqs=num, max_model_len=model_len,
            num_kv_blocks=kv_blocks_for([input_len + max_tokens] * num, model_len),
        )  # fmt: skip
        ids = random_ids(num, input_len, llm.engine.model_config.vocab_size, 11)
        warm = SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec)
        llm.generate(ids[:8], warm)  # compiles (grammar, Triton) out of the timed runs
        sync(sizes.device)
        start = time.perf_counter()
        outs = llm.generate(
            ids, SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)
        )
        sync(sizes.device)
        constrained_s = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        llm.generate(ids, free)
        sync(sizes.device)
        free_s = time.perf_counter() - start
        total = sum(lengths)
        rec.write(
            {
                "model": args.model,
                "kind": "throughput",
                "dtype": sizes.dtype,
                "num_prompts": num,
                "input_len": input_len,
                "num_output_tokens": total,
                "constrained_tok_s": round(total / constrained_s, 1),
                "free_tok_s": round(total / free_s, 1),
                "ratio": round(free_s / constrained_s, 3),
                **engine_info(llm),
            }
        )


# ---------------------------------------------------------------------------------------------
# nano-vllm's workload
# ---------------------------------------------------------------------------------------------


def step_nano(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    from pagedserve.bench.throughput import random_length_workload
    from pagedserve.engine.models.model_source import resolve_model
    from pagedserve.server import cli

    model = model_path(TINY if args.smoke else args.model, args.scratch)
    out = args.scratch / "nano.json"
    argv = [
        "bench", "throughput",
        "--model", model,
        "--load-format", "dummy",
        "--device", sizes.device,
        "--dtype", sizes.dtype,
        "--num-prompts", str(sizes.nano_prompts),
        "--input-len-range", *map(str, sizes.nano_input_range),
        "--output-len-range", *map(str, sizes.nano_output_range),
        "--dataset-seed", "0",
        "--temperature", "0.6",
        "--no-request-seeds",
        "--max-model-len", "4096",
        "--max-num-batched-tokens", str(sizes.nano_max_batched_tokens),
    ]  # fmt: skip
    if sizes.kv_cache_gib is not None:
        argv += ["--kv-cache-memory", str(sizes.kv_cache_gib)]
    base = {"model": args.model, "model_run": Path(model).name}
    with rec.part(**base):
        rc = cli.main([*argv, "--json", str(out)])
        if rc != 0:
            raise RuntimeError(f"pagedserve bench throughput exited with {rc}")
        result = json.loads(out.read_text())
        vocab = resolve_model(model).config.vocab_size
        _, output_lens = random_length_workload(
            sizes.nano_prompts, sizes.nano_input_range, sizes.nano_output_range, vocab, 0
        )
        record = {
            **result,
            **base,
            "command": "pagedserve " + " ".join(argv),
            "exact_output_tokens": result["num_output_tokens"] == sum(output_lens),
        }
        reference = NANO_REFERENCE.get(args.model)
        if reference is not None and not args.smoke:
            record["nano_vllm_workload"] = sum(output_lens) == NANO_VLLM_OUTPUT_TOKENS
            record["reference_output_tok_s_a800"] = reference
            record["reference_source"] = NANO_REFERENCE_SOURCE
            record["ratio_vs_vllm_a800"] = round(
                result["output_tokens_per_s"] / reference["vllm_0.10.2"], 3
            )
        rec.write(record)


# ---------------------------------------------------------------------------------------------
# online: a server and `bench serve`, against offline on the same requests
# ---------------------------------------------------------------------------------------------


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
        **engine_info(llm),
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


def step_online(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    from pagedserve.server.launch import DEFAULT_COMMAND, server_process

    model = model_path(args.model, args.scratch)
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
            sys.executable, "-m", "pagedserve.bench.gpu_engine", "offline-serve-worker",
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
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
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


# ---------------------------------------------------------------------------------------------
# spec: speculative decoding by prompt lookup, and n > 1 samples on shared blocks
# ---------------------------------------------------------------------------------------------

SPEC_NGRAM = 4  # speculative_ngram of the speculative engine: up to 4 drafts per step


def repeated_pattern_prompts(
    num: int, pattern_len: int, length: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Prompts that repeat a random pattern of pattern_len ids up to length ids, one pattern
    each: prompt lookup has n-grams to draft from at once."""
    patterns = random_ids(num, pattern_len, vocab_size, seed)
    return [(p * cdiv(length, pattern_len))[:length] for p in patterns]


def _generate_ids(
    llm, prompts: list[list[int]], params, batch_size: int
) -> tuple[list[list[int]], float]:
    """Every prompt's token ids, batch_size prompts per generate call, and the wall time."""
    device = str(llm.engine.worker.device)
    tokens: list[list[int]] = []
    sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs = llm.generate(prompts[i : i + batch_size], params)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    sync(device)
    return tokens, time.perf_counter() - start


def step_spec(args: argparse.Namespace, rec: Recorder, sizes: Sizes) -> None:
    """Plain and speculative engines on the same greedy requests at each batch size, then one
    n = 4 request against 4 seeded requests of its samples on the plain engine."""
    from pagedserve.engine import LLM, EngineConfig, SamplingParams
    from pagedserve.engine.models.model_source import resolve_model

    model = model_path(args.model, args.scratch)
    vocab = resolve_model(model).config.vocab_size
    block_size = EngineConfig().block_size
    # The samples share the prompt's KV but the last prompt token's: prompt_len - 1 tokens, 2
    # whole blocks and a partial one, which each sample must copy before its first write.
    shared_prompt_len = 2 * block_size + block_size // 2
    shared_samples, shared_max_tokens = 4, 16
    max_batch = max(sizes.spec_batch_sizes)
    spec_len = sizes.spec_prompt_len + sizes.spec_output_len
    max_model_len = cdiv(max(spec_len, shared_prompt_len + shared_max_tokens), 256) * 256
    seq_lens = [spec_len] * max_batch + [shared_prompt_len + shared_max_tokens] * shared_samples
    engines: dict[int, Any] = {}

    def engine_with(ngram: int):
        """One engine per speculative_ngram, built when first asked for. Both synchronous:
        drafts need it, and the plain engine must not get async scheduling's overlap that the
        speculative one cannot have, or the ratio would not be the drafts' alone."""
        if ngram not in engines:
            free_memory()
            engines[ngram] = LLM(
                model,
                device=sizes.device,
                dtype=sizes.dtype,
                load_format="dummy",
                async_scheduling=False,
                speculative_ngram=ngram,
                max_num_seqs=max(max_batch, shared_samples),
                max_model_len=max_model_len,
                num_kv_blocks=kv_blocks_for(seq_lens, max_model_len),
            )
        return engines[ngram]

    prompts = repeated_pattern_prompts(
        sizes.spec_prompts, sizes.spec_pattern_len, sizes.spec_prompt_len, vocab, seed=7
    )
    warm = repeated_pattern_prompts(
        max_batch, sizes.spec_pattern_len, sizes.spec_prompt_len, vocab, seed=8
    )
    params = SamplingParams(temperature=0, max_tokens=sizes.spec_output_len, ignore_eos=True)
    base = {
        "model": args.model,
        "dtype": sizes.dtype,
        "num_prompts": sizes.spec_prompts,
        "pattern_len": sizes.spec_pattern_len,
        "prompt_len": sizes.spec_prompt_len,
        "output_len": sizes.spec_output_len,
        "speculative_ngram": SPEC_NGRAM,
    }
    with reuse_dummy_weights() as weight_stats:
        for batch_size in sizes.spec_batch_sizes:
            with rec.part(**base, kind="speculative", batch_size=batch_size):
                runs: dict[int, dict[str, Any]] = {}
                for ngram in (0, SPEC_NGRAM):
                    llm = engine_with(ngram)
                    # Warm-up at this batch size: first-call costs and the Triton compiles of
                    # its shapes must not be timed.
                    llm.generate(warm[:batch_size], params.clone(max_tokens=8))
                    before = llm.engine.stats()
                    tokens, elapsed = _generate_ids(llm, prompts, params, batch_size)
                    after = llm.engine.stats()
                    runs[ngram] = {
                        "tokens": tokens,
                        "num_output_tokens": sum(map(len, tokens)),
                        "elapsed_s": elapsed,
                        "steps": after.num_steps - before.num_steps,
                        "drafted": after.spec_draft_tokens - before.spec_draft_tokens,
                        "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens,
                        "used_blocks": after.kv_blocks_used,
                        "info": engine_info(llm),
                    }
                plain, spec = runs[0], runs[SPEC_NGRAM]
                plain_rate = plain["num_output_tokens"] / plain["elapsed_s"]
                spec_rate = spec["num_output_tokens"] / spec["elapsed_s"]
                drafted, accepted = spec["drafted"], spec["accepted"]
                same = compare_tokens(plain["tokens"], spec["tokens"])
                rec.write(
                    {
                        **base,
                        "kind": "speculative",
                        "batch_size": batch_size,
                        "num_output_tokens": plain["num_output_tokens"],
                        "spec_num_output_tokens": spec["num_output_tokens"],
                        "plain_elapsed_s": round(plain["elapsed_s"], 4),
                        "spec_elapsed_s": round(spec["elapsed_s"], 4),
                        "plain_tok_s": round(plain_rate, 1),
                        "spec_tok_s": round(spec_rate, 1),
                        "speedup": round(spec_rate / plain_rate, 3),
                        "plain_steps": plain["steps"],
                        "spec_steps": spec["steps"],
                        "draft_tokens": drafted,
                        "accepted_tokens": accepted,
                        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                        # Greedy tokens are the same with and without drafts; bf16 rounding of
                        # a verify pass may tip a near-tie, which the first differences show.
                        "same_tokens": same["equal"],
                        "num_equal_prompts": same["num_equal_prompts"],
                        "mismatches": same["mismatches"][:4],
                        "used_blocks_after": [plain["used_blocks"], spec["used_blocks"]],
                        "plain_engine": plain["info"],
                        "spec_engine": spec["info"],
                    }
                )

        shared_base = {"model": args.model, "dtype": sizes.dtype, "kind": "shared_blocks"}
        with rec.part(**shared_base):
            llm = engine_with(0)
            kv = llm.engine.scheduler.kv_cache_manager
            (prompt,) = random_ids(1, shared_prompt_len, vocab, seed=11)
            group_params = SamplingParams(
                n=shared_samples, temperature=1.0, seed=11, max_tokens=shared_max_tokens
            )
            copies_before = kv.num_block_copies
            (group,) = llm.generate([prompt], group_params)
            copies = kv.num_block_copies - copies_before
            shared = [list(c.token_ids) for c in sorted(group.outputs, key=lambda c: c.index)]
            # Sample k of a seeded request draws with seed + k: a request of its own with that
            # seed, which computes the prompt alone, must give the same tokens.
            alone_params = [group_params.clone(n=1, seed=11 + k) for k in range(shared_samples)]
            alone = llm.generate([prompt] * shared_samples, alone_params)
            separate = [list(o.outputs[0].token_ids) for o in alone]
            rec.write(
                {
                    **shared_base,
                    "prompt_len": shared_prompt_len,
                    "block_size": block_size,
                    "n": shared_samples,
                    "seed": 11,
                    "max_tokens": shared_max_tokens,
                    "same_tokens": shared == separate,
                    "samples_equal": [a == b for a, b in zip(shared, separate, strict=True)],
                    # Equal samples would hide a missed copy: they must differ.
                    "num_distinct_samples": len({tuple(t) for t in shared}),
                    "sample_lens": [len(t) for t in shared],
                    "num_block_copies": copies,
                    "num_used_blocks_end": kv.num_used_blocks,
                    **engine_info(llm),
                }
            )
        engines.clear()
        free_memory()
    rec.write({"kind": "dummy_weights", **weight_stats})


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------


def _read(out: Path, step: str) -> list[dict[str, Any]]:
    path = out / f"{step}.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def summarize(out: Path) -> str:
    """A short text table of every record under `out` (missing steps say so)."""
    lines: list[str] = []
    env = _read(out, "env")
    if env:
        e = env[-1]
        lines.append(
            f"env: {e.get('gpu', 'no GPU')} | torch {e.get('torch')} | triton "
            f"{e.get('triton')} | transformers {e.get('transformers')} | commit {e.get('commit')}"
        )
    for step in STEPS[1:-1]:
        records = _read(out, step)
        if not records and step in OPTIONAL_STEPS:
            continue
        if not records:
            lines.append(f"{step}: no records")
            continue
        for r in records:
            if "error" in r:
                labels = {k: v for k, v in r.items() if k not in ("error", "trace", "step")}
                lines.append(f"{step}: ERROR {labels}: {r['error'][:300]}")
            else:
                try:
                    lines.append(f"{step}: " + _summary_line(step, r))
                except (KeyError, TypeError, ValueError):  # a record of another shape
                    lines.append(f"{step}: {json.dumps(r)[:400]}")
    return "\n".join(lines)


def _summary_line(step: str, r: dict[str, Any]) -> str:
    if step == "correctness":
        if r.get("check") == "dummy_weights":
            return f"dummy weights drawn {r.get('draws')}x for {r.get('calls')} loads"
        margins = [m.get("reference_logit_margin") for m in r.get("mismatches", [])]
        return (
            f"{r['model']} {r['check']} {r.get('engine', '')} equal={r['equal']} "
            f"prompts {r['num_equal_prompts']}/{r['num_prompts']} mean prefix match "
            f"{r['mean_prefix_match']}/{r['num_tokens']}"
            + (f" margins at first difference {margins}" if margins else "")
        )
    if step == "decode":
        mode = "eager" if r.get("enforce_eager") else "graphs" if r.get("cuda_graphs") else "none"
        head = f"B={r.get('batch_size')} {mode}"
        if r.get("kind") == "step_time":
            return (
                f"{head} step {r['step_ms_median']} ms (roofline {r['roofline_ms']} ms, "
                f"{100 * r['fraction_of_roofline']:.0f}%), ctx {r['mean_context_len']}, "
                f"{r['output_tokens_per_s']} tok/s, pure decode {r['all_steps_pure_decode']}"
                + (
                    f", target {r['target_ms']} ms met {r['meets_target']}"
                    if "target_ms" in r
                    else ""
                )
            )
        if r.get("kind") == "cpu_split":
            return f"{head} host split {r['parts_ms']} other {r['step_other_ms']} ms"
        if r.get("kind") == "profile":
            top = ", ".join(
                f"{k['name'][:40]} {k['pct']}%" for k in (r.get("top_kernels") or [])[:3]
            )
            return (
                f"{head} profile wall {r['wall_ms_per_step']} ms/step, GPU busy "
                f"{r.get('gpu_busy_ms_per_step')} ms, gap {r.get('cpu_gap_ms_per_step')} ms; {top}"
            )
    if step == "moe":
        if r.get("check"):
            return (
                f"{r['model']} {r['check']} {r['engine']} equal={r['equal']} prompts "
                f"{r['num_equal_prompts']}/{r['num_prompts']}"
            )
        return (
            f"{r['model']} ({r['num_hidden_layers']} layers, {r['num_active_params']} of "
            f"{r['num_params']} parameters per token) {r.get('output_tokens_per_s')} output tok/s"
        )
    if step == "kvcap":
        if r.get("check") == "fp32_swap_greedy":
            return (
                f"tiny fp32_swap_greedy {r['engine']} equal={r['equal']} prompts "
                f"{r['num_equal_prompts']}/{r['num_prompts']} swap outs/ins "
                f"{r['swap_outs']}/{r['swap_ins']} of {r['preemptions']} preemptions"
            )
        if r.get("check"):
            return f"tiny fp8_greedy_agreement {r['agreement']}"
        return (
            f"{r['model']} {r['dtype']} cache {r['bf16_tok_s']} tok/s, fp8 cache "
            f"{r['fp8_tok_s']} tok/s ({r['ratio']}x)"
        )
    if step == "whisper":
        if r.get("kind") == "transcription":
            return (
                f"{r['model']} served c={r['concurrency']} x{r['requests']}: "
                f"{r['audio_s_per_s']} audio s/s, {r['output_tok_s']} tok/s, latency p50 "
                f"{r['latency_p50_s']} s"
            )
        return _summary_line("correctness", r)
    if step == "tp":
        if r.get("skipped"):
            return f"tiny {r['check']} skipped: {r['skipped']}"
        if r.get("check"):
            return (
                f"tiny {r['check']} {r['engine']} equal={r['equal']} prompts "
                f"{r['num_equal_prompts']}/{r['num_prompts']}"
            )
        return (
            f"{r['model']} {r['dtype']} plain {r['plain_tok_s']} tok/s, one rank through the "
            f"distributed path {r['tp1_tok_s']} tok/s ({r['ratio']}x; target >= 0.97)"
        )
    if step == "structured":
        if r.get("check"):
            return (
                f"{r['model']} {r['check']} {r['engine']} equal={r['equal']} prompts "
                f"{r['num_equal_prompts']}/{r['num_prompts']}"
            )
        return (
            f"{r['model']} {r['dtype']} regex {r['constrained_tok_s']} tok/s, free "
            f"{r['free_tok_s']} tok/s ({r['ratio']}x, {r['num_output_tokens']} tokens)"
        )
    if step == "offline":
        if r.get("kind") == "engine":
            return (
                f"{r['engine']} {r['output_tokens_per_s']} output tok/s ({r['num_prompts']} "
                f"requests, {r['num_output_tokens']} tokens in {r['elapsed_s']} s)"
            )
        return (
            f"{r.get('dtype')} pagedserve {r.get('pagedserve_output_tok_s')} tok/s | "
            f"generate_batch {r.get('transformers_generate_batch_output_tok_s')} "
            f"({r.get('ratio')}x) | generate {r.get('transformers_generate_output_tok_s')} "
            f"({r.get('ratio_vs_static')}x)"
        )
    if step == "nano":
        return (
            f"{r['model']} {r['output_tokens_per_s']} output tok/s, {r['total_tokens_per_s']} "
            f"total tok/s, {r['num_output_tokens']} tokens in {r['elapsed_s']} s, exact "
            f"{r['exact_output_tokens']}, preemptions {r['num_preemptions']}"
            + (f", vs vLLM A800 {r['ratio_vs_vllm_a800']}x" if "ratio_vs_vllm_a800" in r else "")
        )
    if step == "spec":
        if r.get("kind") == "dummy_weights":
            return f"dummy weights drawn {r.get('draws')}x for {r.get('calls')} loads"
        if r.get("kind") == "shared_blocks":
            return (
                f"n={r['n']} on shared blocks = {r['n']} seeded requests {r['same_tokens']} "
                f"({r['num_distinct_samples']} distinct samples), block copies "
                f"{r['num_block_copies']}, blocks used at the end {r['num_used_blocks_end']}"
            )
        return (
            f"B={r['batch_size']} plain {r['plain_tok_s']} tok/s, ngram {r['spec_tok_s']} tok/s "
            f"({r['speedup']}x, steps {r['plain_steps']} -> {r['spec_steps']}), accepted "
            f"{r['accepted_tokens']}/{r['draft_tokens']} drafts, same tokens {r['same_tokens']} "
            f"({r['num_equal_prompts']}/{r['num_prompts']} prompts, {r['num_output_tokens']} "
            "tokens)"
        )
    if step == "online":
        if r.get("kind") == "offline":
            return f"offline {r['num_prompts']} requests {r['output_throughput']} tok/s"
        return (
            f"c={r['max_concurrency']} n={r['num_requests']} {r['output_throughput']:.1f} tok/s "
            f"TTFT p50/p99 {r['median_ttft_ms']:.1f}/{r['p99_ttft_ms']:.1f} ms TPOT p50 "
            f"{_num(r['median_tpot_ms'])} ITL p50/p99 {_num(r['median_itl_ms'])}/"
            f"{_num(r['p99_itl_ms'])} ms, client CPU {r['client_cpu_fraction']}"
            + (
                f", online/offline {r['ratio_online_to_offline']} (target "
                f"{r['target_ratio']}: {r['meets_target']})"
                if "ratio_online_to_offline" in r
                else ""
            )
        )
    return json.dumps(r)[:300]


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    # `timeout` sends SIGTERM: unwind, so that finally blocks stop the server and the workers.
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=[*STEPS, "offline-serve-worker"])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, tiny sizes")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON lines")
    p.add_argument("--model", default=None, help="default: llama-3.2-1b (tiny with --smoke)")
    # offline-serve-worker only
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    p.add_argument("--num-prompts", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--input-len", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--output-len", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-cache-gib", type=float, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.step == "offline-serve-worker":
        print(json.dumps(offline_serve_worker(args)))
        return 0
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    args.out = args.out or Path(os.environ.get("OUT") or REPO / "bench/results/gpu_engine")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "summary":
        text = summarize(args.out)
        (args.out / "summary.txt").write_text(text + "\n")
        print(text)
        return 0
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    if args.model is None or args.smoke and args.step != "nano":
        args.model = TINY if args.smoke else "llama-3.2-1b"
    rec = Recorder(args.out, args.step, args.smoke)
    steps = {
        "env": step_env,
        "correctness": step_correctness,
        "decode": step_decode,
        "offline": step_offline,
        "nano": step_nano,
        "online": step_online,
        "spec": step_spec,
        "moe": step_moe,
        "structured": step_structured,
        "kvcap": step_kvcap,
        "tp": step_tp,
        "whisper": step_whisper,
    }
    with tempfile.TemporaryDirectory(prefix="gpu_engine_") as scratch:
        args.scratch = Path(scratch)
        start = time.perf_counter()
        with rec.part(part="step"):
            steps[args.step](args, rec, sizes)
        print(f"{args.step}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 1 if rec.num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
