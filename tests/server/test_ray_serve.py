"""pagedserve under Ray Serve (server/ray_serve/: __init__.py, routing.py and router.py).

Pure parts, without a cluster: the placement bundles and deployment options, the application
builder's arguments, the routing key and the prefix-affinity rule (exact replicas for made-up
loads and prefixes), and the Ray request router over stand-in replicas.

With a local Ray cluster started here (2 CPUs, a small object store, no dashboard) and the real
SmolLM2 (each engine with a 64 MiB KV cache and max_model_len 1024): one replica behind the
ingress gives the offline engine's greedy tokens through Ray's HTTP proxy and the official
client, streamed too, and checks the API key. Slow: two replicas; requests sharing a prefix go
back to the replica that cached it (its own /metrics counts the hits), a stream survives while
the other replica is killed, and Ray replaces replicas that died or whose engine died (the
health check)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import ray
from ray import serve
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.api import RunTarget
from ray.serve.config import RequestRouterConfig

from pagedserve.engine.frontend.data_parallel import BALANCE_MIN_TOKENS
from pagedserve.engine.tp_endpoint import free_port
from pagedserve.scheduler import SamplingParams
from pagedserve.server.ray_serve import (
    DEFAULT_TARGET_ONGOING_REQUESTS,
    ENGINE_STOP_S,
    build_app,
    parse_args,
    replica_bundles,
    replica_options,
)
from pagedserve.server.ray_serve.router import PrefixAffinityRouter
from pagedserve.server.ray_serve.routing import (
    CHARS_PER_TOKEN,
    CHUNK_CHARS,
    DEFAULT_OUTPUT_TOKENS,
    REPLICA_HEADER,
    AffinityTable,
    ForwardedRequest,
    RoutingKey,
    routing_key,
)
from tests.helpers import child_pids

MODEL = "smollm2-135m-instruct"
# Small engines: the CPU default KV cache (4 GiB) per replica would not fit this machine.
ENGINE_ARGS = "--dtype float32 --quantization none --max-model-len 1024 --kv-cache-memory 0.0625"
API_KEY = "ray-key-0123"
PROMPT = "The capital of France is"
REPLICA_DEPLOYMENT = "PagedServeReplica"


# ---- placement, options, arguments ---------------------------------------------------------------


def test_the_readmes_config_file_is_a_serve_config_of_pagedserve_flags():
    import textwrap

    import yaml
    from ray.serve.schema import ServeDeploySchema

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    (block,) = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    config = yaml.safe_load(textwrap.dedent(block))
    (app,) = ServeDeploySchema.model_validate(config).applications
    assert app.import_path == "pagedserve.server.ray_serve:build_app"
    engine, server, ray_keys = parse_args(app.args)
    assert (
        engine.model.device,
        engine.parallel.tensor_parallel_size,
        engine.model.max_model_len,
    ) == ("cuda", 2, 8192)
    assert server.shutdown_timeout == 30
    assert ray_keys["autoscaling_config"]["max_replicas"] == 8


def test_a_replica_is_one_bundle_holding_all_its_ranks():
    assert replica_bundles(1) == [{"CPU": 1.0}]
    assert replica_bundles(4, gpus_per_rank=1) == [{"CPU": 4.0, "GPU": 4.0}]
    # --data-parallel-size 2 x --tensor-parallel-size 2: four ranks in the replica.
    assert replica_bundles(2, 2, cpus_per_rank=2, gpus_per_rank=1) == [{"CPU": 8.0, "GPU": 4.0}]
    assert replica_bundles(2, cpus_per_rank=0, gpus_per_rank=0.5) == [{"CPU": 0.0, "GPU": 1.0}]
    for bad in ({"tensor_parallel_size": 0}, {"tensor_parallel_size": 1, "cpus_per_rank": 0}):
        with pytest.raises(ValueError):
            replica_bundles(**bad)


def test_tensor_parallel_replicas_get_their_gpus_packed_on_one_node():
    config, server, ray_keys = parse_args(
        {"device": "cuda", "tensor_parallel_size": "2", "num_replicas": "3"}
    )
    options = replica_options(config, server, ray_keys)
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 2.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    # The actor itself holds bundle 0 whole: its rank processes inherit its GPUs.
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 2.0}
    assert options["num_replicas"] == 3
    assert options["max_ongoing_requests"] == config.scheduler.max_num_seqs == 256
    assert options["graceful_shutdown_timeout_s"] == server.shutdown_timeout + ENGINE_STOP_S
    router = options["request_router_config"].request_router_class
    assert router == "pagedserve.server.ray_serve.router.PrefixAffinityRouter"
    with pytest.raises(ValueError, match="use --device cuda"):
        replica_options(*parse_args({"device": "cuda:1"}))


def test_app_builder_args_are_serve_flags_and_ray_keys():
    config, server, ray_keys = parse_args(
        {
            "model": MODEL,
            "max_model_len": "1024",
            "kv_cache_memory": "0.0625",  # GiB, as on the command line
            "enable_prefix_caching": "false",
            "served_model_name": ["smol", "smol-alias"],
            "args": "--dtype float32 --api-key k --max-num-seqs 8",
            "num_replicas": "2",
            "router": "pow2",
            "cpus_per_rank": "2",
        }
    )
    assert (config.model.model, config.model.max_model_len, config.cache.kv_cache_memory) == (
        MODEL,
        1024,
        2**26,
    )
    assert (
        config.cache.enable_prefix_caching,
        config.model.dtype,
        config.scheduler.max_num_seqs,
    ) == (
        False,
        "float32",
        8,
    )
    assert (server.served_model_name, server.api_key) == (("smol", "smol-alias"), "k")
    assert ray_keys == {"router": "pow2", "num_replicas": 2, "cpus_per_rank": 2.0}
    _, _, scaling = parse_args({"autoscaling_config": '{"min_replicas": 1, "max_replicas": 4}'})
    options = replica_options(config, server, scaling)
    assert options["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": DEFAULT_TARGET_ONGOING_REQUESTS,
    }
    assert options["num_replicas"] == "auto" and "request_router_config" in options
    auto = replica_options(config, server, parse_args({"num_replicas": "auto"})[2])
    assert (auto["num_replicas"], auto["autoscaling_config"]) == (
        "auto",
        {"target_ongoing_requests": DEFAULT_TARGET_ONGOING_REQUESTS},
    )
    with pytest.raises(ValueError, match="unrecognized arguments: --no-such-flag 1"):
        parse_args({"no_such_flag": 1})
    with pytest.raises(ValueError, match="router must be one of"):
        parse_args({"router": "random"})
    with pytest.raises(ValueError, match="not both"):
        replica_options(config, server, {"num_replicas": 2, "autoscaling_config": {}})


# ---- the routing key and the rule ----------------------------------------------------------------


def _completion(prompt: str, **fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": prompt, **fields}).encode()


def test_the_routing_key_chains_full_chunks_of_the_prompt():
    prompt = "x" * (3 * CHUNK_CHARS + 10)
    key = routing_key("/v1/completions", {}, _completion(prompt, max_tokens=20, n=2))
    assert len(key.hashes) == 3  # the partial fourth chunk is not cached, as a partial block
    assert key.cost == len(prompt) // CHARS_PER_TOKEN + 20 * 2
    assert key.replica is None
    # Same leading chunks, same leading digests; the first differing chunk differs from there.
    other = routing_key("/v1/completions", {}, _completion("x" * 2 * CHUNK_CHARS + "y" * 100))
    assert other.hashes[:2] == key.hashes[:2] and other.hashes[2] != key.hashes[2]
    assert other.cost == (2 * CHUNK_CHARS + 100) // CHARS_PER_TOKEN + DEFAULT_OUTPUT_TOKENS
    # Another model (a LoRA adapter) or route caches other KV: another chain.
    adapter = routing_key("/v1/completions", {}, _completion(prompt).replace(b"smollm2", b"lora"))
    assert not set(adapter.hashes) & set(key.hashes)


def test_a_chat_continues_the_prefix_of_its_earlier_turns():
    system = {"role": "system", "content": "You are a terse assistant. " * 10}
    first = [system, {"role": "user", "content": "Name a color."}]
    later = [*first, {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "?"}]
    a, b = (
        routing_key(
            "/v1/chat/completions", {}, json.dumps({"model": MODEL, "messages": m}).encode()
        )
        for m in (first, later)
    )
    assert len(a.hashes) >= 4 and b.hashes[: len(a.hashes) - 1] == a.hashes[:-1]
    pinned = routing_key("/metrics", {REPLICA_HEADER: "abc"}, b"")
    assert pinned == RoutingKey(replica="abc")
    assert routing_key("/v1/chat/completions", {}, b"not json") == RoutingKey()


def test_the_rule_prefers_the_cached_prefix_within_the_balance_threshold():
    h = [bytes([i]) * 16 for i in range(4)]
    table = AffinityTable()
    table.routed("a", "r1", h[:3], 1000)  # a holds 3 chunks of the prefix
    table.routed("b", "r2", h[:1], 10)  # b holds 1
    # c is idle; a is within BALANCE_MIN_TOKENS of it: the longest prefix wins, then b's.
    assert table.rank(["a", "b", "c"], h) == ["a", "b", "c"]
    # Nothing cached: the least load, then the lowest index (c and d tie at 0).
    assert table.rank(["a", "b", "c", "d"], [b"z" * 16]) == ["c", "d", "b", "a"]
    table.routed("a", "r3", (), BALANCE_MIN_TOKENS)  # a: 3000 + 48 > 0 + 2048 -> not a candidate
    assert table.rank(["a", "b", "c"], h) == ["b", "c", "a"]
    table.completed("r3")
    assert table.loads == {"a": 1000, "b": 10}
    assert table.rank(["a", "b", "c"], h) == ["a", "b", "c"]
    # Under load the fraction rules: least 10000, limit 12500.
    busy = AffinityTable()
    busy.routed("a", "r1", h, 12_600)
    busy.routed("b", "r2", (), 10_000)
    busy.routed("c", "r3", h[:2], 12_400)
    assert busy.rank(["a", "b", "c"], h) == ["c", "b", "a"]
    table.forget("a")  # a replacement starts cold
    assert table.cached_chunks("a", h) == 0 and table.rank(["a", "b"], h) == ["b", "a"]


def test_the_ray_router_ranks_replicas_by_the_rule_and_tracks_their_load():
    deployment = DeploymentID(name=REPLICA_DEPLOYMENT, app_name="app")

    def request(request_id: str, key: RoutingKey) -> SimpleNamespace:
        forwarded = ForwardedRequest({}, b"", key)
        return SimpleNamespace(
            args=[forwarded], metadata=SimpleNamespace(internal_request_id=request_id)
        )

    async def run() -> None:
        router = PrefixAffinityRouter(deployment, DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        replicas = [SimpleNamespace(replica_id=ReplicaID(u, deployment)) for u in "bca"]

        async def ranking(pending) -> list[str]:
            ranks = await router.choose_replicas(replicas, pending)
            return [r.replica_id.unique_id for rank in ranks for r in rank]

        prefix = (b"p" * 16, b"q" * 16)
        assert await ranking(request("1", RoutingKey(prefix, 100))) == ["a", "b", "c"]
        router.on_request_routed(
            request("1", RoutingKey(prefix, 100)), ReplicaID("a", deployment), None
        )
        # Another prefix while a is busy: the least loaded, b; the same prefix: back to a.
        assert await ranking(request("2", RoutingKey((b"o" * 16,), 50))) == ["b", "c", "a"]
        assert await ranking(request("3", RoutingKey(prefix, 50))) == ["a", "b", "c"]
        assert await ranking(request("4", RoutingKey(replica="c"))) == ["c"]  # pinned
        assert await ranking(None) == ["b", "c", "a"]  # a handle call: the load alone
        router.on_request_completed(ReplicaID("a", deployment), "1")
        assert router.table.loads["a"] == 0

    asyncio.run(run())


# The router as Ray loads it beside a handle, in another process: from its module pickled by
# value (RequestRouterConfig), ranking a request the ingress's own module built.
ROUTER_FROM_ITS_PICKLE = """
import asyncio, sys
from types import SimpleNamespace
import cloudpickle
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from pagedserve.server.ray_serve.routing import ForwardedRequest, RoutingKey

