"""offline: pagedserve against transformers' generate_batch and generate
(bench.compare_transformers), each in a fresh subprocess."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.gpu_engine import harness
from benchmarks.options import flags


def step_offline(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    from benchmarks import compare_transformers

    model = harness.model_path(args.model, args.scratch)
    max_model_len = sizes.offline_input_len + sizes.offline_output_len + 256
    lens = [sizes.offline_input_len + sizes.offline_output_len] * sizes.offline_prompts
    argv = flags(
        model=model, load_format="dummy", device=sizes.device, dtypes=sizes.dtype,
        num_prompts=sizes.offline_prompts, input_len=sizes.offline_input_len,
        output_len=sizes.offline_output_len,
    ) + ["--engines", *compare_transformers.ENGINES] + flags(
        transformers_num_prompts=sizes.offline_transformers_prompts,
        static_batch_size=sizes.offline_static_batch, max_model_len=max_model_len,
        # The CPU default is a 4 GiB cache.
        num_kv_blocks=harness.kv_blocks_for(lens, max_model_len) if args.smoke else None,
    )  # fmt: skip
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
