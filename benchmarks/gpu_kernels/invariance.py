"""--invariance: one request, one answer on the GPU (issue 58), instead of the regular run.

First the checks: the default paged attention (`triton_attention.invariant_config`) gives one
stream's queries the same bits whatever shares the step: its last token as a decode alone, among
`invariance_batch - 1` other decodes of other lengths (first, in the middle, last), in a mixed
step of prefills, extends and decodes; its prompt in one chunk, in chunks, and its last chunk as
an extend beside other sequences; in --dtype and float32, plain and with a sliding window and
soft-capping. A "check" record each, exact (atol = rtol = 0, ok only when the bits are equal),
with `variant_same_bits`: whether the batch-variant dispatch (PAGEDSERVE_BATCH_VARIANT=1) gives
equal bits too (it need not; where it does not, the check could have failed).

Then the cost: decode and prefill steps timed by default and with PAGEDSERVE_BATCH_VARIANT=1
(split-context decode kernel, 128-row extend tiles), an "invariance" record each with both times
and `cost` = default / batch-variant time (above 1: the invariant default is slower).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.attention import (
    PagedBatch,
    _dtype_name,
    build_batch,
    decode_label,
    prefill_label,
)
from benchmarks.gpu_kernels.plans import HeadShape, Plan
from pagedserve.kernels import cpu_features, reference

# The checks' options: plain, then Gemma 2's soft-capping with a window shorter than the prompt.
CHECK_OPTIONS = ({}, {"sliding_window": 100, "softcap": 50.0})


@dataclass
class Stream:
    """One sequence's q, k and v at every position: a step attends a span of its positions."""

    q: torch.Tensor  # [length, H, D]
    k: torch.Tensor  # [length, Hkv, D]
    v: torch.Tensor


Span = tuple[Stream, int, int]  # positions [start, end) are the step's new tokens


def random_stream(
    length: int, shape: HeadShape, dtype: torch.dtype, device: torch.device, seed: int
) -> Stream:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(length, heads, shape.head_dim, generator=gen, device=device).to(dtype)

    return Stream(randn(shape.num_heads), randn(shape.num_kv_heads), randn(shape.num_kv_heads))


def attend_spans(
    paged_attention, spans: list[Span], scale: float, seed: int = 0, **kwargs
) -> list[torch.Tensor]:
    """One step: positions [start, end) of each stream are its new tokens, over its keys
    [0, end) written to randomly placed blocks (of harness.BLOCK_SIZE) of one cache. Returns each
    span's output."""
    first = spans[0][0]
    kv_shape, dtype, device = first.k.shape[1:], first.k.dtype, first.k.device
    bs = harness.BLOCK_SIZE
    blocks = [-(-end // bs) for _, _, end in spans]
    physical = list(range(sum(blocks) + 2))
    random.Random(seed).shuffle(physical)
    k_cache = torch.zeros(len(physical), bs, *kv_shape, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.zeros(len(spans), max(blocks) + 1, dtype=torch.int32)
    for i, ((stream, _, end), n) in enumerate(zip(spans, blocks, strict=True)):
        own, physical = physical[:n], physical[n:]
        tables[i, :n] = torch.tensor(own)
        positions = torch.arange(end)
        slots = (tables[i, positions // bs].long() * bs + positions % bs).to(device)
        k_cache.view(-1, *kv_shape)[slots] = stream.k[:end]
        v_cache.view(-1, *kv_shape)[slots] = stream.v[:end]
    q = torch.cat([stream.q[start:end] for stream, start, end in spans])
    lens = [end - start for _, start, end in spans]
    starts = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([end for _, _, end in spans], dtype=torch.int32)
    step = (tables, seq_lens, starts)
    out = paged_attention(q, k_cache, v_cache, *(t.to(device) for t in step), scale, **kwargs)
    return list(out.split(lens))


@contextlib.contextmanager
def batch_variant(on: bool) -> Iterator[None]:
    """PAGEDSERVE_BATCH_VARIANT=1 (or =0) for the calls inside, then as it was."""
    env = cpu_features.BATCH_VARIANT_ENV
    before = os.environ.get(env)
    os.environ[env] = "1" if on else "0"
    cpu_features.batch_variant.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
        cpu_features.batch_variant.cache_clear()


def _compositions(
    plan: Plan, shape: HeadShape, dtype: torch.dtype, device: torch.device
) -> tuple[Stream, list[tuple[str, list[Span], int, slice]]]:
    """The target stream, and the steps it is checked in: (name, spans, which span is the
    target's, the target's positions that span holds)."""
    length, batch, chunk = plan.invariance_length, plan.invariance_batch, plan.invariance_chunk
    target = random_stream(length, shape, dtype, device, seed=0)
    rng = random.Random(1)
    others = [
        random_stream(rng.randrange(1, 2 * length), shape, dtype, device, seed=i)
        for i in range(1, batch)
    ]
    decodes = [(s, len(s.q) - 1, len(s.q)) for s in others]
    last = (target, length - 1, length)
    steps = [("decode alone", [last], 0, slice(length - 1, length))]
    for at in (0, batch // 2, batch - 1):
        spans = decodes[:at] + [last] + decodes[at:]
        steps.append((f"decode {at} of {batch}", spans, at, slice(length - 1, length)))
    # A prefill, an extend and a decode beside the target's decode, then its last chunk.
    a, b = others[:2]
    mixed = [(a, 0, len(a.q)), (b, len(b.q) // 2, len(b.q)), decodes[2]]
    steps.append(("decode in a mixed step", [*mixed, last], 3, slice(length - 1, length)))
    tail = (target, length - chunk, length)
    steps.append(("last chunk in a mixed step", [*mixed, tail], 3, slice(length - chunk, length)))
    return target, steps


def run_checks(report: harness.Report, setup: harness.Setup, plan: Plan) -> None:
    """The bitwise checks, for --dtype and float32 and each of CHECK_OPTIONS (the smoke plan's:
    --dtype's plain ones; see the module's docstring)."""
    shape = plan.invariance_shapes[0]
    every = plan.invariance_every_check
    for dtype in dict.fromkeys((setup.dtype, torch.float32) if every else (setup.dtype,)):
        for options in CHECK_OPTIONS if every else CHECK_OPTIONS[:1]:
            target, steps = _compositions(plan, shape, dtype, setup.device)
            outputs = []
            for variant in (False, True):
                with batch_variant(variant):
                    outputs.append(_outputs(setup, plan, shape, target, steps, options))
            (whole, results), (variant_whole, variant_results) = outputs
            name = f"{shape.name} {_dtype_name(dtype)}" + (" window softcap" if options else "")
            for (step_name, got, rows), (_, variant_got, _) in zip(
                results, variant_results, strict=True
            ):
                label = harness.case_record(
                    "invariance", f"{name}: {step_name}", shape, dtype=_dtype_name(dtype),
                    **options,
                )  # fmt: skip
                report.emit(
                    {"kind": "check", **label, "max_abs_err": harness.max_abs_err(got, whole[rows])}
                    | {"atol": 0.0, "rtol": 0.0, "ok": _same_bits(got, whole[rows])}
                    | {"variant_same_bits": _same_bits(variant_got, variant_whole[rows])}
                )


def _outputs(
    setup: harness.Setup,
    plan: Plan,
    shape: HeadShape,
    target: Stream,
    steps: list[tuple[str, list[Span], int, slice]],
    options: dict,
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor, slice]]]:
    """The target's prompt in one chunk (every position), then its rows in each composition:
    the prompt in chunks of plan.invariance_chunk, and `steps`."""
    attention, scale = setup.kernels.paged_attention, shape.head_dim**-0.5
    length, chunk = plan.invariance_length, plan.invariance_chunk
    (whole,) = attend_spans(attention, [(target, 0, length)], scale, **options)
    pieces = [
        attend_spans(attention, [(target, s, min(s + chunk, length))], scale, seed=s, **options)[0]
        for s in range(0, length, chunk)
    ]
    results = [("prompt in chunks", torch.cat(pieces), slice(0, length))]
    for step_name, spans, index, rows in steps:
        got = attend_spans(attention, spans, scale, seed=len(results), **options)[index]
        results.append((step_name, got, rows))
    return whole, results


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: -0.0 is not 0.0, and a NaN is itself."""
    return torch.equal(_bits(a), _bits(b))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def run_costs(report: harness.Report, setup: harness.Setup, plan: Plan) -> None:
    """Each decode and prefill case timed by default and with PAGEDSERVE_BATCH_VARIANT=1."""
    for shape in plan.invariance_shapes:
        for case in plan.invariance_decode:
            label = decode_label(shape, case)
            b = build_batch(setup, shape, case.batch, case.context, 1, seed=case.context)
            _time_both(report, setup, shape, label, b)
        for case in plan.invariance_prefill:
            n = case.new_tokens
            label = prefill_label(shape, case)
            b = build_batch(setup, shape, case.num_seqs, case.prefix + n, n, seed=n)
            _time_both(report, setup, shape, label, b)


def _time_both(
    report: harness.Report,
    setup: harness.Setup,
    shape: HeadShape,
    label: harness.Record,
    b: PagedBatch,
) -> None:
    """One step timed both ways (each checked against the reference, loosely); one record."""

    def run() -> None:
        scale = shape.head_dim**-0.5
        want = reference.paged_attention(*b.paged_args(), scale)
        times, errors = [], []
        for variant in (False, True):
            with batch_variant(variant):
                out = torch.empty_like(b.q)

                def call(out=out) -> None:
                    setup.kernels.paged_attention(*b.paged_args(), scale, out=out)

                call()
                errors.append(harness.max_abs_err(out, want))
                times.append(harness.time_us(call, setup.device))
        cost = harness.significant(times[0] / times[1])
        report.emit(
            {"kind": "invariance", **label, "time_us": round(times[0], 2)}
            | {"variant_time_us": round(times[1], 2), "cost": cost}
            | {"max_abs_err": errors[0], "variant_max_abs_err": errors[1]}
        )

    harness.run_case(report, setup.device, label, run)


def run_invariance(report: harness.Report, setup: harness.Setup, plan: Plan) -> None:
    """--invariance: the checks (one case: an error stops them), then each timed case."""
    harness.run_case(
        report, setup.device, {"scenario": "invariance", "case": "checks"},
        lambda: run_checks(report, setup, plan),
    )  # fmt: skip
    run_costs(report, setup, plan)


def format_invariance(records: list[harness.Record]) -> str:
    """The checks' verdict and each timed case's cost, for people."""
    checks = [r for r in records if r["kind"] == "check" and r["scenario"] == "invariance"]
    bad = [r["case"] for r in checks if not r["ok"]]
    differ = sum(not r["variant_same_bits"] for r in checks)
    lines = [
        f"invariance: {len(checks) - len(bad)}/{len(checks)} compositions bit for bit the same "
        f"by default; {differ} differ with PAGEDSERVE_BATCH_VARIANT=1"
        + (f"; FAILED: {', '.join(bad)}" if bad else "")
    ]
    for r in records:
        if r["kind"] == "invariance":
            lines.append(
                f"cost {r['case']:28} default {r['time_us']:9.1f} us, batch-variant "
                f"{r['variant_time_us']:9.1f} us: x{r['cost']:.3g}"
            )
    return "\n".join(lines)
