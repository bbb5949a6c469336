"""--sweep: the launch configurations of the decode and prefill kernels, timed on a few cases
against SDPA, instead of the regular run."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from benchmarks.gpu_kernels import harness
from benchmarks.gpu_kernels.attention import (
    PagedBatch,
    build_batch,
    causal_sdpa,
    decode_label,
    prefill_label,
)
from benchmarks.gpu_kernels.plans import HeadShape, Plan
from pagedserve.kernels import reference
from pagedserve.kernels.triton_attention import KernelConfig

SWEEP_SCENARIOS = ("decode", "prefill")


def run_sweep(
    report: harness.Report, setup: harness.Setup, plan: Plan, scenarios: list[str]
) -> None:
    """Time each launch configuration in `plan` on its cases, against SDPA in the same run.

    Picks the defaults of `kernels.triton_attention.decode_config` / `extend_config` (and the
    split heuristic) from measurements rather than guesses. One "sweep" record per (case,
    config): its time, the ratio to SDPA, and whether the output matched the reference (a config
    that fails to compile, e.g. for lack of shared memory, is recorded with its error). A sweep
    never fails the run: it only informs.
    """
    kernels = setup.kernels
    if not hasattr(kernels, "decode"):
        raise ValueError(f"--sweep needs kernels.triton_attention, not {kernels.__name__}")
    if "decode" in scenarios:
        for shape, case in plan.sweep_decode:
            b = build_batch(setup, shape, case.batch, case.context, 1, seed=case.context)
            label = decode_label(shape, case)
            runs = [(cfg, None) for cfg in plan.decode_configs]
            if case.batch == 1:  # one long context: how many slices
                runs += [(None, splits) for splits in plan.sweep_splits]
            _sweep_case(report, setup, b, shape, label, runs, decode=True)
            del b
            _free(setup.device)
    if "prefill" in scenarios:
        for shape, case in plan.sweep_prefill:
            n = case.new_tokens
            b = build_batch(setup, shape, case.num_seqs, case.prefix + n, n, seed=n)
            label = prefill_label(shape, case)
            runs = [(cfg, None) for cfg in plan.prefill_configs]
            _sweep_case(report, setup, b, shape, label, runs, decode=False, prefix=case.prefix)
            del b
            _free(setup.device)


def _sweep_case(
    report: harness.Report,
    setup: harness.Setup,
    b: PagedBatch,
    shape: HeadShape,
    label: harness.Record,
    runs: list[tuple[KernelConfig | None, int | None]],
    *,
    decode: bool,
    prefix: int = 0,
) -> None:
    kernels, device = setup.kernels, setup.device
    scale = shape.head_dim**-0.5
    args = (*b.paged_args(), scale, None)
    want = reference.paged_attention(*b.paged_args(), scale)
    if decode:
        max_context = b.block_tables.shape[1] * harness.BLOCK_SIZE
        default_splits = kernels.num_decode_splits(
            b.q.shape[0], shape.num_kv_heads, max_context, device
        )

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(b.q_sdpa, b.k, b.v, scale=scale, enable_gqa=True)
    else:
        sdpa = causal_sdpa(b, scale, prefix)[0]

    t_sdpa = harness.time_us(sdpa, device, setup.cuda_graph)
    out = torch.empty_like(b.q)
    for cfg, splits in runs:
        record: harness.Record = {"kind": "sweep", **label, "sdpa_time_us": round(t_sdpa, 2)}
        if decode:
            splits = splits or default_splits
            record |= {"num_splits": splits, "default_splits": default_splits}
            cfg = cfg or kernels.decode_config(shape.head_dim)

            def call(cfg=cfg, splits=splits) -> None:
                kernels.decode(*args, out, splits, cfg)
        else:
            cfg = cfg or kernels.extend_config(
                shape.head_dim, shape.num_heads // shape.num_kv_heads
            )

            def call(cfg=cfg) -> None:
                kernels.extend(*args, out, cfg)

        record["config"] = dataclasses.asdict(cfg)
        try:
            out.fill_(float("nan"))
            call()
            diff = (out.float() - want.float()).abs()
            record["matches_reference"] = bool(
                (diff <= harness.ATOL + harness.RTOL * want.float().abs()).all()
            )
            t = harness.time_us(call, device, setup.cuda_graph)
            record |= {"time_us": round(t, 2), "ratio": harness.significant(t_sdpa / t)}
        except Exception as exc:  # e.g. out of shared memory: the config is not an option
            record["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        report.emit(record)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_sweep(records: list[harness.Record]) -> str:
    """Best configuration per swept case, and the default's time for comparison."""
    by_case: dict[str, list[harness.Record]] = {}
    for r in records:
        if r["kind"] == "sweep" and "time_us" in r and r["matches_reference"]:
            by_case.setdefault(r["case"], []).append(r)
    lines = []
    for case, rs in by_case.items():
        best = min(rs, key=lambda r: r["time_us"])
        lines.append(
            f"sweep {case:28} best {best['time_us']:9.1f} us (ratio {best['ratio']:.3g}) "
            f"config {best['config']}"
            + (f" splits {best['num_splits']}" if "num_splits" in best else "")
        )
    return "\n".join(lines)
