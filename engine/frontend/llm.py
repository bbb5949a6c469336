"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(conversations)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from pagedserve.engine.core.beam_search import BeamSearchParams, beam_score
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.inputs import EMBEDDING_PARAMS, NewRequest
from pagedserve.engine.frontend.llm_engine import LLMEngine
from pagedserve.engine.frontend.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    PoolingOutput,
    RequestOutput,
)
from pagedserve.engine.models.tokenizer import apply_chat_template
from pagedserve.engine.tp_endpoint import TPEndpoint
from pagedserve.scheduler import LoRARequest, SamplingParams

PromptInput = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Runs batches of prompts to completion through the continuous-batching engine.

    LLM(model="smollm2-135m-instruct", device="cpu", dtype="float32", ...): the keyword arguments
    are EngineConfig's fields (`pagedserve serve --help` lists them with their defaults).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        self._start(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig, endpoint: TPEndpoint | None = None) -> LLM:
        """An LLM whose engine runs `config` (an EngineConfig, or a subclass of it); `endpoint`:
        rank 0 of a tensor-parallel group found there (EngineCore)."""
        llm = cls.__new__(cls)
        llm._start(config, endpoint)
        return llm

    def _start(self, config: EngineConfig, endpoint: TPEndpoint | None = None) -> None:
        self.engine = LLMEngine(config, endpoint)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (strings or token-id lists), in input order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model; the engine needs enable_lora). A bad prompt, params or adapter raises ValueError
        before anything is queued."""
        prompt_list = _as_prompt_list(prompts)
        params = self._params_for(len(prompt_list), sampling_params)
        return self._run(prompt_list, params, use_tqdm, _loras_for(len(prompt_list), lora_request))

    def embed(
        self, prompts: PromptInput | Sequence[PromptInput], use_tqdm: bool = False
    ) -> list[PoolingOutput]:
        """An embedding model's vectors of a prompt or a list of prompts (strings or token-id
        lists), in input order, batched through the scheduler like any requests. A bad prompt
        raises ValueError before anything is queued."""
        prompt_list = _as_prompt_list(prompts)
        return self._run(prompt_list, [EMBEDDING_PARAMS] * len(prompt_list), use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies for one conversation or a list of conversations, rendered with the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompt_list = [
            apply_chat_template(
                self.engine.tokenizer, conv, add_generation_prompt=add_generation_prompt
            )
            for conv in conversations
        ]
        params = self._params_for(len(prompt_list), sampling_params)
        return self._run(prompt_list, params, use_tqdm, _loras_for(len(prompt_list), lora_request))

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (strings or token-id lists): the `beam_width` best
        sequences of each, best first (engine/core/beam_search.py says how they are found)."""
        prompt_list = _as_prompt_list(prompts)
        sampling = params.sampling_params()
        outputs = self._run(prompt_list, [sampling] * len(prompt_list), use_tqdm)
        return [
            BeamSearchOutput(
                out.prompt_token_ids,
                [
                    BeamSearchSequence(
                        c.token_ids,
                        c.text,
                        c.cumulative_logprob,
                        beam_score(c.cumulative_logprob, len(c.token_ids), params.length_penalty),
                        c.finish_reason,
                    )
                    for c in out.outputs
                    if c.token_ids
                ],
            )
            for out in outputs
        ]

    def _params_for(
        self, count: int, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _run(
        self,
        prompts: list[PromptInput],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[Any]:
        loras = loras or [None] * len(prompts)
        # Every prompt, params and adapter was checked before the first is queued: a bad one
        # raises with nothing scheduled.
        inputs = [
            self.engine.process_inputs(prompt, params, lora)
            for prompt, params, lora in zip(prompts, params_list, loras, strict=True)
        ]
        ids = []
        for prompt, params, lora in zip(inputs, params_list, loras, strict=True):
            request_id = str(next(self._ids))
            # Only the finished output is read: no per-step copies of the outputs so far.
            final = params if params is EMBEDDING_PARAMS else params.clone(output_kind="final")
            self.engine.enqueue(NewRequest(request_id, prompt, final, time.time(), lora))
            ids.append(request_id)
        finished: dict[str, RequestOutput | PoolingOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one token-id list
    return prompts


def _loras_for(
    count: int, lora: LoRARequest | Sequence[LoRARequest | None] | None
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras
