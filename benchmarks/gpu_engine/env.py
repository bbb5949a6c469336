"""env: versions, GPU, commit, and which of the wheels import."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Any

from benchmarks.gpu_engine import harness


def step_env(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    import importlib.util
    import platform

    import torch

    info: dict[str, Any] = {
        "commit": harness.commit_id(),
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
