"""`pagedserve serve`: build the engine (weights, KV cache), then serve it over HTTP.

uvicorn runs on a second thread and the engine loop on the main one (why: engine/async_engine.py).
Ctrl-C or SIGTERM stops the loop first, so that streams in flight end at once, then uvicorn.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

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
    """Load the model and serve until interrupted (Ctrl-C / SIGTERM)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    engine = LLMEngine(config)  # logs parameters, dtype, device and the KV-cache plan
    async_engine = AsyncEngine(engine, max_queue_len=max_queue_len)
    names = served_model_names or [config.model]
    app = build_app(
        async_engine, names, model_root=config.model, api_key=api_key, manage_engine=False
    )
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
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level.lower(),
            access_log=access_log,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,
        )
    )
    http = threading.Thread(target=server.run, name="pagedserve-http", daemon=True)
    http.start()
    while not server.started:  # bind errors end the thread early
        if not http.is_alive():
            raise ValueError(f"could not serve on {host}:{port} (see the log above)")
        time.sleep(0.05)

    def stop_engine_when_http_stops() -> None:
        http.join()
        async_engine.shutdown()  # uvicorn ended by itself (e.g. a fatal error): end the loop

    threading.Thread(target=stop_engine_when_http_stops, daemon=True).start()
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        async_engine.run()
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.should_exit = True
        http.join(timeout=10)
    if async_engine.error is not None:
        raise RuntimeError(f"the engine loop failed: {async_engine.error!r}")


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
