"""pagedserve replicas under Ray Serve: a fleet of engines behind Ray's HTTP proxy, each replica
serving the same FastAPI app as `pagedserve serve` (every endpoint, SSE streams, the API key).
Needs the `ray` extra (`pip install '.[ray]'`); nothing else imports this module.

    serve run pagedserve.server.ray_serve:build_app model=smollm2-135m-instruct num_replicas=2

    Ray's HTTP proxy ─> PagedServeIngress ── handle, PrefixAffinityRouter ──┬─> PagedServeReplica 0
                        (reads the body,                                    └─> PagedServeReplica 1
                         computes the routing key)      each: an engine client + build_app's app

Two deployments (`router="prefix"`, the default). Ray's proxy routes on headers alone: it hands
a replica the request's scope and the replica pulls the body afterwards, so no router at the
proxy sees a prompt (server/ray_serve/routing.py). The ingress therefore reads each body, computes
its routing key (prompt prefix digests and estimated cost) and forwards the whole request through
a handle whose router, `PrefixAffinityRouter`, applies the data-parallel router's rule across
replicas. The replica runs the request through its in-process FastAPI app (`asgi_messages`) and
streams the ASGI messages back, batched as they come, so SSE streams through unchanged, and
adds a `x-pagedserve-replica` header naming itself (the same request header pins a request to
that replica: its /metrics, /v1/kv, /dashboard). With `router="pow2"` the replica is itself the
HTTP ingress (`__serve_build_asgi_app__`) behind Ray's default router: one hop less, no affinity.

A replica builds its engine client as `pagedserve serve` does (server/api_server.py `run_server`):
the core in a process of its own by default, several with --data-parallel-size, or in-process;
tensor-parallel ranks are processes the core starts (--tensor-parallel-size). They inherit the
replica actor's CUDA_VISIBLE_DEVICES, so the actor itself must hold every GPU its ranks use, and
Ray gives an actor the resources of its own bundle only: `replica_bundles` makes one bundle per
replica holding them all, which keeps a replica's ranks on one node, and asks STRICT_PACK so any
bundle added later lands there too.

Scale-down drains: Ray stops routing to the replica and waits for its ongoing requests, then its
`__del__` refuses new requests (the engine client's start_draining), lets those still in flight
finish within --shutdown-timeout, and stops the engine; graceful_shutdown_timeout_s covers both
and the engine's stop. `check_health` fails once the engine stopped or its core died, and Ray
replaces the replica. Autoscaling follows ongoing requests per replica (`target_ongoing_requests`),
the requests queued at the handles included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import torch
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.server.api_server import server_app, start_client
from pagedserve.server.cli import build_parser
from pagedserve.server.errors import APIError, BodySizeLimit, error_response
from pagedserve.server.ray_serve.router import PrefixAffinityRouter
from pagedserve.server.ray_serve.routing import REPLICA_HEADER, ForwardedRequest, routing_key
from pagedserve.server.server_config import ServerConfig

logger = logging.getLogger("pagedserve")

ROUTERS = ("prefix", "pow2")
# Ongoing requests per replica the autoscaler aims at when autoscaling_config sets no
# target_ongoing_requests (Ray's own default, 2, would add a replica for what one continuous
# batch serves at once).
DEFAULT_TARGET_ONGOING_REQUESTS = 16
# What a replica's shutdown needs beyond the drain: the engine's stop (ProcessEngine.shutdown
# waits 10 s for the core before it terminates it).
ENGINE_STOP_S = 15.0
# The ingress holds a stream open per request it forwards: its own limit is not the engines'.
INGRESS_MAX_ONGOING_REQUESTS = 10_000
# The keys of build_app's args that configure Ray; every other key is a `pagedserve serve` flag.
RAY_KEYS = (
    "args", "num_replicas", "autoscaling_config", "max_ongoing_requests", "router",
    "ingress_replicas", "health_check_period_s", "cpus_per_rank", "gpus_per_rank",
)  # fmt: skip
# The part of an ASGI scope a replica needs (Ray's own entries do not pickle, nor matter).
SCOPE_KEYS = (
    "type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
    "query_string", "headers", "client", "server",
)  # fmt: skip


# ---- one request through a replica's app, in its process -----------------------------------------


async def asgi_messages(
    app: Callable[..., Awaitable[None]],
    scope: dict[str, Any],
    body: bytes,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> AsyncIterator[list[dict[str, Any]]]:
    """Run one HTTP request through the ASGI `app` in this process; yield the messages it sends,
    in lists of those ready at once (one hop per SSE event when idle, fewer under load). Closing
    the generator early (the client went away) disconnects the request: the app aborts it."""
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()  # None: the app returned
    disconnected = asyncio.Event()
    body_given = False
    started = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
            message = {**message, "headers": [*message.get("headers", ()), *extra_headers]}
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:
            logger.exception("the app failed on %s %s", scope.get("method"), scope.get("path"))
            if not started:  # (once started, the response just ends)
                response = error_response(APIError(500, "internal error", err_type="server_error"))
                await response(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    finished = False
    try:
        while True:
            batch = [await sent.get()]
            while not sent.empty():
                batch.append(sent.get_nowait())
            messages = [m for m in batch if m is not None]
            if messages:
                yield messages
            if batch[-1] is None:
                finished = True
                return
    finally:
        if not finished:
            disconnected.set()
            task.cancel()


# ---- the deployments -------------------------------------------------------------------------


class _Replica:
    """One pagedserve engine and its app, behind PagedServeIngress, which calls `forward`."""

    async def __init__(self, config: EngineConfig, server: ServerConfig) -> None:
        if not logger.handlers:  # Ray keeps the replica's stderr in its logs
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
        self.server = server
        # Off the event loop: loading takes seconds to minutes.
        self.client, description, _ = await asyncio.to_thread(start_client, config, server)
        try:
            self.fastapi_app = server_app(self.client, config.model, server)
        except BaseException:
            self.client.shutdown()
            raise
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._header = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        logger.info("replica %s serves %s (%s)", self.replica_id, config.model.model, description)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[list[dict[str, Any]]]:
        """An HTTP request from the ingress, through this replica's app; yields its ASGI
        messages."""
        app, scope, body = self.fastapi_app, request.scope, request.body
        async for messages in asgi_messages(app, scope, body, self._header):
            yield messages

    def check_health(self) -> None:
        """Raises once the engine has stopped or failed (its core process died): Ray replaces
        the replica."""
        if not self.client.is_running:
            raise RuntimeError(f"the engine is not running: {self.client.error!r}")

    async def __del__(self) -> None:
        """Ray's shutdown hook, after Ray's own drain: the server's drain (`_Drain` in
        server/api_server.py), then the engine's stop."""
        client = getattr(self, "client", None)
        if client is None:  # the constructor failed
            return
        client.start_draining()
        deadline = time.monotonic() + self.server.shutdown_timeout
        while client.num_unfinished_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client.num_unfinished_requests:
            logger.warning(
                "shutting down: aborting the %d requests still in flight",
                client.num_unfinished_requests,
            )
        await asyncio.to_thread(client.shutdown)


