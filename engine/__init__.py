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

Where each input is checked
---------------------------

Inputs are checked once, where they enter; the layers below assert their invariants. A ValueError
raised while serving a request is a 400 over HTTP (server/errors.py `as_api_error`, raised inside
the route by `ErrorMappingRoute`, so the connection stays open).

- engine options: each field's type and choices (options.py), then each group's `__post_init__`
  (config_groups.py; `--kv-events-config` by `parse_kv_events_config` there too) and what spans
  groups in `EngineConfig` (engine_config.py); the CLI prints `error: ...` and exits 2;
- the model's config: `ModelConfig.__post_init__` and its readers (`hf_config.config_from_hf_dict`,
  `gguf_config.config_from_gguf`): unsupported architectures, activations and rope types;
- sampling values: `SamplingParams.__post_init__` (scheduler/sampling_params.py), naming the field;
- a prompt: `InputProcessor.process_prompt` (frontend/inputs.py): empty, ids outside the
  vocabulary, no room for an output token; in the caller's process, never the core's;
- a structured-output constraint: its shape in `StructuredOutputs.__post_init__`; whether xgrammar
  builds it in structured_output.py `check`, from `InputProcessor.process_inputs`; over HTTP,
  which field asked for it in server/openai/structured_outputs.py;
- a LoRA adapter: `InputProcessor.check_lora` (lora/adapter.py `load_adapter` against the model),
  once per adapter id; the server's `--lora-modules` and `/v1/load_lora_adapter` call it when a
  name is added;
- tools and tool_choice: server/openai/tool_calls.py `plan_tools`; the other HTTP-only rules
  (`max_tokens` beyond the context, an unknown model, unsupported fields): the handlers;
- scheduler and block invariants: `assert` in `SchedulerConfig` and `Scheduler.add_request`;
  misuse of `BlockPool` / `KVCacheManager` raises: a bug, not bad input;
- kernel arguments: kernels/validation.py, only with PAGEDSERVE_CHECK_KERNEL_ARGS=1 (the tests set
  it).

Whisper and BERT through the one engine
---------------------------------------

A Whisper model (an encoder-decoder) and an embedding model are served by the same front end,
core, scheduler and worker as a decoder: no second engine.

- Whisper: server/audio/serving_transcriptions.py cuts the audio into 30-second windows
  (frontend/audio.py), each an engine request of its own (an `AudioPrompt`), so windows run side
  by side in the batch; each is one segment of the answer, and none is conditioned on the text of
  the window before it. The scheduler admits such a request when its encoder blocks
  (`SchedulerConfig.encoder_blocks`, from the one pool) and its decoder slots fit, its encoder pass
  charged to the step's token budget (at least one admission a step); encoder blocks are allocated
  once, never grown, shared or swapped (scheduler/kv_encoder.py). The runner fills them at
  admission (`WhisperModel.encode_into_cache`, models/whisper.py). The prefix cache is off (the KV
  depends on the audio). Refused, naming the option (worker/worker.py
  `check_encoder_decoder_options`): tensor parallelism, n-gram drafts, GGUF quantization, an fp8
  KV cache; an audio request samples one sequence (`InputProcessor.process_inputs`). No CUDA
  graphs; on CUDA its KV budget is the free memory times `--gpu-memory-utilization`, without a
  profiled step. Timestamps are not predicted (`<|notimestamps|>`; verbose_json's segments are the
  windows).
- Embeddings (`--task`, models/bert_config.py): a BERT encoder (models/bert.py) or a decoder with
  `--task embed`. A prompt runs whole in one step (`SchedulerConfig.prefill_only`) and is pooled
  there (worker/pooler.py); the request ends with that step. A BERT engine allocates no KV tensors
  (its blocks only count admissions). Prefix caching, asynchronous scheduling and CUDA graphs are
  off. Refused for BERT (`check_encoder_only_options`): tensor parallelism, n-gram drafts, GGUF
  quantization, swap preemption.
- LoRA adapters apply to decoder models that generate: an engine of another kind refuses
  `--enable-lora` (`Worker._build_lora`; with `--task embed`, EngineConfig's checks across groups).
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
