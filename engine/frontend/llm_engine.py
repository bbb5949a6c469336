"""LLMEngine: add requests, step, collect outputs, with the engine core in the caller's process.

It holds an EngineCore (scheduler, worker, model) and puts the front end's two halves around
it: the InputProcessor checks prompts, the OutputProcessor fans requests out into samples and
turns what each core step produced into RequestOutputs (text, stop strings, logprobs). The
offline LLM API and the server's in-process mode run it; engine/frontend/process_client.py puts
the same pieces in two processes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.inputs import InputProcessor, NewRequest, Prompt
from pagedserve.engine.frontend.output_processor import OutputProcessor
from pagedserve.engine.frontend.outputs import RequestOutput
from pagedserve.engine.messages import EngineStats
from pagedserve.engine.tp_endpoint import TPEndpoint
from pagedserve.scheduler import LoRARequest, SamplingParams


class LLMEngine:
    """The synchronous engine: input checks and output processing around an EngineCore
    (`core`) in this process."""

    def __init__(self, config: EngineConfig, endpoint: TPEndpoint | None = None) -> None:
        self.core = EngineCore(config, endpoint)
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        lora_rank = config.lora.max_lora_rank if config.lora.enable_lora else None
        self.inputs = InputProcessor.for_model(
            self.tokenizer, self.max_model_len, self.core.model_config, self.core.pooling, lora_rank
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    # ---- requests --------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def process_prompt(self, prompt: str | Sequence[int] | Prompt) -> Prompt:
        """`InputProcessor.process_prompt`: safe from any thread."""
        return self.inputs.process_prompt(prompt)

    def process_inputs(
        self,
        prompt: str | Sequence[int] | Prompt,
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> Prompt:
        return self.inputs.process_inputs(prompt, params, lora)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Prompt:
        """Check a request (`process_inputs`) and queue its n samples. `prompt` is text, token
        ids, or a Prompt from `process_prompt`; `lora_request` the adapter it runs with.
        Returns the Prompt."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = self.process_inputs(prompt, params, lora_request)
        self.enqueue(
            NewRequest(request_id, prompt, params, arrival_time or time.time(), lora_request)
        )
        return prompt

    def enqueue(self, request: NewRequest) -> None:
        """Queue a request whose inputs `process_inputs` accepted (AsyncEngine checks them on the
        caller's thread, then queues them here on the engine's)."""
        self.core.add_samples(self.output_processor.add(request))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort every sample of a request in whatever state it is; its blocks are freed now.
        Returns its last output (None for an unknown id)."""
        output, sample_ids = self.output_processor.abort(request_id)
        self.core.abort_samples(sample_ids)
        return output

    def rewind(self, request_id: str, num_tokens: int) -> list[RequestOutput]:
        """Take back the last `num_tokens` generated tokens of every unfinished sample of a
        request, running or waiting: their blocks past the new end are freed, generation goes
        on from there without computing the kept prefix again (`Scheduler.rewind`). Returns the
        request's output in its output kind (none for "final"). Raises ValueError, changing
        nothing, for an unknown or finished request or a sample with fewer tokens."""
        samples = self.core.rewind_samples(
            self.output_processor.live_sample_ids(request_id), num_tokens
        )
        outputs, _ = self.output_processor.process(samples)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished_requests

    # ---- stepping --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that got new tokens, in
        its `SamplingParams.output_kind` (whole so far, what is new, or only the final one).

        With asynchronous scheduling a step() launches step N + 1 and then returns the outputs
        of step N, whose device work ran (and whose ids came back) meanwhile."""
        outputs, stopped = self.output_processor.process(self.core.step_samples())
        self.core.abort_samples(stopped, stopped=True)
        return outputs

    # ---- the core's, for the server and the offline API ----------------------------------------

    def stats(self) -> EngineStats:
        return self.core.stats()

    def kv_map(self) -> bytes:
        return self.core.kv_map()

    def describe(self) -> str:
        return self.core.describe()

    def close(self) -> None:
        self.core.close()