router_class = cloudpickle.loads(open(sys.argv[1], "rb").read())
deployment = DeploymentID(name="PagedServeReplica", app_name="app")
replicas = [SimpleNamespace(replica_id=ReplicaID(u, deployment)) for u in "ab"]
key = RoutingKey((b"p" * 16,), 10)
request = SimpleNamespace(
    args=[ForwardedRequest({}, b"", key)], metadata=SimpleNamespace(internal_request_id="1")
)

async def main():
    router = router_class(deployment, DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    router.table.routed("b", "0", key.hashes, 5)  # b holds the prefix
    ranks = await router.choose_replicas(replicas, request)
    router.on_request_routed(request, ReplicaID("b", deployment), None)
    print([r.replica_id.unique_id for rank in ranks for r in rank], router.table.loads)

asyncio.run(main())
"""


def test_the_router_ray_unpickles_reads_the_ingress_keys(tmp_path):
    pickled = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    (tmp_path / "router.pkl").write_bytes(pickled.get_serialized_request_router_cls())
    done = subprocess.run(
        [sys.executable, "-c", ROUTER_FROM_ITS_PICKLE, str(tmp_path / "router.pkl")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "['b', 'a'] {'b': 15}"


# ---- one replica on a local Ray cluster ----------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """A local Ray cluster with Serve's HTTP proxy on a free port; yields its base URL."""
    port = free_port()
    ray.init(
        num_cpus=2,
        object_store_memory=100 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
    )  # (the replicas inherit this process's environment: conftest's cache folder)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        # Ray's stop takes the replicas (and their engine cores, which die with them) down with
        # it; serve.shutdown()'s graceful drain first would only add seconds.
        ray.shutdown()


@pytest.fixture(scope="module")
def one_replica(ray_cluster) -> str:
    """The app with one replica, deployed without waiting: the test loads its reference engine
    while the replica loads its own."""
    app = build_app({"args": f"{ENGINE_ARGS} --api-key {API_KEY}", "cpus_per_rank": 2})
    serve.run_many(
        [RunTarget(app, name="one", route_prefix="/")], wait_for_applications_running=False
    )
    return ray_cluster


def test_one_replica_serves_the_offline_engines_greedy_tokens(one_replica, real_llm):
    offline = real_llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    _wait_running("one")
    client = openai.OpenAI(base_url=f"{one_replica}/v1", api_key=API_KEY, max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
    )
    answer = raw.parse()
    assert answer.choices[0].text == offline.text
    assert answer.choices[0].text.startswith(" Paris")
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 8)
    assert {raw.headers[REPLICA_HEADER]} == _replica_ids("one")
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == offline.text
    assert len([p for p in pieces if p]) >= 4  # SSE events, not one buffered body
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{one_replica}/v1", api_key="wrong", max_retries=0).models.list()