PagedServeReplica = serve.deployment(name="PagedServeReplica")(_Replica)


# Ray allows one ingress deployment an application: with PagedServeIngress in front the replica
# must not be one, hence two classes.
@serve.deployment(name="PagedServeReplica")
@serve.ingress()
class PagedServeHTTPReplica(_Replica):
    """A replica that is Ray's HTTP ingress itself (router "pow2")."""

    def __serve_build_asgi_app__(self):
        return self.fastapi_app


class IngressApp:
    """The ingress's ASGI app: each HTTP request read whole, keyed (server/ray_serve/routing.py
    `routing_key`) and forwarded to a replica's `forward` through `replicas` (a streaming
    handle); the replica's ASGI messages are sent on as they come."""

    def __init__(self, replicas: DeploymentHandle, max_request_body_bytes: int) -> None:
        self.replicas = replicas
        self._limited = BodySizeLimit(self._forward, max_request_body_bytes)

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            raise ValueError(f"pagedserve serves HTTP, not {scope['type']}")
        await self._limited(scope, receive, send)

    async def _forward(self, scope: dict[str, Any], receive, send) -> None:
        path = scope.get("path")
        body = bytearray()
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    break
        except StarletteHTTPException as e:  # BodySizeLimit: a chunked body passed the limit
            await error_response(APIError(e.status_code, e.detail), path)(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = routing_key(path or "", headers, bytes(body))
        forwarded = {name: scope[name] for name in SCOPE_KEYS if name in scope}
        responses = self.replicas.forward.remote(ForwardedRequest(forwarded, bytes(body), key))
        started = False
        try:
            async for messages in responses:
                for message in messages:
                    started = started or message["type"] == "http.response.start"
                    await send(message)
        except Exception as e:
            if started:  # too late for a status: the response ends here
                raise
            logger.warning("forwarding %s failed: %r", path, e)
            error = APIError(503, f"the engine replica failed: {e}", code="replica_failed")
            await error_response(error, path)(scope, receive, send)
        finally:
            responses.cancel()  # (a no-op once it finished; else the replica aborts the request)


@serve.deployment(name="PagedServeIngress")
@serve.ingress()
class PagedServeIngress:
    """The HTTP ingress of router "prefix" (IngressApp), in front of the PagedServeReplica
    deployment, whose handle routes by PrefixAffinityRouter."""

    def __init__(self, replicas: DeploymentHandle, max_request_body_bytes: int) -> None:
        # (not `self.app`: Ray's ingress wrapper has a property of that name)
        self.forwarder = IngressApp(replicas.options(stream=True), max_request_body_bytes)

    def __serve_build_asgi_app__(self) -> IngressApp:
        return self.forwarder


# ---- placement and the application builder ---------------------------------------------------


def replica_bundles(
    tensor_parallel_size: int,
    data_parallel_size: int = 1,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: float = 0.0,
) -> list[dict[str, float]]:
    """The placement group bundles of one replica: a single bundle with the CPUs and GPUs of all
    its ranks (data_parallel_size cores x tensor_parallel_size ranks each), as the replica actor
    itself must hold them (this module's docstring)."""
    if tensor_parallel_size < 1 or data_parallel_size < 1:
        raise ValueError(f"bad sizes: {tensor_parallel_size=}, {data_parallel_size=}")
    if cpus_per_rank < 0 or gpus_per_rank < 0 or cpus_per_rank + gpus_per_rank == 0:
        raise ValueError(f"a rank needs resources: {cpus_per_rank=}, {gpus_per_rank=}")
    ranks = tensor_parallel_size * data_parallel_size
    bundle = {"CPU": cpus_per_rank * ranks}
    if gpus_per_rank:
        bundle["GPU"] = gpus_per_rank * ranks
    return [bundle]


def replica_options(config: EngineConfig, server: ServerConfig, ray: dict[str, Any]) -> dict:
    """PagedServeReplica's deployment options for `ray` (build_app's Ray keys, parsed)."""
    gpus = ray.get("gpus_per_rank")
    if gpus is None:  # a GPU per rank when the engine runs on CUDA ("auto": as torch sees here)
        cuda = config.model.device.startswith("cuda")
        gpus = float(cuda or (config.model.device == "auto" and torch.cuda.is_available()))
    if gpus and config.model.device.startswith("cuda:"):
        raise ValueError("Ray picks a replica's GPUs: use --device cuda (or auto), not cuda:N")
    bundles = replica_bundles(
        config.parallel.tensor_parallel_size,
        server.data_parallel_size,
        ray.get("cpus_per_rank", 1.0),
        gpus,
    )
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": bundles[0]["CPU"], "num_gpus": bundles[0].get("GPU", 0)},
        "placement_group_bundles": bundles,
        "placement_group_strategy": "STRICT_PACK",
        # Beyond a batch, requests wait at the handle, where the autoscaler counts them, rather
        # than in the engine's queue.
        "max_ongoing_requests": ray.get("max_ongoing_requests") or config.scheduler.max_num_seqs,
        "health_check_period_s": ray.get("health_check_period_s", 10.0),
        "graceful_shutdown_timeout_s": server.shutdown_timeout + ENGINE_STOP_S,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    autoscaling, replicas = ray.get("autoscaling_config"), ray.get("num_replicas")
    if autoscaling is not None or replicas == "auto":
        if replicas not in (None, "auto"):
            raise ValueError("give num_replicas or autoscaling_config, not both")
        # "auto": Ray's defaults (1 to 100 replicas) under the fields given, with a target that
        # suits a batching engine.
        options["num_replicas"] = "auto"
        target = {"target_ongoing_requests": DEFAULT_TARGET_ONGOING_REQUESTS}
        options["autoscaling_config"] = {**target, **(autoscaling or {})}
    else:
        options["num_replicas"] = replicas or 1
    if ray.get("router", "prefix") == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter
        )
    return options


