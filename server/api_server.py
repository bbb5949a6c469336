"""`pagedserve serve`: build the engine (weights, KV cache), then run the app under uvicorn."""

from __future__ import annotations

import logging

import uvicorn

from engine.async_engine import AsyncEngine
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from server.app import build_app

logger = logging.getLogger("pagedserve")


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    log_level: str = "info",
    access_log: bool = True,
) -> None:
    """Load the model, start the engine thread and serve until interrupted (Ctrl-C)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    engine = LLMEngine(config)  # logs parameters, dtype, device and the KV-cache plan
    async_engine = AsyncEngine(engine, max_queue_len=max_queue_len)
    names = served_model_names or [config.model]
    app = build_app(async_engine, names, model_root=config.model, api_key=api_key)
    plan = engine.kv_plan
    logger.info(
        "serving %s on http://%s:%d/v1 (device %s, dtype %s, %d KV blocks of %d tokens, "
        "%d bytes/token, max concurrency %.1f at %d tokens%s)",
        names[0],
        host,
        port,
        engine.device,
        str(engine.dtype).removeprefix("torch."),
        plan.num_blocks,
        plan.block_size,
        plan.bytes_per_token,
        plan.max_concurrency,
        plan.max_model_len,
        ", API key required" if api_key else "",
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        access_log=access_log,
        timeout_keep_alive=30,
    )
