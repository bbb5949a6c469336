"""Tensor parallelism (engine/models/parallel.py, engine/worker/tp_worker.py) on CPU over gloo: how
each model splits, and greedy tokens of N ranks equal to one rank's, for even, uneven and replicated
KV heads, the families whose weights are stored fused (Phi-3) or carry extra norms (Gemma 3), and
the real SmolLM2 (3 KV heads on 2 ranks). Rank 0 is this test's process; the other ranks are
real worker processes it starts."""

from __future__ import annotations

import random
import re

import pytest
import torch

from pagedserve.engine import LLM, LoRARequest, SamplingParams
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.messages import CoreRequest
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.parallel import TPShard, plan_shards
from pagedserve.engine.tp_endpoint import TPEndpoint, free_port
from pagedserve.scheduler import StructuredOutputs
from tests.families import COMMON, build_family
from tests.helpers import tiny_config
from tests.lora_adapters import ALL_TARGETS, random_peft_model


def _plan(size: int, **changes) -> list[tuple]:
    return [
        (s.q_heads, s.kv_heads, s.intermediate, s.vocab, s.vocab_rows)
        for s in plan_shards(tiny_config(**changes), size)
    ]


def test_shards_split_heads_width_and_vocabulary():
    # Even: 8 heads, 4 KV heads on 2 ranks.
    assert _plan(
        2, num_attention_heads=8, num_key_value_heads=4, intermediate_size=192, vocab_size=512
    ) == [
        ((0, 4), (0, 2), (0, 96), (0, 256), 256),
        ((4, 8), (2, 4), (96, 192), (256, 512), 256),
    ]
    # Uneven (SmolLM2's heads): 3 KV heads go 2 + 1, each with its 3 query heads; an odd width
    # and vocabulary split with the larger part first, the vocabulary padded to equal rows.
    assert _plan(
        2, num_attention_heads=9, num_key_value_heads=3, intermediate_size=7, vocab_size=11
    ) == [
        ((0, 6), (0, 2), (0, 4), (0, 6), 6),
        ((6, 9), (2, 3), (4, 7), (6, 11), 6),
    ]
    # Fewer KV heads than ranks: each is replicated on the ranks sharing its query heads.
    assert _plan(
        4, num_attention_heads=9, num_key_value_heads=3, intermediate_size=8, vocab_size=8
    ) == [
        ((0, 2), (0, 1), (0, 2), (0, 2), 2),
        ((2, 3), (0, 1), (2, 4), (2, 4), 2),
        ((3, 6), (1, 2), (4, 6), (4, 6), 2),
        ((6, 9), (2, 3), (6, 8), (6, 8), 2),
    ]


def test_plans_the_model_cannot_take_are_refused():
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads: each rank needs"):
        plan_shards(tiny_config(num_attention_heads=4, num_key_value_heads=2), 5)
    moe = tiny_config("mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="does not split mixtures of experts yet"):
        plan_shards(moe, 2)


def _full_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(shape) for name, shape in config.weight_shapes().items()}


def _assemble(shards: list[TPShard], pieces: list[dict], name: str, dim: int, kind: str):
    """Put rank pieces back together, keeping each KV head once (replicated ones repeat)."""
    if kind != "kv":
        return torch.cat([p[name] for p in pieces], dim=dim)
    seen, parts = set(), []
    for shard, piece in zip(shards, pieces, strict=True):
        if shard.kv_heads not in seen:
            seen.add(shard.kv_heads)
            parts.append(piece[name])
    return torch.cat(parts, dim=dim)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
