"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(conversations)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.tokenizer import apply_chat_template
from scheduler import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Runs batches of prompts to completion through the continuous-batching engine.

    LLM(model="smollm2-135m-instruct", device="cpu", dtype="float32", block_size=16,
        max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=None, ...)
    Keyword arguments are those of EngineConfig.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (strings or token-id lists), in input order.

        Every prompt is validated before any is queued, so a bad one raises ValueError with
        nothing scheduled."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(len(prompt_list), sampling_params)
        token_lists = []
        for prompt in prompt_list:
            if isinstance(prompt, str):
                ids = self.engine.tokenize(prompt) if prompt else []
            else:
                ids = list(prompt)
            self.engine.validate_prompt(ids)
            token_lists.append(ids)
        return self._run(prompt_list, token_lists, params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies for one conversation or a list of conversations, rendered with the
        model's chat template."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        token_lists = [
            apply_chat_template(
                self.engine.tokenizer, conv, add_generation_prompt=add_generation_prompt
            )
            for conv in conversations
        ]
        for ids in token_lists:
            self.engine.validate_prompt(ids)
        params_list = self._params_for(len(token_lists), sampling_params)
        return self._run([None] * len(token_lists), token_lists, params_list, use_tqdm)

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

    def _run(self, prompts, token_lists, params_list, use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        for prompt, token_ids, params in zip(prompts, token_lists, params_list, strict=True):
            request_id = str(next(self._ids))
            self.engine.add_request(
                request_id,
                token_ids if prompt is None else prompt,
                params,
                prompt_token_ids=token_ids,
            )
            ids.append(request_id)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # one token-id list
    return prompts
