"""pagedserve engine: models, weights, tokenizer, sampler, model runner, LLMEngine and the offline
LLM API."""

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from scheduler import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
