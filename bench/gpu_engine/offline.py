"""offline: pagedserve against transformers' generate_batch and generate
(bench.compare_transformers), each in a fresh subprocess."""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.bench.gpu_engine import harness


def step_offline(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    from pagedserve.bench import compare_transformers

    model = harness.model_path(args.model, args.scratch)
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
        argv += ["--num-kv-blocks", str(harness.kv_blocks_for(lens, max_model_len))]
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
