"""What passes between the front end (tokenizer, detokenizer, stop strings, streams) and the engine
core (scheduler, model): plain msgspec structs, the same whether the core runs in the caller's
process (LLMEngine) or in its own (engine/frontend/process_client.py sends them over ZeroMQ as
msgpack).

The core knows samples, not requests: a request with n samples arrives as n CoreRequests, and
each step returns one SampleOutput per sample that has something new.
"""

from __future__ import annotations

import msgspec

from pagedserve.scheduler import LoRARequest, SamplingParams

# One position: (token logprob, token rank (1 = most likely), [(token id, logprob)] top-k).
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]


class CoreRequest(msgspec.Struct, array_like=True, frozen=True):
    """One sample to schedule: its id, prompt and params (n = 1; its own seed); for an
    encoder-decoder model (Whisper), the audio its encoder takes (16 kHz float32 samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    encoder_input: bytes | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (None: the base model)


class SampleOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one sample. Prompt logprobs (when asked for) come as the
    prompt chunks are scored, possibly in steps without a new token."""

    request_id: str
    new_token_ids: list[int]
    # "stop" | "length" | "abort" | "error" when the core ended it
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None  # of the last new token, when params.logprobs is set
    # (prompt position of the first entry, one entry per position from there on)
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    error: str | None = None  # with finish "error": what went wrong, for the client
    # Set when the core rewound the sample (EngineCore.rewind_samples): its number of output
    # tokens afterwards. The front end cuts its own state to it before adding new_token_ids.
    rewound_to: int | None = None
    # Beam search: a finished beam comes whole, with the sum of its tokens' logprobs.
    cumulative_logprob: float | None = None
    # An embedding model's request: its pooled vector (little-endian float32), with its finish.
    embedding: bytes | None = None


class EngineStats(msgspec.Struct, array_like=True, frozen=True):
    """What the engine core publishes after each iteration of its loop (read by /metrics)."""

    num_running: int = 0
    num_waiting: int = 0  # scheduler requests (samples) not yet admitted
    kv_blocks_used: int = 0  # blocks held by live requests (ref count > 0)
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens scheduled
    spec_accepted_tokens: int = 0  # of which the model agreed with
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_steps: int = 0
    step_seconds: float = 0.0  # total time spent stepping the engine
    num_requests_added: int = 0  # requests (not samples) the core has received so far
    # Swap preemption: the host pool's blocks holding swapped KV, its size (0: recompute mode),
    # and the preemptions that swapped out, and resumptions that swapped in, so far.
    kv_host_blocks_used: int = 0
    kv_host_blocks_total: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    # LoRA: the adapters (names) of the running and of the waiting requests, the device slots
    # (0: the engine serves no adapters), and the adapters copied into a slot so far.
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    lora_slot_loads: int = 0
    block_size: int = 0  # tokens per KV block (fixed; for vllm:cache_config_info)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


# ---- front end -> core process ------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    samples: list[CoreRequest]  # the n samples of one request


class AbortSamples(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    stopped: bool = False  # True: a stop string ended them (finish "stop"), not the client


class RewindSamples(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    num_tokens: int  # output tokens each takes back, from where the core is when it applies it


class GetKVMap(msgspec.Struct, tag=True, array_like=True):
    query_id: int  # the KVMap reply carries it back


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = AddRequest | AbortSamples | RewindSamples | GetKVMap | Shutdown


# ---- core process -> front end ------------------------------------------------------------------


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    max_model_len: int
    description: str  # device, dtype and KV-cache plan, for the front end's log line
    stats: EngineStats  # before any request: /metrics shows the pool's size from the start


class CoreOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[SampleOutput]
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    message: str  # why the core could not start
    value_error: bool  # the config was refused (a ValueError), rather than a crash


class KVMap(msgspec.Struct, tag=True, array_like=True):
    query_id: int
    kv_map: bytes  # EngineCore.kv_map's JSON, served as it is


CoreMessage = CoreReady | CoreOutputs | CoreFailed | KVMap
