"""What every step shares: the steps' names, the sizes of the H200 run and of the CPU smoke
run, the tiny Llama, the records (Recorder), and the helpers that build, size and time engines."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.scheduler.utils import cdiv

REPO = Path(__file__).resolve().parents[2]
# Every STEP of `python -m benchmarks.gpu_engine STEP`, in the summary's order.
STEPS = (
    "env", "correctness", "decode", "offline", "nano", "online", "spec", "moe", "structured",
    "kvcap", "tp", "whisper", "embed", "lora", "summary",
)  # fmt: skip
# Steps the default run of benchmarks/gpu_engine.sh leaves out (its limits fill one device command):
# `ONLY=moe bash benchmarks/gpu_engine.sh` runs them; the summary lists them when they have records.
OPTIONAL_STEPS = ("moe", "structured", "kvcap", "tp", "whisper", "embed", "lora")

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


# How much each step does, a row per field: (the H200 run, the CPU smoke run).
_SIZES: dict[str, tuple[Any, Any]] = {
    "device": ("cuda", "cpu"),
    "dtype": ("bfloat16", "float32"),
    "correctness_models": ((TINY, "llama-3.2-1b"), (TINY,)),
    "correctness_prompt_lens": ((1, 5, 16, 17, 63, 128, 300, 700), (1, 5, 16, 17, 33, 40, 2, 9)),
    "correctness_tokens": (32, 8),
    "decode_batch_sizes": ((1, 256), (1, 4)),
    "decode_prompt_len": (1024, 24),
    "decode_max_batched_tokens": (16384, 64),
    "decode_steps": (50, 4),
    "split_steps": (20, 3),
    "profile_steps": (10, 2),
    "offline_prompts": (256, 4),
    "offline_input_len": (512, 16),
    "offline_output_len": (256, 6),
    "offline_transformers_prompts": (64, 2),
    "offline_static_batch": (256, 2),
    "nano_prompts": (256, 6),
    "nano_input_range": ((100, 1024), (4, 24)),
    "nano_output_range": ((100, 1024), (2, 8)),
    "nano_max_batched_tokens": (16384, 128),
    "online_input_len": (512, 16),
    "online_output_len": (128, 6),
    "online_runs": (((1, 16), (64, 256), (256, 512)), ((1, 2), (4, 6))),
    "kv_cache_gib": (None, 0.0625),
    "spec_prompts": (16, 4),
    "spec_pattern_len": (32, 6),
    "spec_prompt_len": (256, 20),
    # At batch 1 the 16 prompts run one after the other, 1024 tokens each way: ~2-5 s per
    # engine on an H200, which the step's 45 s limit affords beside start-up.
    "spec_output_len": (64, 16),
    "spec_batch_sizes": ((1, 16), (1, 2)),
}
GPU_SIZES = Sizes(**{name: gpu for name, (gpu, _) in _SIZES.items()})
SMOKE_SIZES = Sizes(**{name: smoke for name, (_, smoke) in _SIZES.items()})


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

    block_size = EngineConfig().cache.block_size
    need = sum(cdiv(n, block_size) for n in seq_lens)
    return max(need, cdiv(max_model_len, block_size)) + 16


def dummy_engine(
    model: str, device: str, dtype: str, seq_lens: Sequence[int], max_model_len: int,
    **options: Any,
):  # fmt: skip
    """An LLM of `model` with dummy weights and a KV cache that holds `seq_lens` at once
    (kv_blocks_for); `options` go to the LLM as they are."""
    from pagedserve.engine import LLM

    return LLM(
        model, device=device, dtype=dtype, load_format="dummy", max_model_len=max_model_len,
        num_kv_blocks=kv_blocks_for(seq_lens, max_model_len), **options,
    )  # fmt: skip


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
    worker = llm.engine.core.worker
    graphs = worker.runner.graphs
    return {
        "attention_backend": worker.attention_backend,
        # On CUDA the default loop schedules step N+1 while step N runs.
        "async_scheduling": worker.async_scheduling,
        "cuda_graphs": graphs is not None and bool(graphs.graphs),
        "graph_batch_sizes": None if graphs is None else list(graphs.batch_sizes),
        "kv_cache_blocks": worker.kv_plan.num_blocks,
        "max_model_len": llm.engine.max_model_len,
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


def offline_tok_s(llm, sizes: Sizes) -> float:
    """Output tokens per second of `sizes.offline_*` random prompts, greedy, after a short run
    that compiles out of the timing."""
    from pagedserve.engine import SamplingParams

    num, max_tokens = sizes.offline_prompts, sizes.offline_output_len
    ids = random_ids(num, sizes.offline_input_len, llm.engine.core.model_config.vocab_size, 11)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(ids[:8], params.clone(max_tokens=4))
    sync(sizes.device)
    start = time.perf_counter()
    llm.generate(ids, params)
    sync(sizes.device)
    return num * max_tokens / (time.perf_counter() - start)


def tiny_llama_prompts(scratch: Path, sizes: Sizes) -> tuple[str, list[list[int]]]:
    """The tiny Llama's folder (written into `scratch`) and the correctness prompts of `sizes`
    over its vocabulary."""
    vocab = TINY_LLAMA["vocab_size"]
    lens = sizes.correctness_prompt_lens
    prompts = [random_ids(1, n, vocab, i)[0] for i, n in enumerate(lens)]
    return write_tiny_model(scratch / "tiny-llama"), prompts


def offline_engine_sizes(sizes: Sizes) -> dict[str, int]:
    """The engine options of an A-against-B throughput run of the `sizes.offline_*` requests: a
    sequence slot each, a context rounded up to 256, and the KV blocks they need."""
    num, total = sizes.offline_prompts, sizes.offline_input_len + sizes.offline_output_len
    model_len = cdiv(total, 256) * 256
    return {
        "max_num_seqs": num,
        "max_model_len": model_len,
        "num_kv_blocks": kv_blocks_for([total] * num, model_len),
    }


def a_against_b(
    rec: Recorder,
    model: str,
    sizes: Sizes,
    part_key: str,
    variants: dict[str, str],
    build: Callable[[str], Any],
) -> None:
    """Offline throughput of the `sizes.offline_*` requests on an engine per variant (`build`
    makes it; the dummy weights are drawn once), and one record of both rates and their ratio
    (the second's over the first's): `variants` maps each variant to its rate's key."""
    throughput = {}
    for variant in variants:
        with rec.part(model=model, kind="throughput", **{part_key: variant}), reuse_dummy_weights():
            llm = build(variant)
            throughput[variant] = offline_tok_s(llm, sizes)
            llm.engine.close()
            del llm
            free_memory()
    if len(throughput) == 2:
        (a, a_key), (b, b_key) = variants.items()
        rec.write(
            {
                "model": model,
                "kind": "throughput",
                "dtype": sizes.dtype,
                "num_prompts": sizes.offline_prompts,
                "input_len": sizes.offline_input_len,
                "output_len": sizes.offline_output_len,
                a_key: round(throughput[a], 1),
                b_key: round(throughput[b], 1),
                "ratio": round(throughput[b] / throughput[a], 3),
            }
        )