def parse_args(args: dict[str, Any]) -> tuple[EngineConfig, ServerConfig, dict[str, Any]]:
    """build_app's args: (the engine's config, the server's, the Ray keys). Every key but
    RAY_KEYS is a `pagedserve serve` flag (model=..., max_model_len=1024, enable_prefix_caching=
    false), and `args` holds more flags as one string or a list; all go through the real parser
    (server/cli.py), so values mean what they mean on the command line (kv_cache_memory in GiB).
    ValueError for unknown flags or invalid values."""
    ray = _ray_keys(args)
    bools = {
        f.name
        for cls in (EngineConfig, ServerConfig)
        for _, f, hint in cls.option_fields()
        if hint in (bool, bool | None)
    }
    argv: list[str] = []
    for name, value in args.items():
        if name in RAY_KEYS or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name.replace("-", "_") in bools:
            on = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            argv.append(flag if on else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    extra = args.get("args") or []
    argv += shlex.split(extra) if isinstance(extra, str) else [str(a) for a in extra]
    parser = build_parser()
    parser.error = _raise_value_error  # type: ignore[method-assign]  (argparse exits otherwise)
    namespace = parser.parse_args(["serve", *argv])
    config = namespace.config_cls.from_cli_args(namespace)
    return config, ServerConfig.from_cli_args(namespace), ray


def _raise_value_error(message: str) -> typing.NoReturn:
    raise ValueError(f"pagedserve serve: {message}")


def _ray_keys(args: dict[str, Any]) -> dict[str, Any]:
    """The Ray keys, typed (`serve run` passes every value as a string)."""
    ray: dict[str, Any] = {"router": args.get("router", "prefix")}
    if ray["router"] not in ROUTERS:
        raise ValueError(f"router must be one of {list(ROUTERS)}, got {ray['router']!r}")
    for name, kind in (
        ("max_ongoing_requests", int), ("ingress_replicas", int), ("cpus_per_rank", float),
        ("gpus_per_rank", float), ("health_check_period_s", float),
    ):  # fmt: skip
        if args.get(name) is not None:
            ray[name] = kind(args[name])
    replicas = args.get("num_replicas")
    if replicas is not None:
        ray["num_replicas"] = "auto" if replicas == "auto" else int(replicas)
    autoscaling = args.get("autoscaling_config")
    if isinstance(autoscaling, str):
        autoscaling = json.loads(autoscaling)
    if autoscaling is not None:
        ray["autoscaling_config"] = dict(autoscaling)
    return ray


def build_app(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application builder: `serve run pagedserve.server.ray_serve:build_app
    model=... num_replicas=2`, or `import_path` and `args` in a config file (parse_args says
    what the args hold)."""
    config, server, ray = parse_args(args)
    return application(config, server, ray)


def application(config: EngineConfig, server: ServerConfig, ray: dict[str, Any] | None = None):
    """The application for these configs (for serve.run from Python); `ray`: the Ray keys."""
    ray = {} if ray is None else ray
    options = replica_options(config, server, ray)
    if ray.get("router", "prefix") == "pow2":
        return PagedServeHTTPReplica.options(**options).bind(config, server)
    replicas = PagedServeReplica.options(**options).bind(config, server)
    ingress = PagedServeIngress.options(
        num_replicas=ray.get("ingress_replicas", 1),
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        # It parses JSON and copies bytes: a reserved CPU would sit idle beside the engines.
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas, server.max_request_body_bytes)
