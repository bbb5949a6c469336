"""The decode step as one compiled call (engine/models/compiled_step.py,
kernels/csrc/cpu_decoder.cpp): for the models it takes, its steps give exactly the layer-by-layer
path's values (it runs the same kernels in the same order), and the models and steps it does not
take run layer by layer, with the start-up log saying why."""

from __future__ import annotations

import logging

import gguf
import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.models import compiled_step
from pagedserve.engine.models.compiled_step import CompiledStep
from pagedserve.engine.models.hf_config import config_from_json_file
from pagedserve.engine.models.model import CausalLM
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.quantized_linear import route
from pagedserve.kernels import cpu_features
from tests.engine.test_quantized_linear import _q4_k_m, _tiny_llama, needs_block_dot
from tests.families import COMMON, GGUF_CHANGES, build_family
from tests.gguf_writer import write_gguf_like_llama_cpp

Q = gguf.GGMLQuantizationType
pytestmark = needs_block_dot

# 1 to 30 prompt tokens; the last repeats itself, so that n-gram speculation drafts for it.
PROMPTS = [[5], [7, 8, 9, 10, 11], list(range(20, 33)), [40, 41, 42, 43] * 7 + [40, 41]]
# Eight sequences: four more of other tokens (the same prompts would share cached blocks).
PROMPTS_8 = PROMPTS + [[t + 100 for t in p] for p in PROMPTS]
COMPILED_LOG = "decode steps run as one compiled call (kernels/csrc/cpu_decoder.cpp)"


def _qwen2(folder) -> tuple[ModelConfig, dict]:
    """A tiny Qwen2: q/k/v with biases."""
    import transformers

    config = transformers.Qwen2Config(**{**COMMON, "hidden_size": 64, "head_dim": 16})
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return config_from_json_file(folder / "config.json"), hf.state_dict()


def _phi3(folder) -> tuple[ModelConfig, dict]:
    """tests/families.py's Phi-3: fused q/k/v and gate/up, longrope, and a sliding window of 8
    tokens, which the 13- and 30-token prompts cross."""
    hf = build_family("phi3", folder)
    return config_from_json_file(folder / "config.json"), hf.state_dict()


def _gguf(tmp_path, family: str, tensor_type) -> str:
    folder = tmp_path / family
    folder.mkdir()
    if family == "llama":
        config, weights = _tiny_llama(folder, hidden=64, initializer_range=0.3)
    elif family == "llama_256":  # rows of 256 values: K-quant blocks
        config, weights = _tiny_llama(folder, hidden=256, initializer_range=0.15)
    elif family == "qwen2":
        config, weights = _qwen2(folder)
    elif family == "phi3":
        config, weights = _phi3(folder)
    else:  # Gemma 2 and 3, Qwen3: per-head q/k norms, Gemma's four norms a layer, GELU-tanh
        hf = build_family(family, folder, **GGUF_CHANGES.get(family, {}))
        config, weights = config_from_json_file(folder / "config.json"), hf.state_dict()
    return str(write_gguf_like_llama_cpp(folder / "m.gguf", config, weights,
                                         tensor_type=tensor_type))  # fmt: skip


def _llm(path: str, dtype: str, **kwargs) -> LLM:
    return LLM(
        path, device="cpu", dtype=dtype, quantization="gguf", num_kv_blocks=128, block_size=4,
        max_model_len=64, max_num_batched_tokens=64, **kwargs,
    )  # fmt: skip