@pytest.mark.parametrize("heads", [(9, 3, 2), (4, 1, 2), (8, 4, 4)])
def test_weight_slices_put_back_together_give_the_checkpoint(arch, heads):
    nh, nkv, size = heads
    config = tiny_config(
        arch,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=4,
        hidden_size=16,
        intermediate_size=10,
        vocab_size=13,
        tie_word_embeddings=False,
        attention_bias=arch == "llama",
    )
    full = _full_weights(config)
    shards = plan_shards(config, size)
    pieces = [dict(s.slice_weights(full.items(), config)) for s in shards]
    local = [s.local_config(config).weight_shapes() for s in shards]
    for shard, piece, shapes in zip(shards, pieces, local, strict=True):
        for name, tensor in piece.items():
            vocab_rows = name in ("model.embed_tokens.weight", "lm_head.weight")
            want = (shard.vocab_rows, config.hidden_size) if vocab_rows else shapes[name]
            assert tuple(tensor.shape) == want, name
        # The padding rows of the vocabulary are zeros.
        real = shard.vocab[1] - shard.vocab[0]
        assert not piece["lm_head.weight"][real:].any()
    p = "model.layers.1."
    if arch == "phi3":
        qkv = [p["model.layers.1.self_attn.qkv_proj.weight"] for p in pieces]
        q_out, kv_out = nh * 4, nkv * 4
        q = torch.cat([t[: s.num_q_heads * 4] for t, s in zip(qkv, shards, strict=True)])
        torch.testing.assert_close(q, full[p + "self_attn.qkv_proj.weight"][:q_out], rtol=0, atol=0)
        gate_up = [p[p_ + "mlp.gate_up_proj.weight"] for p_ in [p] for p in pieces]
        width = [s.intermediate[1] - s.intermediate[0] for s in shards]
        gate = torch.cat([t[:w] for t, w in zip(gate_up, width, strict=True)])
        up = torch.cat([t[w:] for t, w in zip(gate_up, width, strict=True)])
        torch.testing.assert_close(
            torch.cat((gate, up)), full[p + "mlp.gate_up_proj.weight"], rtol=0, atol=0
        )
        assert q_out + 2 * kv_out == full[p + "self_attn.qkv_proj.weight"].shape[0]
    else:
        for name, dim, kind in (
            ("self_attn.q_proj.weight", 0, "q"),
            ("self_attn.q_proj.bias", 0, "q"),
            ("self_attn.k_proj.weight", 0, "kv"),
            ("self_attn.v_proj.bias", 0, "kv"),
            ("self_attn.o_proj.weight", 1, "q"),
            ("mlp.gate_proj.weight", 0, "mlp"),
            ("mlp.up_proj.weight", 0, "mlp"),
            ("mlp.down_proj.weight", 1, "mlp"),
        ):
            whole = _assemble(shards, pieces, p + name, dim, kind)
            torch.testing.assert_close(whole, full[p + name], rtol=0, atol=0)
    vocab = torch.cat([pc["lm_head.weight"][: s.vocab[1] - s.vocab[0]] for s, pc in zip(
        shards, pieces, strict=True)])  # fmt: skip
    torch.testing.assert_close(vocab, full["lm_head.weight"], rtol=0, atol=0)
    # Norms are replicated whole.
    for piece in pieces:
        assert piece[p + "input_layernorm.weight"] is full[p + "input_layernorm.weight"]


PROMPT_LENGTHS = [1, 3, 7, 12, 17, 25, 31, 40]


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _generate(path, params, size: int, prompts, **kwargs) -> tuple[list, LLM]:
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=kwargs.pop("num_kv_blocks", 512),
        tensor_parallel_size=size,
        **kwargs,
    )
    return llm.generate(prompts, params), llm


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _build(family: str, path, changes: dict) -> None:
    if family != "llama":
        build_family(family, path, **changes)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = {**COMMON, "initializer_range": 0.1, **changes}
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path)


# name -> (family, config changes, tensor-parallel size): even (4 KV heads on 2), 3 ranks over
# 2 KV heads (replicated, one rank with a share of a head's query heads; a vocabulary of 256 in
# rows of 86), Phi-3's fused q/k/v and gate/up, Gemma 3's q/k norms, sliding windows and
# soft-capped logits. (Qwen2's one KV head with biases: the test after.)
MODELS = {
    "llama-4-kv-heads": ("llama", dict(num_attention_heads=8, num_key_value_heads=4), 2),
    "llama-3-ranks": (
        "llama",
        dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96),
        3,
    ),
    "phi3": ("phi3", {}, 2),
    "gemma3": ("gemma3", {}, 2),
}


def _equal_to_one_rank(path, size: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(256)
    want, _ = _generate(path, params, 1, prompts)
    # A token budget under the longest prompt: prefill runs in chunks on every rank.
    got, llm = _generate(path, params, size, prompts, max_num_batched_tokens=24)
    assert _tokens(got) == _tokens(want)
    assert llm.engine.core.scheduler.kv_cache_manager.num_used_blocks == 0
    workers = llm.engine.core.worker._workers
    llm.engine.close()
    assert [p.returncode for p in workers.processes] == [0] * (size - 1)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_of_n_ranks_equal_one_rank(name, tmp_path):
    family, changes, size = MODELS[name]
    _build(family, tmp_path, changes)
    _equal_to_one_rank(tmp_path, size)


def test_one_kv_head_replicated_with_biases_and_tied_embeddings(tiny_qwen2_dir):
    _equal_to_one_rank(tiny_qwen2_dir, 2)


def test_sampling_logprobs_preemption_and_drafts_across_two_ranks(tiny_llama_dir):
    """What rank 0 alone does (sampling, logprobs) and what needs the ranks to agree on each
    step (a pool so small that requests are preempted and recomputed, n-gram drafts verified)
    give one rank's results."""
    prompts = _prompts(512)
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, n=2, seed=7, max_tokens=12, logprobs=2, prompt_logprobs=1
    )
    want, _ = _generate(tiny_llama_dir, seeded, 1, prompts)
    got, llm = _generate(tiny_llama_dir, seeded, 2, prompts)
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got, want, strict=True):
        for gp, wp in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert gp.keys() == wp.keys()
            for token in gp:
                assert gp[token].logprob == pytest.approx(wp[token].logprob, abs=1e-4)
    llm.engine.close()

    # 24 blocks of 4 tokens: 8 requests of up to 40 + 24 tokens cannot all stay.
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _generate(tiny_llama_dir, greedy, 1, prompts, num_kv_blocks=128, max_model_len=64)
    got, llm = _generate(tiny_llama_dir, greedy, 2, prompts, num_kv_blocks=24, max_model_len=64)
    assert _tokens(got) == _tokens(want)
    assert llm.engine.core.scheduler.num_preemptions > 0
    llm.engine.close()

    repeating = [[5, 6, 7, 8] * 6 + p for p in prompts[:4]]
    want, _ = _generate(tiny_llama_dir, greedy, 1, repeating)
    got, llm = _generate(tiny_llama_dir, greedy, 2, repeating, speculative_ngram=3)
    assert _tokens(got) == _tokens(want)
    assert llm.engine.core.scheduler.num_draft_tokens > 0
    llm.engine.close()


