"""Qwen3, Gemma 2, Gemma 3, Phi-3, Mixtral and Qwen3-MoE: for each, a tiny random checkpoint
built with transformers' own config and model classes (tests/families.py) gives pagedserve's
engine transformers' greedy tokens, for prompts run together through 4-token blocks, several of
them longer than the 8-token sliding windows, on the torch backend and on the Triton backend
(under Triton's interpreter on CPU, as tests/engine/test_attention_backend.py explains).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models.model_config import FULL_ATTENTION, SLIDING_ATTENTION
from pagedserve.kernels import cpu_ops, triton_attention
from tests.families import COMMON, FAMILIES, build_family
from tests.helpers import hf_greedy

PROMPT_LENGTHS = [1, 5, 13, 30]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (its checkpoint folder, the transformers model), each built once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = (path, build_family(name, path))
        return cache[name]

    return get


def _prompts(seed: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, COMMON["vocab_size"]) for _ in range(n)] for n in lengths]


def _greedy(llm: LLM, prompts, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _llm(path, backend: str = "torch", **kwargs) -> LLM:
    options = dict(num_kv_blocks=128, max_model_len=64, max_num_batched_tokens=16)
    return LLM(
        str(path), device="cpu", dtype="float32", block_size=4, attention_backend=backend,
        **{**options, **kwargs},
    )  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_transformers_on_the_torch_backend(name, built):
    path, hf = built(name)
    prompts = _prompts(1)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = _llm(path)
    assert _greedy(llm, prompts) == expected
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.skipif(
    not cpu_ops.available(), reason="no compiled CPU kernels here: the cpu backend is the reference"
)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_request_alone_gives_its_batched_tokens_on_the_compiled_kernel(name, built):
    """Each prompt alone, then all together, through CPU's default backend (the compiled
    attention kernel). A lone prompt of one block: the families with sliding and full layers
    (Qwen3, Gemma 2 and 3) have two KV groups, and such a request's tables once reached the
    kernel with entries 2 apart, which it refused (engine/worker/model_runner.py `_send`)."""
    path, hf = built(name)
    prompts = _prompts(9, [2, 13])
    expected = [hf_greedy(hf, p, 8) for p in prompts]
    llm = _llm(path, "cpu")
    assert llm.engine.core.worker.attention_backend == "cpu"
    assert [_greedy(llm, [p], 8)[0] for p in prompts] == expected
    assert _greedy(llm, prompts, 8) == expected
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


@pytest.mark.skipif(
    not triton_attention.INTERPRETED,
    reason="CPU tensors need Triton's interpreter, which tests/conftest.py turns on only on "
    "machines without a GPU; on a GPU, benchmarks/gpu_engine.sh checks the compiled kernels",
)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_equals_transformers_on_the_triton_backend(name, built):
    # Two prompts, one past the window and prefilled in two chunks next to the other's decodes:
    # the interpreter is slow, and the torch test above covers the rest.
    path, hf = built(name)
    prompts = _prompts(2, [3, 13])
    expected = [hf_greedy(hf, p, 6) for p in prompts]
    assert _greedy(_llm(path, "triton", max_num_batched_tokens=8), prompts, 6) == expected


def test_family_traits_reach_the_engine(built):
    """What makes each family itself is read from its config.json, not defaulted away."""
    configs = {name: _llm(built(name)[0]).engine.core.model_config for name in FAMILIES}
    qwen3, gemma2, gemma3 = configs["qwen3"], configs["gemma2"], configs["gemma3"]
    assert qwen3.layer_types == (FULL_ATTENTION, SLIDING_ATTENTION)
    assert qwen3.qk_norm and not gemma2.qk_norm and gemma3.qk_norm
    assert gemma2.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (5.0, 3.0)
    assert gemma2.attention_scale == 24**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert gemma3.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e5, 1000.0)
    assert gemma3.rope_scaling_dict() == {"rope_type": "linear", "factor": 4.0}
    assert configs["phi3"].rope_scaling_dict()["original_max_position_embeddings"] == 64
    mixtral, qwen3_moe = configs["mixtral"], configs["qwen3_moe"]
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        4,
        2,
        True,
    )
    assert (qwen3_moe.num_experts, qwen3_moe.moe_intermediate_size) == (8, 32)


def test_phi3_longrope_picks_long_factors_past_the_original_context(built):
    """Up to original_max_position_embeddings (64) the engine rotates by the short factors, as
    transformers does for such sequences; an engine serving longer contexts rotates every token
    by the long factors, as transformers does once a sequence is past 64 tokens."""
    path, hf = built("phi3")
    short, long = _prompts(3, [9, 30]), _prompts(4, [70, 90])
    assert _greedy(_llm(path, max_model_len=64), short) == [hf_greedy(hf, p, 12) for p in short]
    assert _greedy(_llm(path, max_model_len=256), long) == [hf_greedy(hf, p, 12) for p in long]
    # Both tables are transformers' own LongRoPE, short and long.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    positions = torch.arange(256, dtype=torch.float32)
    for max_model_len, seq_len in ((64, None), (256, 65)):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu", seq_len=seq_len)
        angles = positions[:max_model_len, None] * inv_freq[None, :]
        rotary = _llm(path, max_model_len=max_model_len).engine.core.worker.model.rotary
        torch.testing.assert_close(rotary.cos, torch.cat((angles, angles), -1).cos() * factor)


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3 4B, 12B and 27B are published as Gemma3ForConditionalGeneration: the language
    model's tensors under `language_model.`, next to a vision tower. pagedserve serves the
    language model and leaves the rest; its tokens equal transformers' whole model given text."""
    import transformers

    _, _, extra = FAMILIES["gemma3"]
    text = {**COMMON, **extra}
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=252, eoi_token_index=253, image_token_index=254,
    )  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if "norm" in param_name and "language_model" in param_name:
                param.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    prompts = _prompts(7, [3, 13])
    llm = _llm(tmp_path)
    assert llm.engine.core.model_config.architecture == "gemma3_text"
    assert llm.engine.core.model_config.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert _greedy(llm, prompts, 8) == [hf_greedy(hf, p, 8) for p in prompts]


def test_an_end_id_listed_only_in_generation_config_ends_generation(built, tmp_path):
    """Instruction-tuned Phi-3 and Gemma 2 list their end-of-turn token only in
    generation_config.json; generation stops there, as in transformers and vLLM."""
    import json
    import shutil

    path, hf = built("phi3")
    prompt = _prompts(8, [6])[0]
    free = hf_greedy(hf, prompt, 10)
    # The first generated token not seen before it (so that nothing earlier stops the run).
    at = next(i for i in range(1, 10) if free[i] not in free[:i] and free[i] != 2)
    folder = tmp_path / "phi3-instruct"
    shutil.copytree(path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, free[at]]}))
    llm = _llm(folder)
    assert llm.engine.core.eos_token_ids == (2, free[at])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free[: at + 1], "stop")