def _run(llm: LLM, prompts: list[list[int]], logprobs: int | None) -> list:
    """Each prompt's greedy tokens and, with `logprobs`, their top logprobs (token, logprob,
    rank) per position."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=logprobs)
    return [
        (
            o.outputs[0].token_ids,
            [sorted((t, lp.logprob, lp.rank) for t, lp in step.items())
             for step in o.outputs[0].logprobs or []],
        )
        for o in llm.generate(prompts, params)
    ]  # fmt: skip


def _mixed_q4_k_m(name: str) -> Q:
    """llama.cpp's Q4_K_M mix without test_quantized_linear's F32 part: q/k/v of Q4_K and Q6_K
    parts, gate/up of Q5_0 in layer 1."""
    kind = _q4_k_m(name)
    return Q.Q4_K if kind == Q.F32 else kind


CASES = {
    "llama Q4_1 float32": ("llama", Q.Q4_1, "float32", {}, PROMPTS),
    "llama Q8_0 bfloat16": ("llama", Q.Q8_0, "bfloat16", {}, PROMPTS),
    # Steps of 8 rows: the AMX tiles where the CPU has them (quantized_linear.route).
    "llama Q4_1 bfloat16, 8 sequences": ("llama", Q.Q4_1, "bfloat16", {}, PROMPTS_8),
    "llama Q4_K_M mix float32": ("llama_256", _mixed_q4_k_m, "float32", {}, PROMPTS),
    "qwen2 q/k/v bias Q8_0 float32": ("qwen2", Q.Q8_0, "float32", {}, PROMPTS),
    "phi3 window Q8_0 bfloat16": ("phi3", Q.Q8_0, "bfloat16", {}, PROMPTS),
    "gemma3 q/k norms, two windows Q8_0 bfloat16": ("gemma3", Q.Q8_0, "bfloat16", {}, PROMPTS),
    "gemma2 soft-capped Q8_0 float32": ("gemma2", Q.Q8_0, "float32", {}, PROMPTS),
    "qwen3 q/k norms Q8_0 float32": ("qwen3", Q.Q8_0, "float32", {}, PROMPTS),
    "llama Q8_0 float32, n-gram verify steps": ("llama", Q.Q8_0, "float32",
                                                {"speculative_ngram": 3}, PROMPTS),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_steps_equal_the_layer_by_layer_steps_exactly(case, tmp_path, caplog, monkeypatch):
    """Greedy tokens and their logprobs, decoding sequences of 1 to 30 prompt tokens together
    (steps of 4 or 8 rows, speculative verify steps of up to 4 tokens per sequence): equal to the
    last bit with --enforce-eager, which runs the same steps layer by layer."""
    family, tensor_type, dtype, options, prompts = CASES[case]
    path = _gguf(tmp_path, family, tensor_type)
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        eager = _llm(path, dtype, enforce_eager=True, **options)
    assert "decode steps run layer by layer (--enforce-eager)" in caplog.text
    assert eager.engine.core.worker.model.compiled_step is None
    # Requests with logprobs get no speculative drafts: those cases compare the tokens alone.
    logprobs = None if "speculative_ngram" in options else 3
    expected = _run(eager, prompts, logprobs)
    del eager

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm = _llm(path, dtype, **options)
    assert COMPILED_LOG in caplog.text
    steps, compiled = [], []  # the rows of every step, and of those that ran compiled
    real_forward, real_call = CausalLM.forward, CompiledStep.__call__

    def forward(self, input_ids, *args):
        steps.append(input_ids.shape[0])
        return real_forward(self, input_ids, *args)

    def call(self, x, *args):
        compiled.append(x.shape[0])
        return real_call(self, x, *args)

    monkeypatch.setattr(CausalLM, "forward", forward)
    monkeypatch.setattr(CompiledStep, "__call__", call)
    assert _run(llm, prompts, logprobs) == expected
    # Every step whose rows take a block route ran compiled (the kernel attends to every prompt
    # of up to 30 tokens): the decode steps, of a row per sequence or verify steps of up to 4
    # tokens each, and the prompts' steps too where their rows take the AMX tiles.
    assert compiled == [n for n in steps if route(n, getattr(torch, dtype)) != "dense"]
    decodes = [n for n in compiled if n <= len(prompts)]  # a row per sequence, or fewer
    assert len(decodes) >= (1 if "speculative_ngram" in options else 11)
    if "speculative_ngram" in options:  # and verify steps of drafts
        assert any(len(prompts) < n <= 4 * len(prompts) for n in compiled)
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_steps_it_does_not_take_run_layer_by_layer(tmp_path):
    llm = _llm(_gguf(tmp_path, "llama", Q.Q8_0), "float32")
    step = llm.engine.core.worker.model.compiled_step
    kv_caches = llm.engine.core.worker.runner.kv_caches
    hidden = 64

    def meta(lengths: list[int]):
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return compiled_step.AttentionMetadata(
            slot_mapping=torch.zeros(1, sum(lengths), dtype=torch.int64),
            block_tables=torch.zeros(1, len(lengths), 4, dtype=torch.int32),
            seq_lens=torch.tensor(lengths, dtype=torch.int32) + 3,
            query_start_loc=starts,
        )

    def takes(lengths: list[int], dtype=torch.float32) -> bool:
        return step.takes(torch.zeros(sum(lengths), hidden, dtype=dtype), meta(lengths), kv_caches)

    assert takes([1, 1, 1]) and takes([4, 1, 2])
    assert takes([30, 1])  # a short prompt: the kernel attends to it
    # By default every step: the kernel attends to every prompt, the blocks take every step.
    assert takes([200, 1]) and takes([1] * 33)
    assert not takes([1, 1], torch.bfloat16)  # the cache holds float32
    with pytest.MonkeyPatch.context() as patch:  # --batch-variant's faster paths
        patch.setenv(cpu_features.BATCH_VARIANT_ENV, "1")
        cpu_features.batch_variant.cache_clear()
        assert not takes([200, 1])  # a prompt the kernel leaves to SDPA (cpu_ops.kernel_attends)
        assert not takes([1] * 33)  # float32 steps of more than 32 rows: dequantized weights
    cpu_features.batch_variant.cache_clear()
    step._first.qkv_lora = object()  # a LoRA adapter's delta on the layers
    assert not takes([1, 1])


def test_models_it_does_not_take_say_why(tmp_path, caplog):
    path = _gguf(tmp_path, "llama_256", _q4_k_m)  # layer 1's q/k/v has an F32 part: dense
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm = _llm(path, "float32")
    assert "decode steps run layer by layer (matmul weights not kept as GGUF blocks)" in caplog.text
    assert llm.engine.core.worker.model.compiled_step is None

    folder = tmp_path / "qwen3_moe"
    hf = build_family("qwen3_moe", folder, **GGUF_CHANGES["qwen3"])
    config = config_from_json_file(folder / "config.json")
    path = write_gguf_like_llama_cpp(folder / "m.gguf", config, hf.state_dict(),
                                     tensor_type=Q.Q8_0)  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve"):
        llm = _llm(str(path), "float32")
    assert "decode steps run layer by layer (a mixture of experts)" in caplog.text
