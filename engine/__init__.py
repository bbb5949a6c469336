"""pagedserve engine: models, weights, tokenizer, sampler, model runner, LLMEngine and the offline
LLM API."""

from pagedserve.engine.core.beam_search import BeamSearchParams
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.llm import LLM
from pagedserve.engine.frontend.llm_engine import LLMEngine
from pagedserve.engine.frontend.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from pagedserve.scheduler import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
