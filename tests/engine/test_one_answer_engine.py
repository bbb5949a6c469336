"""One request, one answer through the engine's other roads (the server's cases are
tests/server/test_one_answer.py's): the real SmolLM2 GGUF with the defaults a user gets (weights
kept quantized, `dtype="auto"`), each request's greedy tokens and logprobs the same, bit for bit,
when it is preempted and computed again, swapped out and back, drafted by n-gram speculation,
or served beside requests of a LoRA adapter and of the base model (two tensor-parallel ranks:
tests/server/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.scheduler.lora_request import LoRARequest
from tests.lora_adapters import ALL_TARGETS, save_random_peft_adapter

PROMPTS = [
    "Once upon a time", "The quick brown fox", "In 1492, Columbus", "def fibonacci(n):",
    "The best way to learn a language is", "Water boils at", "My favourite food is",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
]  # fmt: skip
TOKENS = 24
# Room for the 8 requests at once (the default pool, 4 GiB, would hold each engine's memory until
# the garbage collector frees it).
SMALL_POOL = 64
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=3)


def _answers(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.fixture(scope="module")
def alone() -> list[tuple]:
    """Each prompt served alone by an engine with the defaults."""
    llm = LLM("smollm2-135m-instruct", max_model_len=64, num_kv_blocks=SMALL_POOL)
    return [_answers(llm.generate([p], GREEDY))[0] for p in PROMPTS]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_answer_as_they_do_alone(alone, mode):
    """A KV pool of 12 blocks of 16 tokens for 8 requests that grow to 28-42 tokens each:
    requests are preempted and resumed again and again."""
    llm = LLM(
        "smollm2-135m-instruct", max_model_len=64, num_kv_blocks=12, preemption_mode=mode,
        swap_space=64 << 20,
    )  # fmt: skip
    assert _answers(llm.generate(PROMPTS, GREEDY)) == alone
    scheduler = llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swap_outs > 0) == (mode == "swap")


def test_speculative_drafts_change_nothing(alone):
    """Greedy requests without logprobs are the ones n-gram speculation drafts for."""
    llm = LLM(
        "smollm2-135m-instruct", max_model_len=64, num_kv_blocks=SMALL_POOL, speculative_ngram=4
    )
    plain = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    assert got == [tokens for tokens, _ in alone]
    assert llm.engine.core.scheduler.num_accepted_tokens > 0


def test_an_adapters_request_answers_the_same_alone_and_mixed(hf_smollm2, tmp_path):
    hf, _ = hf_smollm2
    paths = [
        save_random_peft_adapter(
            hf, tmp_path / f"a{i}", r=8, alpha=16, target_modules=ALL_TARGETS, seed=i
        )  # fmt: skip
        for i in (1, 2)
    ]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    llm = LLM(
        "smollm2-135m-instruct", max_model_len=64, num_kv_blocks=SMALL_POOL, enable_lora=True,
        max_loras=2,
    )  # fmt: skip
    (with_adapter,) = _answers(llm.generate([PROMPTS[0]], GREEDY, lora_request=loras[0]))
    (base,) = _answers(llm.generate([PROMPTS[0]], GREEDY))
    assert with_adapter[0] != base[0]  # or the comparison would prove nothing
    mixed = llm.generate(
        PROMPTS, GREEDY, lora_request=[loras[0], None, loras[1], loras[0], None, loras[1], None,
                                       loras[0]],
    )  # fmt: skip
    answers = _answers(mixed)
    assert answers[0] == with_adapter and answers[3][0] != answers[0][0]
    assert answers[1] == _answers(llm.generate([PROMPTS[1]], GREEDY))[0]
    assert answers[2] == _answers(llm.generate([PROMPTS[2]], GREEDY, lora_request=loras[1]))[0]
