"""pagedserve's engine, in rooms by process and responsibility:

    frontend/  the caller's process (the API server, or a program using `LLM`): the clients of the
               core, inputs, outputs, detokenizing
    core/      the step loop (schedule, run the worker, update), beam search, the core's process
    worker/    running a model on a device: model runner, input batch, sampler, KV cache, CUDA
               graphs, tensor-parallel ranks
    models/    configurations, model files, tokenizers, layers and decoders, weights
    lora/      LoRA adapters: loading and checking them, their device slots, their projections

and, at this level, what every room shares: the options (`engine_config`), the messages between
the front end and the core (`messages`), structured outputs, the allocator setting.

The public names below load on first use (PEP 562), so that importing one room, such as the API
server's client of a core process, does not import the model code with `LLM`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# First, before any torch work: with PAGEDSERVE_CPU_ISA set it lowers torch's and oneDNN's ISA too
# (kernels/cpu_features.py), which only works before torch first computes.
import pagedserve.kernels  # noqa: F401

if TYPE_CHECKING:  # the names for type checkers and editors (`as` marks them re-exported)
    from pagedserve.engine.core.beam_search import BeamSearchParams as BeamSearchParams
    from pagedserve.engine.engine_config import EngineConfig as EngineConfig
    from pagedserve.engine.frontend.llm import LLM as LLM
    from pagedserve.engine.frontend.llm_engine import LLMEngine as LLMEngine
    from pagedserve.engine.frontend.outputs import BeamSearchOutput as BeamSearchOutput
    from pagedserve.engine.frontend.outputs import BeamSearchSequence as BeamSearchSequence
    from pagedserve.engine.frontend.outputs import CompletionOutput as CompletionOutput
    from pagedserve.engine.frontend.outputs import Logprob as Logprob
    from pagedserve.engine.frontend.outputs import RequestOutput as RequestOutput
    from pagedserve.scheduler import LoRARequest as LoRARequest
    from pagedserve.scheduler import SamplingParams as SamplingParams

_EXPORTS = {
    "LLM": "pagedserve.engine.frontend.llm",
    "BeamSearchOutput": "pagedserve.engine.frontend.outputs",
    "BeamSearchParams": "pagedserve.engine.core.beam_search",
    "BeamSearchSequence": "pagedserve.engine.frontend.outputs",
    "CompletionOutput": "pagedserve.engine.frontend.outputs",
    "EngineConfig": "pagedserve.engine.engine_config",
    "LLMEngine": "pagedserve.engine.frontend.llm_engine",
    "Logprob": "pagedserve.engine.frontend.outputs",
    "LoRARequest": "pagedserve.scheduler",
    "RequestOutput": "pagedserve.engine.frontend.outputs",
    "SamplingParams": "pagedserve.scheduler",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
