"""The Kubernetes manifests in docker/k8s/, checked without a cluster: the built-in kinds against
Kubernetes' own OpenAPI schema (kubernetes-validate, strict: an unknown field fails, as with
kubectl's default server-side field validation), the Gateway API Inference Extension's objects
against schemas written here from the CRDs' documented fields, and the facts that tie them
together against pagedserve itself: the container's args through the real `pagedserve serve`
parser, the probes and the endpoint picker's metrics on the real app, ports, label selectors and
the shutdown timings."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.messages import EngineStats
from pagedserve.server.app import build_app
from pagedserve.server.cli import build_parser
from pagedserve.server.server_config import ServerConfig

K8S = Path(__file__).resolve().parents[1] / "docker" / "k8s"
KUBERNETES_VERSION = "1.32"  # one pinned schema: results do not move with the package's newest
POD_IP = "10.1.2.3"  # what the downward API would give $(POD_IP)
# What the Gateway API Inference Extension's endpoint picker scrapes (the YAML headers say so).
EPP_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
)

FILES = ["deployment.yaml", "inferencepool.yaml", "service.yaml"]
DOCS = [doc for name in FILES for doc in yaml.safe_load_all((K8S / name).read_text())]


def _one(kind: str) -> dict[str, Any]:
    found = [doc for doc in DOCS if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


DEPLOYMENT, SERVICE = _one("Deployment"), _one("Service")
POOL, OBJECTIVE = _one("InferencePool"), _one("InferenceObjective")
POD = DEPLOYMENT["spec"]["template"]
(CONTAINER,) = POD["spec"]["containers"]
PORTS = {p["name"]: p["containerPort"] for p in CONTAINER["ports"]}


# --- the CRD objects' schemas, from the fields the extension documents (api/v1, apix/v1alpha2) --
# Custom resources are strict too: kubectl's server-side field validation refuses unknown fields.
def _string(min_length: int, max_length: int, pattern: str = ".*") -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length, "pattern": pattern}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    strict = {"additionalProperties": False}
    return {"type": "object", "required": required, "properties": properties} | strict


_DNS = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAME, _GROUP = _string(1, 253), _string(0, 253, rf"^$|^{_DNS}(\.{_DNS})*$")
_KIND = _string(1, 63, r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
_LABEL_VALUE = _string(0, 63, r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_PORT = _object(["number"], number={"type": "integer", "minimum": 1, "maximum": 65535})
_PICKER = _object(
    ["name"], group=_GROUP, kind=_KIND, name=_NAME, port=_PORT,
    failureMode={"enum": ["FailOpen", "FailClose"]},
)  # fmt: skip
# The CRD's CEL rule `self.kind != 'Service' || has(self.port)`; kind defaults to Service.
_PICKER |= {"if": {"properties": {"kind": {"const": "Service"}}}, "then": {"required": ["port"]}}
_UNIQUE = {"uniqueItems": True}
_LABELS = {"type": "object", "minProperties": 1, "additionalProperties": _LABEL_VALUE}
_POOL_SPEC = _object(
    ["selector", "targetPorts", "endpointPickerRef"],
    selector=_object(["matchLabels"], matchLabels=_LABELS),
    targetPorts={"type": "array", "items": _PORT, "minItems": 1, "maxItems": 8} | _UNIQUE,
    appProtocol={"enum": ["http", "kubernetes.io/h2c"]},
    endpointPickerRef=_PICKER,
)
_POOL_REF = _object(["name"], group=_GROUP, kind=_KIND, name=_NAME)
_OBJECTIVE_SPEC = _object(["poolRef"], priority={"type": "integer"}, poolRef=_POOL_REF)
CRD_SPECS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): _POOL_SPEC,
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"): _OBJECTIVE_SPEC,
}


def _validate(doc: dict[str, Any]) -> None:
    """jsonschema.ValidationError (kubernetes-validate's subclasses it) for an invalid object;
    kubernetes-validate's SchemaNotFoundError for a kind that neither validator knows."""
    spec = CRD_SPECS.get((doc["apiVersion"], doc["kind"]))
    if spec is None:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return
    top = {"apiVersion": {"const": doc["apiVersion"]}, "kind": {"const": doc["kind"]}}
    # ObjectMeta: only its name here (Kubernetes checks the rest of it for every kind alike).
    metadata = {"type": "object", "required": ["name"], "properties": {"name": _NAME}}
    schema = _object([*top, "metadata", "spec"], **top, metadata=metadata, spec=spec)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


def _expand(arg: str) -> str:
    """Kubernetes' $(VAR) expansion in args, from the container's env (a name it does not
    define would stay as is, silently: here it fails)."""
    env = {e["name"] for e in CONTAINER["env"]}
    for name in re.findall(r"\$\((\w+)\)", arg):
        assert name in env, f"$({name}) in the args is not in the container's env"
    return arg.replace("$(POD_IP)", POD_IP)


def _serve() -> tuple[EngineConfig, ServerConfig]:
    """The container's args through `pagedserve serve`'s parser and both configs' checks."""
    argv = [_expand(a) for a in CONTAINER["args"]]
    try:
        args = build_parser().parse_args(["serve", *argv])
    except SystemExit:
        pytest.fail(f"`pagedserve serve` refuses {argv} (see the usage message above)")
    # ValueError for an invalid option (the KV events' JSON included).
    return args.config_cls.from_cli_args(args), ServerConfig.from_cli_args(args)


def test_the_folder_holds_the_deployment_service_pool_and_objective() -> None:
    assert sorted(p.name for p in K8S.iterdir()) == FILES  # so every file is checked here
    kinds = ["Deployment", "InferenceObjective", "InferencePool", "Service"]
    assert sorted(doc["kind"] for doc in DOCS) == kinds


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d["kind"])
def test_every_object_validates_against_its_schema(doc: dict[str, Any]) -> None:
    _validate(doc)


