"""Multi-LoRA through the whole engine, against PEFT: tiny random Llama, Qwen2 and Gemma 2 models
(transformers' own classes) with random PEFT adapters on all seven target modules give, through
pagedserve, the greedy tokens of PEFT's `PeftModel` with the adapter applied, and with it merged
into the weights. The requests of two adapters and of the base model run in the same steps
(prompts in 4-token blocks, prefilled in chunks of at most 16 tokens), so the equality also
shows each request gets what it gets alone: PEFT's reference runs one request at a time.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, LoRARequest, SamplingParams
from pagedserve.engine.lora.adapter import lora_slot_bytes
from tests.families import COMMON, build_family
from tests.helpers import hf_greedy
from tests.lora_adapters import ALL_TARGETS, random_peft_model

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 13, 30)


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _llm(path, **kwargs) -> LLM:
    options = dict(
        device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=64,
        max_num_batched_tokens=16, enable_lora=True, max_loras=2,
    )  # fmt: skip
    return LLM(str(path), **{**options, **kwargs})


def _greedy(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory, tiny_llama_dir, tiny_qwen2_dir):
    """(checkpoint folder, transformers model, vocabulary size) of the family asked for."""
    name = request.param
    if name == "gemma2":
        path = tmp_path_factory.mktemp("gemma2")
        return path, build_family(name, path), COMMON["vocab_size"]
    path = tiny_llama_dir if name == "llama" else tiny_qwen2_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, model.config.vocab_size


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"], indirect=True)
def test_mixed_adapters_and_base_equal_peft_applied_and_merged(family, tmp_path):
    path, hf, vocab = family
    # Two adapters unlike each other: ranks 8 and 16, alpha scaling and rsLoRA.
    peft_models = [
        random_peft_model(hf, r=8, alpha=16, target_modules=ALL_TARGETS, seed=1),
        random_peft_model(hf, r=16, alpha=8, target_modules=ALL_TARGETS, seed=2, use_rslora=True),
    ]
    loras = []
    for i, peft_model in enumerate(peft_models):
        peft_model.save_pretrained(tmp_path / f"adapter{i}")
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(tmp_path / f"adapter{i}")))
    prompts = _prompts(7, vocab)

    expected = {None: [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]}
    for lora, peft_model in zip(loras, peft_models, strict=True):
        applied = [hf_greedy(peft_model, p, NEW_TOKENS) for p in prompts]
        merged_model = copy.deepcopy(peft_model).merge_and_unload()
        assert [hf_greedy(merged_model, p, NEW_TOKENS) for p in prompts] == applied
        expected[lora.lora_int_id] = applied
    # The adapters change the answers, or the comparison would prove nothing.
    assert expected[1] != expected[None] and expected[2] != expected[None]

    # Prefill steps of 64 tokens and decode steps (9 tokens) multiply every token by every slot,
    # masked (engine/lora/layers.py; the grouped path is the batch-variant one).
    llm = _llm(path, max_num_batched_tokens=64)
    # Every prompt three times, interleaved: base, adapter 1, adapter 2 in the same steps.
    mixed = [(p, lora) for p in prompts for lora in (None, *loras)]
    got = _greedy(llm, [p for p, _ in mixed], [lora for _, lora in mixed])
    want = [
        expected[lora.lora_int_id if lora else None][i]
        for i in range(len(prompts))
        for lora in (None, *loras)
    ]
    assert got == want


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_more_adapters_than_slots_all_finish_with_their_own_tokens(family, tmp_path):
    path, hf, vocab = family
    loras, expected = [], {}
    prompt = _prompts(3, vocab)[1]
    for i in range(4):
        peft_model = random_peft_model(hf, r=8, alpha=16, target_modules=ALL_TARGETS, seed=10 + i)
        peft_model.save_pretrained(tmp_path / f"a{i}")
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
        expected[i + 1] = hf_greedy(peft_model, prompt, NEW_TOKENS)
    assert len({tuple(v) for v in expected.values()}) == 4
    # Two slots and two host copies for four adapters, two requests of each, all queued at once.
    llm = _llm(path, max_loras=2, max_cpu_loras=2)
    order = [0, 1, 2, 3, 3, 2, 1, 0]
    got = _greedy(llm, [prompt] * len(order), [loras[i] for i in order])
    assert got == [expected[i + 1] for i in order]
    lora = llm.engine.core.worker.lora
    stats = llm.engine.stats()
    # Each adapter went into a slot at least once; the scheduler never let a third adapter in
    # beside two running ones (LoRAManager raises if a step holds more than its slots).
    assert stats.lora_slot_loads == lora.num_slot_loads >= 4
    assert len(lora.host) == 2 and stats.max_loras == 2
    # What `pagedserve kv-plan` counts is what the worker allocated (fp32, rank 64, 2 slots).
    assert lora.num_bytes == lora_slot_bytes(llm.engine.core.model_config, 2, 64, 4)
    assert stats.running_loras == () and stats.waiting_loras == ()


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_the_prefix_cache_never_shares_blocks_between_adapters(family, tmp_path):
    path, hf, vocab = family
    peft_model = random_peft_model(hf, r=8, alpha=16, target_modules=ALL_TARGETS, seed=5)
    peft_model.save_pretrained(tmp_path / "a")
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    prompt = _prompts(11, vocab)[2]  # 30 tokens: 7 full blocks of 4
    llm = _llm(path)
    kv = llm.engine.core.scheduler.kv_cache_manager

    def hits_after(lora_request) -> tuple[int, list[int]]:
        before = kv.num_prefix_cache_hits_tokens
        tokens = _greedy(llm, [prompt], lora_request)[0]
        return kv.num_prefix_cache_hits_tokens - before, tokens

    base_hits, base_tokens = hits_after(None)
    lora_hits, lora_tokens = hits_after(lora)  # same tokens, other adapter: nothing to share
    again_hits, again_tokens = hits_after(lora)  # its own blocks: all 7 full ones hit
    assert (base_hits, lora_hits, again_hits) == (0, 0, 28)
    assert lora_tokens == again_tokens == hf_greedy(peft_model, prompt, NEW_TOKENS)
    assert base_tokens == hf_greedy(hf, prompt, NEW_TOKENS)


def test_adapters_are_refused_with_a_reason_before_anything_is_queued(tiny_llama_dir, tmp_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    random_peft_model(hf, r=32, alpha=16, target_modules=("q_proj",), seed=1).save_pretrained(
        tmp_path / "big"
    )
    big = LoRARequest("big", 1, str(tmp_path / "big"))
    plain = LLM(
        str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=64
    )
    with pytest.raises(ValueError, match="serves no LoRA adapters; start it with --enable-lora"):
        plain.generate([[5, 6, 7]], lora_request=big)
    llm = _llm(tiny_llama_dir, max_lora_rank=16)
    with pytest.raises(ValueError, match="rank 32 exceeds --max-lora-rank 16"):
        llm.generate([[5, 6, 7]], lora_request=big)
    missing = LoRARequest("gone", 2, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="gone"):
        llm.generate([[5, 6, 7]], lora_request=missing)
    assert not llm.engine.has_unfinished_requests()
