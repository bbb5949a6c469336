"""The engine on the Triton attention backend gives the torch backend's (and transformers') greedy
tokens, and the backend is chosen by option, environment variable or device.

On CPU (CI) the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py): the real kernels, executed with numpy instead of compiled for a GPU.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pagedserve import kernels
from pagedserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedserve.kernels import triton_attention, triton_ops
from tests.helpers import hf_greedy, record_calls

pytestmark = pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, `python -m benchmarks.gpu_kernels` checks the "
    "compiled kernels",
)

PROMPT_LENGTHS = [1, 5, 12, 23, 40]


def _generate(path, backend: str, prompts, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        str(path), device="cpu", dtype="float32", block_size=4, attention_backend=backend, **kwargs
    )
    assert llm.engine.core.worker.attention_backend == backend
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(("kind", "variant"), [("llama", False), ("qwen2", False), ("llama", True)])
def test_triton_backend_greedy_equals_torch_backend_and_transformers(
    kind, variant, tiny_llama_dir, tiny_qwen2_dir, monkeypatch, request
):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if kind == "llama" else tiny_qwen2_dir
    rng = random.Random(99)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    expected = [hf_greedy(hf, p, 12) for p in prompts]

    # A 16-token budget: prompts are prefilled in chunks next to other sequences' decodes, so
    # the steps mix extends over cached prefixes with decodes, and the last steps are pure
    # decode: by default all through the extend kernel (one request, one answer); with
    # PAGEDSERVE_BATCH_VARIANT=1 the pure decode steps through the split-context decode kernel.
    if variant:
        request.getfixturevalue("batch_variant")
    options = dict(num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16)
    _, with_torch = _generate(path, "torch", prompts, **options)
    # Every op of the Triton backend runs: the attention kernels and the fused layer ops.
    fused = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache")
    attention_calls = record_calls(monkeypatch, triton_attention, ("decode", "extend"))
    fused_calls = record_calls(monkeypatch, triton_ops, fused)
    llm, with_triton = _generate(path, "triton", prompts, **options)
    assert with_torch == expected
    assert with_triton == expected
    launches = Counter(attention_calls + fused_calls)
    assert all(launches[name] for name in ("extend", *fused)), launches
    assert (launches["decode"] > 0) == variant, launches
    # Per step: one norm (the first layer's input), then two fused norms per layer (the second
    # layer's input norm, both post-attention norms and the final norm).
    assert launches["fused_add_rms_norm"] == 2 * 2 * launches["rms_norm"], launches
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory):
    """A tiny random Mistral checkpoint with an 8-token sliding window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=8, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-mistral")
    MistralForCausalLM(config).save_pretrained(path)
    return path


def test_sliding_window_model_matches_transformers_on_both_backends(tiny_mistral_dir):
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 20, 33)]
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_mistral_dir, dtype="float32", attn_implementation="eager"
    ).eval()
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    hf.config.sliding_window = None  # the window matters: without it the tokens differ
    assert [hf_greedy(hf, p, 12) for p in prompts] != expected
    options = dict(num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16)
    llm, with_torch = _generate(tiny_mistral_dir, "torch", prompts, **options)
    assert llm.engine.core.model_config.sliding_window == 8
    _, with_triton = _generate(tiny_mistral_dir, "triton", prompts, **options)
    assert with_torch == expected
    assert with_triton == expected


def test_triton_backend_after_a_prefix_cache_hit(tiny_llama_dir):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 512) for _ in range(20)]
    a, b = prefix + [5, 6], prefix + [7, 8, 9]
    _, expected = _generate(tiny_llama_dir, "torch", [a, b], num_kv_blocks=64, max_model_len=128)
    llm, first = _generate(tiny_llama_dir, "triton", [a], num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    second = llm.generate([b], params)[0].outputs[0].token_ids
    assert first + [second] == expected
    # b's first 20 tokens (5 blocks) came from the cache: its prefill was an extend.
    assert llm.engine.core.scheduler.kv_cache_manager.num_prefix_cache_hits_tokens == 20


def test_backend_option_and_environment(tiny_llama_dir, monkeypatch):
    def engine(**kwargs) -> LLMEngine:
        config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=128, **kwargs)
        return LLMEngine(config)

    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    default = engine()
    assert default.core.worker.attention_backend == "cpu"  # CPU default: the compiled kernel
    assert default.core.worker.model.layers[0].self_attn.ops is kernels.get_backend("cpu")
    torch_layer = engine(attention_backend="torch").core.worker.model.layers[0]
    assert torch_layer.self_attn.ops is kernels.reference
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    from_env = engine()
    assert from_env.core.worker.attention_backend == "triton"
    layer = from_env.core.worker.model.layers[1]
    assert layer.self_attn.ops is layer.mlp.ops is layer.input_layernorm.ops is triton_ops
    assert (
        engine(attention_backend="torch").core.worker.attention_backend == "torch"
    )  # option beats env
    monkeypatch.setenv(kernels.BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="PAGEDSERVE_ATTENTION_BACKEND='flash' is not an"):
        engine()
    with pytest.raises(ValueError, match=r"must be one of \['auto', 'cpu', 'torch', 'triton'\]"):
        EngineConfig(attention_backend="flash")
