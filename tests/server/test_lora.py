"""LoRA adapters on the real SmolLM2 through a real `pagedserve serve` and the official `openai`
client: an adapter saved by PEFT, served with --lora-modules and loaded again at run time
(vLLM's /v1/load_lora_adapter), gives the greedy tokens of PEFT's PeftModel around transformers'
own SmolLM2 (read from the same GGUF file, float32 as the server runs it); unloading an adapter
while its stream runs lets the stream finish; /v1/models, /v1/kv and /metrics know the adapters.
"""

from __future__ import annotations

import contextlib
import io
import threading

import httpx
import pytest

from pagedserve.server.lora.serving_lora import parse_lora_module
from tests.server.conftest import LORA_PROMPT, LORA_TOKENS
from tests.server.test_readme_examples import LORA_PORT, serve_it_examples
from tests.server.util import RunningServer, client

PROMPT, NEW_TOKENS = LORA_PROMPT, LORA_TOKENS


@pytest.fixture(scope="module")
def adapter(smollm2_lora_adapter):
    return smollm2_lora_adapter


@pytest.fixture(scope="module")
def lora_server(r1_lora_server) -> RunningServer:
    """SmolLM2 serving the adapter as `sql` (tests/server/conftest.py; the server's reasoning
    parser is test_reasoning_chat.py's, and changes nothing here but chat's split)."""
    return r1_lora_server


def _complete(server, model: str, **kwargs) -> str:
    kwargs.setdefault("max_tokens", NEW_TOKENS)
    out = client(server).completions.create(model=model, prompt=PROMPT, temperature=0, **kwargs)
    assert out.model == model
    return out.choices[0].text


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.v1}/{route}", json=body, timeout=60)


def test_an_adapter_from_lora_modules_gives_peft_tokens_and_the_base_stays(lora_server, adapter):
    _, with_adapter, base = adapter
    assert _complete(lora_server, "sql") == with_adapter
    assert _complete(lora_server, "smollm2-135m-instruct") == base
    stream = client(lora_server).completions.create(
        model="sql", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == with_adapter
    chat = client(lora_server).chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "sql" and chat.usage.completion_tokens == 4
    models = {m.id: m for m in client(lora_server).models.list().data}
    assert set(models) == {"smollm2-135m-instruct", "sql"}
    assert models["sql"].parent == "smollm2-135m-instruct"
    assert models["sql"].root == str(adapter[0])


def test_loading_and_unloading_at_run_time(lora_server, adapter, tmp_path):
    path, with_adapter, _ = adapter
    loaded = _post(lora_server, "load_lora_adapter", {"lora_name": "sql2", "lora_path": str(path)})
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'sql2' added successfully.",
    )
    assert _complete(lora_server, "sql2") == with_adapter
    again = _post(lora_server, "load_lora_adapter", {"lora_name": "sql2", "lora_path": str(path)})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'sql2' has already been loaded."
    missing = _post(
        lora_server, "load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")}
    )
    assert missing.status_code == 400
    assert "LoRA adapter 'x'" in missing.json()["error"]["message"]
    assert "no such file or folder" in missing.json()["error"]["message"]

    unloaded = _post(lora_server, "unload_lora_adapter", {"lora_name": "sql2"})
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'sql2' removed successfully.",
    )
    gone = httpx.post(
        f"{lora_server.v1}/completions", json={"model": "sql2", "prompt": "x"}, timeout=30
    )
    assert gone.status_code == 404
    assert gone.json()["error"]["code"] == "model_not_found"
    assert "sql" in gone.json()["error"]["message"]  # the names still served
    twice = _post(lora_server, "unload_lora_adapter", {"lora_name": "sql2"})
    assert twice.status_code == 404
    assert twice.json()["error"]["message"] == "The lora adapter 'sql2' cannot be found."


def test_unloading_while_a_stream_runs_lets_it_finish(lora_server, adapter):
    path, _, _ = adapter
    assert _post(lora_server, "load_lora_adapter", {"lora_name": "tmp", "lora_path": str(path)})
    whole = _complete(lora_server, "tmp", max_tokens=32, extra_body={"ignore_eos": True})
    started, seen_in_kv = threading.Event(), []

    def watch() -> None:
        started.wait(60)
        kv = httpx.get(f"{lora_server.v1}/kv", timeout=30).json()
        seen_in_kv.extend(r["lora"] for r in kv["requests"])
        unloaded = _post(lora_server, "unload_lora_adapter", {"lora_name": "tmp"})
        assert unloaded.status_code == 200

    watcher = threading.Thread(target=watch)
    watcher.start()
    stream = client(lora_server).completions.create(
        model="tmp", prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts, reasons = [], []
    for chunk in stream:
        texts.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
        started.set()
    watcher.join()
    assert "tmp" in seen_in_kv  # /v1/kv names each request's adapter
    assert reasons[-1] == "length" and "".join(texts) == whole
    assert httpx.get(f"{lora_server.v1}/models/tmp", timeout=30).status_code == 404


def test_metrics_name_the_adapters(lora_server):
    _complete(lora_server, "sql")
    text = httpx.get(f"{lora_server.base_url}/metrics", timeout=30).text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1
    assert 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("pagedserve_lora_requests_total{")
    }
    assert counts['pagedserve_lora_requests_total{lora_name="sql"}'] >= 1
    loads = [line for line in text.splitlines() if line.startswith("pagedserve_lora_slot_loads")]
    assert loads and float(loads[0].split()[1]) >= 1


def test_the_readme_lora_example_runs_as_written(lora_server, adapter):
    (block,) = [b for b in serve_it_examples() if LORA_PORT in b]
    code = block.replace(f"http://{LORA_PORT}", lora_server.base_url)
    code = code.replace("./sql-adapter", str(adapter[0]))
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own
    lines = printed.getvalue().splitlines()
    assert "('sql', 'smollm2-135m-instruct')" in lines[0]
    assert lines[1] == "Success: LoRA adapter 'sql-v2' added successfully."
    assert namespace["adapted"].model == "sql-v2" and namespace["adapted"].usage.completion_tokens
    assert "sql-v2" not in [m.id for m in client(lora_server).models.list().data]  # unloaded


def test_lora_modules_take_vllms_two_forms_and_refuse_others():
    assert parse_lora_module("sql=/adapters/sql") == ("sql", "/adapters/sql")
    spec = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "smollm2"}'
    assert parse_lora_module(spec) == ("sql", "/adapters/sql")
    with pytest.raises(ValueError, match="give each adapter as name=path"):
        parse_lora_module("/adapters/sql")
    with pytest.raises(ValueError, match='the JSON form needs "name" and "path" keys'):
        parse_lora_module('{"name": "sql"}')
