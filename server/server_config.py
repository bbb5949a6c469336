"""The server's own options (`pagedserve serve` beside the engine's): each defined once, as a
`ServerConfig` field with its default, help and `--help` group (engine/options.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.options import Options, option
from pagedserve.server.limits import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)
from pagedserve.server.openai.reasoning import REASONING_PARSERS
from pagedserve.server.openai.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ServerConfig(Options):
    """Where and how `pagedserve serve` answers: address, key, limits, timeouts, CORS, and the
    engine cores behind it."""

    host: str = option("127.0.0.1", "address to listen on", group="server")
    port: int = option(8000, "port to listen on (0: any free port)", group="server")
    served_model_name: tuple[str, ...] | None = option(
        None, "name(s) clients use in `model` (default: the --model value)", group="server"
    )
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1 (default: $PAGEDSERVE_API_KEY)",
        group="server",
        env="PAGEDSERVE_API_KEY",
    )
    max_queue_len: int | None = option(
        None,
        "answer 503 while this many requests wait to be scheduled (default: no limit)",
        group="server",
    )
    max_n: int = option(
        DEFAULT_MAX_N, "largest n (samples per prompt) a request may ask for", group="server"
    )
    tool_call_parser: str = option(
        "auto",
        "how tool calls are read from the model's answers for tool_choice auto: hermes "
        "(<tool_call> blocks: Qwen, SmolLM2, ...), llama3_json (bare JSON calls), or auto: "
        "llama3_json when the chat template speaks of <|python_tag|>, else hermes",
        choices=TOOL_CALL_PARSERS,
        group="server",
    )
    reasoning_parser: str | None = option(
        None,
        "give chat answers' <think>...</think> part apart, as reasoning_content: qwen3 (text "
        "without <think> or </think> is content) or deepseek_r1 (text before </think> is "
        "reasoning, all of it without one); structured outputs and tool calls apply after it "
        "(default: off, the think part stays in content)",
        choices=REASONING_PARSERS,
        group="server",
    )
    lora_modules: tuple[str, ...] | None = option(
        None,
        "LoRA adapters to serve from the start, as name=path (a PEFT folder or a GGUF LoRA "
        "file) or vLLM's JSON form; requests name one in `model` (implies --enable-lora)",
        group="lora",
        metavar="NAME=PATH",
    )
    enable_auto_tool_choice: bool = option(
        False, "accepted for vLLM command lines: tool_choice auto is always on here", group="server"
    )
    allowed_origins: tuple[str, ...] | None = option(
        None,
        "origins that browsers may call this server from (CORS; default: none, CORS off)",
        group="server",
    )
    max_request_body_bytes: int = option(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "refuse larger request bodies with a 413", group="server"
    )
    request_timeout: float | None = option(
        None,
        "seconds a request may take, queueing included; past it the request is aborted, its "
        "blocks freed, and the client gets a 504 (a final error event on a stream) (default: no "
        "limit)",
        group="server",
    )
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S,
        "on SIGTERM or Ctrl-C, seconds the requests in flight get to finish while new ones are "
        "refused with a 503; then the rest end with an error event (a second signal: at once)",
        group="server",
    )
    access_log: bool = option(True, "log every HTTP request", group="server")
    core_process: bool | None = option(
        None,
        "run the engine core (scheduler, model) in a process of its own, apart from HTTP, "
        "tokenization and detokenization (default: on; --no-core-process runs the engine loop "
        "in the server's process)",
        group="server",
    )
    data_parallel_size: int = option(
        1,
        "engine cores, each in a process of its own with its own KV cache (and on CPU 1/M of "
        "the CPUs), behind this one server; requests go to the least loaded core, or to one "
        "whose prefix cache holds their prompt's beginning",
        metavar="M",
        group="parallel",
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # every field's type and choices
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue_len is not None and self.max_queue_len < 1:
            raise ValueError(f"--max-queue-len must be >= 1, got {self.max_queue_len}")
        if self.max_n < 1:
            raise ValueError(f"--max-n must be >= 1, got {self.max_n}")
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}"
            )
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(
                f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.data_parallel_size > 1 and self.core_process is False:
            raise ValueError(
                f"--data-parallel-size {self.data_parallel_size} runs each engine core in a "
                "process of its own: drop --no-core-process"
            )