def test_lora_adapters_split_over_three_ranks_equal_one_rank(tmp_path):
    """Each rank keeps its slice of every adapter (TPShard.slice_lora): B's rows of the
    column-parallel projections, A's columns of the row-parallel ones, on the split with
    replicated KV heads (3 ranks over 2). Requests of two adapters and of the base model mixed
    in the same steps give one rank's tokens (PEFT's, tests/engine/test_lora_engine.py)."""
    from transformers import AutoModelForCausalLM

    family, changes, size = MODELS["llama-3-ranks"]
    _build(family, tmp_path / "model", changes)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    loras = []
    for i, (r, alpha, rslora) in enumerate(((8, 16, False), (16, 8, True))):
        adapter = random_peft_model(hf, r, alpha, ALL_TARGETS, seed=i + 1, use_rslora=rslora)
        adapter.save_pretrained(tmp_path / f"adapter{i}")
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(tmp_path / f"adapter{i}")))
    mixed = [(p, lora) for p in _prompts(256) for lora in (None, *loras)]
    prompts, requests = [p for p, _ in mixed], [lora for _, lora in mixed]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for ranks in (1, size):
        llm = LLM(
            str(tmp_path / "model"), device="cpu", dtype="float32", block_size=4,
            num_kv_blocks=512, tensor_parallel_size=ranks, enable_lora=True, max_loras=2,
            max_num_batched_tokens=64,
        )  # fmt: skip
        tokens.append(_tokens(llm.generate(prompts, params, lora_request=requests)))
        llm.engine.close()
    assert tokens[1] == tokens[0]
    base, first, second = (tokens[0][i::3] for i in range(3))
    assert first != base and second != base and first != second


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "List three colors:",
    "The meaning of life is",
    "import numpy as np\n",
    "Water boils at",
    "My favourite book is",
]


# Slow: tests/server/test_tensor_parallel.py serves SmolLM2 on two ranks in every run (the same
# uneven split, greedy and constrained answers equal to one rank's).
@pytest.mark.slow
def test_smollm2_on_two_ranks_splits_its_3_kv_heads_unevenly_and_equals_one_rank(caplog):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory=1 << 28, max_model_len=2048)
    reference = LLM(**options)
    want = reference.generate(SMOLLM2_PROMPTS, params)
    with caplog.at_level("INFO", logger="pagedserve"):
        llm = LLM(**options, tensor_parallel_size=2)
    assert (
        "tensor parallel over 2 ranks, query/KV heads per rank 6/2, 3/1 (3 KV heads do not "
        "divide by 2: uneven split)" in caplog.text
    )
    got = llm.generate(SMOLLM2_PROMPTS, params)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    # Grammars are rank 0's alone (its sampler masks the logits); the other ranks take its ids.
    pattern = r"[a-f]{2,4}-[0-9]{3}"
    regex = SamplingParams(
        temperature=0, max_tokens=24, structured_outputs=StructuredOutputs(regex=pattern)
    )
    constrained = llm.generate(SMOLLM2_PROMPTS[:2], regex)
    assert [o.outputs[0].text for o in constrained] == [
        o.outputs[0].text for o in reference.generate(SMOLLM2_PROMPTS[:2], regex)
    ]
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in constrained)
    llm.engine.close()


def _core_tokens(core, prompts, params) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        core.add_samples([CoreRequest(f"r{i}", prompt, params, 0.0)])
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for out in core.step_samples():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_one_rank_through_the_distributed_path_equals_the_plain_engine(tiny_llama_dir):
    """What the H200 check measures at one rank (benchmarks/gpu_engine.sh ONLY=tp): the same engine
    with its collectives, the logits' gather and the ids' broadcast over a group of one."""
    config = EngineConfig(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(512)
    want = _core_tokens(EngineCore(config), prompts, params)
    core = EngineCore(config, TPEndpoint(0, 1, "127.0.0.1", free_port(), 0))
    assert core.worker.tp is not None and core.worker.tp.size == 1
    assert _core_tokens(core, prompts, params) == want
