"""decode: decode step time at batch 1 and 256 with ~1k context, graphs and eager, against the
memory roofline; the host-time split of a step; a profiler summary."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.gpu_engine import harness
from pagedserve.scheduler.utils import cdiv

# H200: ~4.3 TB/s measured copy bandwidth (GPU.md); the roofline of a decode step is the bytes it
# must read (weights and the KV cache) at this rate.
PEAK_BANDWIDTH = 4.3e12
DECODE_TARGET_MS_BATCH_1 = 0.9


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
    runner = engine.core.worker.runner
    # "execute" is the launch of a step (prepare, forward, logits, sample: kernels queued); the
    # wait for its sampled ids (StepHandle.result) falls in step_other_ms.
    targets = [
        ("schedule", engine.core.scheduler, "schedule"),
        ("execute", runner, "launch"),
        ("update", engine.core.scheduler, "update_from_output"),
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

    def __init__(self, engine, batch_size: int, sizes: harness.Sizes, num_steps: int) -> None:
        from pagedserve.engine import SamplingParams

        self.engine = engine
        self.batch_size = batch_size
        self.prompt_len = sizes.decode_prompt_len
        est_prefill = cdiv(batch_size * self.prompt_len, sizes.decode_max_batched_tokens) + 2
        # Early requests decode while later ones prefill: room for those tokens too.
        params = SamplingParams(
            temperature=0, max_tokens=est_prefill + num_steps + 16, ignore_eos=True
        )
        vocab = engine.core.model_config.vocab_size
        prompts = harness.random_ids(batch_size, self.prompt_len, vocab, seed=batch_size)
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


def _time_decode(
    llm, batch_size: int, sizes: harness.Sizes, base: dict[str, Any], rec: harness.Recorder
) -> None:
    """Time decode_steps pure decode steps (engine.step() wall time, host work included) against
    the memory roofline, then split split_steps of them by part."""

    engine = llm.engine
    config = engine.core.model_config
    device = str(engine.core.worker.device)
    num_steps = 3 + sizes.decode_steps + sizes.split_steps
    with _DecodeBatch(engine, batch_size, sizes, num_steps) as batch:
        for _ in range(3):
            batch.step()
        start_counts = dict(batch.counts)
        times = []
        harness.sync(device)
        for _ in range(sizes.decode_steps):
            t0 = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - t0)
        harness.sync(device)
        all_decode = all(batch.counts[r] - start_counts[r] == sizes.decode_steps for r in batch.ids)
        # Context each sequence attends to, averaged over the timed steps.
        mean_context = (
            sum(batch.prompt_len + start_counts[r] for r in batch.ids) / batch_size
            + (sizes.decode_steps - 1) / 2
        )
        median = statistics.median(times)
        dtype_bytes = engine.core.worker.dtype.itemsize
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
            "step_ms_p90": round(harness.percentile(times, 90) * 1000, 4),
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
                wall = _wall_of_steps(batch, device, sizes.split_steps)
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


def _wall_of_steps(batch: _DecodeBatch, device: str, num_steps: int) -> float:
    """Seconds that `num_steps` decode steps take, the device synchronised before and after."""
    harness.sync(device)
    t0 = time.perf_counter()
    for _ in range(num_steps):
        batch.step()
    harness.sync(device)
    return time.perf_counter() - t0


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
    llm, batch_size: int, sizes: harness.Sizes, base: dict[str, Any], rec: harness.Recorder
) -> None:
    """torch.profiler over profile_steps pure decode steps: GPU time against wall time."""
    from torch.profiler import ProfilerActivity, profile

    device = str(llm.engine.core.worker.device)
    with _DecodeBatch(llm.engine, batch_size, sizes, 2 + sizes.profile_steps) as batch:
        for _ in range(2):
            batch.step()
        activities = [ProfilerActivity.CPU]
        if device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            wall = _wall_of_steps(batch, device, sizes.profile_steps)
    rec.write(
        {
            **base,
            "kind": "profile",
            "batch_size": batch_size,
            "num_steps": sizes.profile_steps,
            **_kernel_summary(prof, sizes.profile_steps, wall, device),
        }
    )


def step_decode(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """Timings first for both engines, profiles after (eager first): a profiler that fails or
    hangs with CUDA graphs cannot cost the timings."""

    model = harness.model_path(args.model, args.scratch)
    max_batch = max(sizes.decode_batch_sizes)
    longest = sizes.decode_prompt_len + 3 + sizes.decode_steps + sizes.split_steps + 64
    longest += cdiv(max_batch * sizes.decode_prompt_len, sizes.decode_max_batched_tokens)
    max_model_len = cdiv(longest, 256) * 256
    phases = ((False, _time_decode), (True, _time_decode), (True, _profile_decode))
    phases += ((False, _profile_decode),)
    llm, llm_eager = None, None
    with harness.reuse_dummy_weights():
        for eager, measure in phases:
            base = {"model": args.model, "dtype": sizes.dtype, "enforce_eager": eager}
            with rec.part(**base, kind=measure.__name__.strip("_")):
                if llm is None or llm_eager != eager:
                    llm = None
                    harness.free_memory()
                    llm = harness.dummy_engine(
                        model, sizes.device, sizes.dtype, [max_model_len] * max_batch,
                        max_model_len, enforce_eager=eager, max_num_seqs=max_batch,
                        max_num_batched_tokens=sizes.decode_max_batched_tokens,
                    )  # fmt: skip
                    llm_eager = eager
                base.update(harness.engine_info(llm))
                for batch_size in sizes.decode_batch_sizes:
                    with rec.part(**base, kind=measure.__name__.strip("_"), batch_size=batch_size):
                        measure(llm, batch_size, sizes, base, rec)
        llm = None
        harness.free_memory()