# One wrong field each: the validations are real. `unknown-field`: strict mode; `picker-port`:
# the CEL rule; `criticality`: InferenceObjective's field before `priority`.
@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("Deployment", lambda d: d["spec"].update(replicas="two")),
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(gpus=1)),
        ("Service", lambda d: d["spec"]["ports"][0].update(port="8000")),
        ("InferencePool", lambda d: d["spec"]["targetPorts"][0].update(number=0)),
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port")),
        ("InferenceObjective", lambda d: d["spec"].update(criticality="Critical")),
    ],
    ids=["replicas-string", "unknown-field", "port-string", "port-0", "picker-port", "criticality"],
)
def test_the_validators_refuse_a_wrong_field(kind: str, change: Callable[[dict], Any]) -> None:
    doc = copy.deepcopy(_one(kind))
    change(doc)
    with pytest.raises(jsonschema.ValidationError):
        _validate(doc)


def test_the_container_args_parse_with_pagedserve_serve() -> None:
    engine, server = _serve()
    assert (server.host, server.port) == ("0.0.0.0", PORTS["http"])
    mounts = {m["mountPath"]: m["name"] for m in CONTAINER["volumeMounts"]}
    assert mounts.get("/models") == "models" and engine.model.model.startswith("/models/")
    assert server.served_model_name == ("meta-llama/Llama-3.1-8B-Instruct",)


@pytest.fixture
def served() -> tuple[TestClient, SimpleNamespace]:
    """The real app around a stand-in engine: what build_app, /health and /metrics read of one
    (a quarter of the KV cache used; LoRA slots, for vllm:lora_requests_info shows only then)."""
    stats = EngineStats(2, 1, kv_blocks_used=25, kv_blocks_total=100, max_loras=4)
    inputs = SimpleNamespace(pooling=None, max_model_len=4096, max_lora_rank=64)
    engine = SimpleNamespace(
        inputs=inputs, max_model_len=4096, stats=stats, core_stats=[stats], core_pids=[],
        num_cores=1, is_running=True, draining=False, error=None,
    )  # fmt: skip
    app = build_app(engine, ["m"], "/models/m", manage_engine=False)  # type: ignore[arg-type]
    return TestClient(app), engine