# ---- two replicas (slow) -------------------------------------------------------------------------


@pytest.mark.slow
def test_two_replicas_affinity_failover_and_health(ray_cluster, real_llm):
    for app in set(serve.status().applications) & {"one", "direct"}:  # (their CPUs are ours)
        serve.delete(app)
    args = {"args": ENGINE_ARGS, "num_replicas": 2, "cpus_per_rank": 1, "health_check_period_s": 1}
    serve.run(build_app(args), name="two", route_prefix="/")
    base = ray_cluster
    first, second = sorted(_replica_ids("two"))  # the rule's tie-break order

    # Prefix affinity. P1 streams on `first` (idle, lowest id); meanwhile P2 goes to the less
    # loaded `second`; from then on each prefix goes back to its replica, though both are idle
    # and the lowest id would win without it.
    p1 = "Alpha. " + "The quick brown fox jumps over the lazy dog. " * 12
    p2 = "Beta. " + "A journey of a thousand miles begins with a single step. " * 10
    body = {
        "model": MODEL,
        "prompt": p1 + "One",
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as stream:
        assert stream.headers[REPLICA_HEADER] == first
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        assert _complete(base, p2 + "One") == second
        assert "data: [DONE]" in list(lines)
    assert [_complete(base, p2 + q) for q in ("Two", "Three")] == [second, second]
    assert _complete(base, p1 + "Two") == first
    # Each replica's own prefix cache: the repeats found their prefix's full blocks there.
    shared1, shared2 = (_shared_blocks(base, p + "One", p + "Two") for p in (p1, p2))
    assert shared1 >= 4 and shared2 >= 4
    assert _metric(base, first, "pagedserve_prefix_cache_hits") == shared1 * 16
    assert _metric(base, second, "pagedserve_prefix_cache_hits") == 2 * shared2 * 16

    # A stream on `second` survives `first` being killed; Ray replaces `first`.
    prompt = "Once upon a time, in a village by the sea,"
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    offline = real_llm.generate(prompt, params)[0].outputs[0].text
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    pieces = []
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body, headers={REPLICA_HEADER: second}, timeout=120
    ) as stream:
        assert stream.headers[REPLICA_HEADER] == second
        events = _sse(stream)
        pieces.append(next(events)["choices"][0]["text"])
        ray.kill(_replica_actor("two", first))
        pieces += [event["choices"][0]["text"] for event in events]
    assert "".join(pieces) == offline and len(pieces) >= 16
    replacement = _wait_replaced("two", gone={first}, kept={second})

    # The health check: `second`'s engine core dies, the replica stays up, Ray replaces it.
    pid = ray.get(_replica_actor("two", second).__ray_call__.remote(lambda _: os.getpid()))
    (core,) = [
        c for c in child_pids(pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]
    os.kill(core, signal.SIGKILL)
    third = _wait_replaced("two", gone={second}, kept={replacement})
    assert _complete(base, p2 + "Two", replica=third) == third

    # Scale-down drains. A stream on each replica; then the app is deployed again with one
    # replica: Ray removes one old replica at once, its stream in flight, and then replaces the
    # other (serve.run from Python makes a new code version). Both streams end whole: Ray's
    # drain, then the replica's own (__del__), before its engine stops.
    body["max_tokens"] = 64
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    offline = real_llm.generate(prompt, params)[0].outputs[0].text
    old = {replacement, third}
    with contextlib.ExitStack() as streams:
        events = []
        for replica in sorted(old):
            stream = streams.enter_context(
                httpx.stream("POST", f"{base}/v1/completions", json=body,
                             headers={REPLICA_HEADER: replica}, timeout=120)
            )  # fmt: skip
            assert stream.headers[REPLICA_HEADER] == replica
            events.append(_sse(stream))
        texts = [[next(e)["choices"][0]["text"]] for e in events]
        serve.run(build_app({**args, "num_replicas": 1}), name="two", route_prefix="/")
        for text, stream_events in zip(texts, events, strict=True):
            text += [event["choices"][0]["text"] for event in stream_events]
    assert ["".join(text) for text in texts] == [offline] * 2
    deadline = time.monotonic() + 60
    while len(ids := _replica_ids("two")) != 1 or ids & old:
        assert time.monotonic() < deadline, ids
        time.sleep(0.2)
    serve.delete("two")


@pytest.mark.slow
def test_the_replica_as_its_own_ingress(ray_cluster, real_llm):
    """router "pow2": no ingress deployment, Ray's proxy routes to the replicas' own app."""
    for app in set(serve.status().applications) & {"one", "two"}:
        serve.delete(app)
    args = {"args": f"{ENGINE_ARGS} --api-key {API_KEY}", "router": "pow2", "cpus_per_rank": 2}
    serve.run(build_app(args), name="direct", route_prefix="/")
    offline = real_llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    client = openai.OpenAI(base_url=f"{ray_cluster}/v1", api_key=API_KEY, max_retries=0)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer.choices[0].text == offline.text
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0, stream=True,
    )  # fmt: skip
    greedy = SamplingParams(max_tokens=8, temperature=0)
    chat = real_llm.chat([{"role": "user", "content": PROMPT}], greedy)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat[0].outputs[0].text and len([p for p in pieces if p]) >= 4
    assert httpx.get(f"{ray_cluster}/health", timeout=10).status_code == 200
    assert set(serve.status().applications["direct"].deployments) == {REPLICA_DEPLOYMENT}
    serve.delete("direct")


