"""Host time of one decode step: scheduling, input preparation, sampling bookkeeping, output
updates and detokenization, with the model's forward stubbed out.

    python -m benchmarks.host_step --batch-size 256 --context 1000 --steps 60
    python -m benchmarks.host_step --batch-size 256 --context 1000 --device-ms 3 \
        --async-scheduling
    python -m benchmarks.host_step --batch-size 256 --context 1000 --device-ms 3 \
        --async-scheduling --core-loop

A 1-layer, 64-wide Llama on CPU (vocab 2048, dummy weights) whose forward returns zeros, with
SmolLM2's real tokenizer for detokenization: what remains is the engine's own Python and the
small lm_head matmul. Prints one JSON object: the step's wall time and the time inside each part
(schedule, launch, of which prepare, the lm_head and the sampler's tensor work, finish (the
sampled ids back on the host), update_from_output, the engine's per-request output work);
`core_process_step_ms`: the step without the front end's output processing but with the
encoding of its outputs, i.e. the work of the engine core's loop when it runs in its own
process; and `core_host_ms`: that loop without the lm_head and the sampler's tensor work, which
a GPU runs (the CPU computes them here), i.e. the host time a device step cannot hide.

`--device-ms D` simulates a device (a GPU stream): each launched step occupies it D ms, in launch
order, and a step's results are ready only when its turn is over. Without asynchronous
scheduling a step then costs host + D; with it, max(host, D) once the host hides behind it.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from benchmarks.options import add_int_options
from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap
from pagedserve.engine.messages import CoreOutputs
from pagedserve.scheduler.utils import cdiv

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}


def measure(
    batch_size: int,
    context: int,
    steps: int,
    device_ms: float | None = None,
    async_scheduling: bool = False,
    core_loop: bool = False,
) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    # Requests admitted first decode while the last ones prefill (2048 tokens a step): enough
    # tokens for all of them to be decoding together for `steps` steps and the warm-up.
    max_tokens = steps + 16 + cdiv(batch_size * context, 2048)
    max_model_len = context + max_tokens + 16
    llm = LLM(
        str(folder),
        load_format="dummy",
        tokenizer="smollm2-135m-instruct",
        device="cpu",
        dtype="float32",
        num_kv_blocks=batch_size * cdiv(max_model_len, 16),
        max_num_seqs=batch_size,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
    )
    engine = llm.engine
    rng = random.Random(0)
    # Deltas, as the server asks for them.
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta"
    )
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randrange(3, 2000) for _ in range(context)], params)
    while len(engine.step()) < batch_size:  # until every request has its first token
        pass
    hidden = TINY_CONFIG["hidden_size"]

    engine.core.worker.model.forward = lambda input_ids, *_: torch.zeros(input_ids.shape[0], hidden)
    undo = None
    if device_ms is not None:
        undo = simulate_device(engine.core.worker.runner, device_ms / 1e3)

    parts: collections.Counter[str] = collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts[label] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(engine.core.scheduler, "schedule", "schedule")
    timed(engine.core.scheduler, "update_from_output", "update_from_output")
    timed(engine.core.worker.runner, "launch", "launch")
    timed(engine.core.worker.runner.input_batch, "prepare", "launch.prepare")
    timed(engine.core.worker.runner, "_finish", "finish")
    timed(engine.core.worker.runner.sampler, "sample", "launch.sampler")
    timed(engine.core.worker.model, "compute_logits", "launch.lm_head")
    # The split at the process boundary: what the core process would run per step (step_samples,
    # plus encoding its outputs for the socket) and what the API server would (process).
    timed(engine.core, "step_samples", "core.step_samples")
    timed(engine.output_processor, "process", "front_end.process")
    inner_step_samples = engine.core.step_samples
    last_samples = []

    def step_samples_kept():
        last_samples[:] = inner_step_samples()
        return last_samples[:]

    engine.core.step_samples = step_samples_kept
    step = engine.step
    if core_loop:  # what the core process's loop runs: no front end, outputs encoded to send
        encoder = msgspec.msgpack.Encoder()

        def step():
            encoder.encode(CoreOutputs(engine.core.step_samples(), engine.stats()))

    for _ in range(5):
        step()
    parts.clear()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    parts_ms = {k: round(v / steps * 1e3, 3) for k, v in sorted(parts.items())}
    named = sum(parts_ms[k] for k in ("schedule", "launch", "finish", "update_from_output"))
    result = {
        "batch_size": batch_size,
        "context": context,
        "steps": steps,
        "async_scheduling": engine.core.worker.async_scheduling,
        "device_ms": device_ms,
        "loop": "core" if core_loop else "engine",
        "step_ms": round(step_ms, 3),
        "parts_ms": parts_ms,
    }
    if undo is None and not core_loop:
        result["outputs_and_detokenize_ms"] = round(step_ms - named, 3)
        # With the core in its own process, its loop runs this much host work per step: the
        # step without the front end's work, plus encoding a step's outputs for the socket.
        encoder, message = msgspec.msgpack.Encoder(), CoreOutputs(last_samples, engine.stats())
        start = time.perf_counter()
        for _ in range(steps):
            encoder.encode(message)
        encode_ms = (time.perf_counter() - start) / steps * 1e3
        parts_ms["core.encode"] = round(encode_ms, 3)
        core_ms = step_ms - parts_ms["front_end.process"] + encode_ms
        result["core_process_step_ms"] = round(core_ms, 3)
        # What the device does on a GPU (queued kernels there, computed here on the CPU): the
        # lm_head matmul and the sampler's tensor work. The rest is the core's host time.
        device_work = parts_ms["launch.lm_head"] + parts_ms["launch.sampler"]
        result["core_host_ms"] = round(core_ms - device_work, 3)
    if undo is not None:
        undo()
    return result


def simulate_device(runner, seconds: float):
    """Every launched step keeps a simulated device busy `seconds`, in launch order (a GPU stream):
    it starts when both it is launched and the previous step is done, and its result() waits
    until it is over. A deadline per step, no thread: a device needs no host thread (nor the
    GIL) while it runs. Returns what undoes the patches."""
    import pagedserve.engine.worker.model_runner as model_runner

    launch = runner.launch
    result = model_runner.StepHandle.result
    device_free_at = 0.0

    def launch_on_device(out):
        nonlocal device_free_at
        handle = launch(out)
        device_free_at = max(time.perf_counter(), device_free_at) + seconds
        handle.device_done_at = device_free_at
        return handle

    def result_after_device(handle):
        done_at = getattr(handle, "device_done_at", None)
        if done_at is not None and (wait := done_at - time.perf_counter()) > 0:
            time.sleep(wait)
        return result(handle)

    def undo():
        runner.launch = launch
        model_runner.StepHandle.result = result

    runner.launch = launch_on_device
    model_runner.StepHandle.result = result_after_device
    return undo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    add_int_options(parser, batch_size=256, context=1000, steps=60)
    parser.add_argument(
        "--device-ms", type=float, default=None, help="simulate a device busy this long per step"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="schedule step N+1 while step N runs",
    )
    parser.add_argument(
        "--core-loop",
        action="store_true",
        help="time the engine core's loop alone (step_samples and encoding its outputs), as it "
        "runs in its own process, instead of the in-process engine step with its front end",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    keep_large_allocations_in_heap()  # as `pagedserve` does
    result = measure(
        args.batch_size,
        args.context,
        args.steps,
        args.device_ms,
        args.async_scheduling,
        args.core_loop,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