def test_the_probes_get_health_which_answers_503_draining_or_dead(served: tuple) -> None:
    client, engine = served
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = CONTAINER[probe]["httpGet"]
        assert get["path"] == "/health" and PORTS[get["port"]] == PORTS["http"]

    def health() -> tuple[int, str | None]:
        answer = client.get("/health")
        return answer.status_code, answer.json()["error"]["code"] if answer.content else None

    assert health() == (200, None)
    engine.draining = True  # after SIGTERM: out of the Service's and the pool's endpoints
    assert health() == (503, "shutting_down")
    engine.draining, engine.is_running = False, False
    assert health() == (503, "engine_dead")


def test_metrics_has_what_the_endpoint_picker_reads(served: tuple) -> None:
    text = served[0].get("/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert [name for name in EPP_METRICS if name not in values] == [], "missing from /metrics"
    assert values["vllm:kv_cache_usage_perc"] == 0.25  # a fraction, as vLLM's


def test_the_service_and_the_pool_send_to_the_http_port() -> None:
    (port,) = SERVICE["spec"]["ports"]
    assert PORTS.get(port["targetPort"], port["targetPort"]) == PORTS["http"] == port["port"]
    assert POOL["spec"]["targetPorts"] == [{"number": PORTS["http"]}]


def test_the_selectors_pick_the_pod_template() -> None:
    labels = POD["metadata"]["labels"].items()
    deployment = DEPLOYMENT["spec"]["selector"]["matchLabels"]
    pool = POOL["spec"]["selector"]["matchLabels"]
    for selector in (deployment, SERVICE["spec"]["selector"], pool):
        assert selector and selector.items() <= labels, selector
    assert OBJECTIVE["spec"]["poolRef"]["name"] == POOL["metadata"]["name"]
    assert OBJECTIVE["spec"]["poolRef"]["group"] == POOL["apiVersion"].split("/")[0]


def test_kv_events_publish_on_the_containers_kv_ports() -> None:
    engine, server = _serve()
    # The engine's own reading of the JSON; None: events off.
    events = engine.observability.kv_events
    assert events is not None and events.publisher == "zmq"
    # Bound on every interface (a wildcard address binds, others connect).
    assert events.endpoint == f"tcp://*:{PORTS['kv-events']}" == "tcp://*:5557"
    assert events.replay_endpoint == f"tcp://*:{PORTS['kv-replay']}" == "tcp://*:5558"
    assert server.data_parallel_size == 1  # core i would publish on 5557 + i: one port each
    # The picker keys the events by pod and by the model name requests carry.
    assert events.topic == f"kv@{POD_IP}@{server.served_model_name[0]}"


def test_the_pod_leaves_the_endpoints_then_drains_within_the_grace_period() -> None:
    shutdown_timeout = _serve()[1].shutdown_timeout
    command = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2
    assert POD["spec"]["terminationGracePeriodSeconds"] > float(command[1]) + shutdown_timeout
    # A drain answers /health with 503 for up to the shutdown timeout: no restart for that.
    live, ready = CONTAINER["livenessProbe"], CONTAINER["readinessProbe"]
    live_s = live["periodSeconds"] * live["failureThreshold"]
    assert live_s > shutdown_timeout
    # A dead engine's 503s take the pod out of the endpoints well before they restart it.
    assert ready["periodSeconds"] * ready["failureThreshold"] < live_s


def test_the_pod_gets_a_gpu_shared_memory_and_the_api_key_serve_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert CONTAINER["resources"]["limits"]["nvidia.com/gpu"] == 1
    volumes = {v["name"]: v for v in POD["spec"]["volumes"]}
    (shm,) = [m for m in CONTAINER["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("valueFrom", {}) for e in CONTAINER["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    (name,) = [n for n, source in env.items() if "secretKeyRef" in source]
    assert env[name]["secretKeyRef"]["optional"] is True  # no Secret: no key required
    monkeypatch.setenv(name, "sk-test")
    assert build_parser().parse_args(["serve"]).api_key == "sk-test"