def _complete(base: str, prompt: str, replica: str | None = None) -> str:
    """POST a short greedy completion; the id of the replica that answered."""
    headers = {REPLICA_HEADER: replica} if replica else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER]


def _shared_blocks(base: str, a: str, b: str) -> int:
    """Full KV blocks (16 tokens) the token prompts of `a` and `b` share."""
    tokens = []
    for prompt in (a, b):
        r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30)
        tokens.append(r.json()["tokens"])
    shared = next(
        (i for i, (x, y) in enumerate(zip(*tokens, strict=False)) if x != y), min(map(len, tokens))
    )
    return shared // 16


def _metric(base: str, replica: str, name: str) -> float:
    r = httpx.get(f"{base}/metrics", headers={REPLICA_HEADER: replica}, timeout=30)
    assert r.headers[REPLICA_HEADER] == replica
    found = re.search(rf"^{name}(?:_total)? (\S+)$", r.text, re.MULTILINE)
    assert found, r.text
    return float(found.group(1))


def _sse(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def _replica_ids(app: str) -> set[str]:
    """The ids of the app's live engine replicas, from their actors' names."""
    prefix = f"SERVE_REPLICA::{app}#{REPLICA_DEPLOYMENT}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.removeprefix(prefix) for n in names if n.startswith(prefix)}


def _replica_actor(app: str, replica: str):
    return ray.get_actor(f"SERVE_REPLICA::{app}#{REPLICA_DEPLOYMENT}#{replica}", namespace="serve")


def _wait_running(app: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while (status := serve.status().applications[app]).status != "RUNNING":
        assert status.status in ("NOT_STARTED", "DEPLOYING"), status.message
        assert time.monotonic() < deadline, f"{app} not running after {timeout} s"
        time.sleep(0.2)


def _wait_replaced(app: str, gone: set[str], kept: set[str], timeout: float = 240) -> str:
    """Wait until the app runs the replicas `kept` and one new one, none of `gone`, and serves
    again; returns the new one's id."""
    deadline = time.monotonic() + timeout
    while True:
        ids = _replica_ids(app)
        if len(ids) == len(kept) + 1 and kept <= ids and not ids & gone:
            if serve.status().applications[app].status == "RUNNING":
                (new,) = ids - kept
                return new
        assert time.monotonic() < deadline, f"replicas {ids}, waiting to replace {gone}"
        time.sleep(0.5)
