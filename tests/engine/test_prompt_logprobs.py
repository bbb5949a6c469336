"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny random Llama equal the log-softmax of
transformers' logits for the same prompt: prefilled in one step or in chunks, behind a warm prefix
cache, with n = 2, with k = 0 and through preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams

PROMPT_LEN = 23
ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> tuple[list[int], torch.Tensor]:
    """A prompt and transformers' log-softmax rows for it: row i predicts prompt token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    rng = random.Random(99)
    prompt = [rng.randrange(3, hf.config.vocab_size) for _ in range(PROMPT_LEN)]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
    return prompt, torch.log_softmax(logits.float(), dim=-1)


def _engine(path, **kwargs) -> LLMEngine:
    """Float32 on CPU with 4-token blocks, so the prompt spans several (cacheable) blocks."""
    settings = dict(block_size=4, num_kv_blocks=64, max_model_len=128) | kwargs
    return LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", **settings))


def _run(engine: LLMEngine) -> tuple[dict[str, RequestOutput], list[RequestOutput]]:
    """Step to the end: (final output per request, every snapshot in order)."""
    finished: dict[str, RequestOutput] = {}
    snapshots: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            snapshots.append(out)
            if out.finished:
                finished[out.request_id] = out
    return finished, snapshots


def _params(k: int | None, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k, **kwargs)


def _synthetic_token_string(token_id: int) -> str:
    """The tiny checkpoint has no tokenizer files, so the engine uses the synthetic tokenizer:
    bos 1 and eos 2 are special, ids 0 and 3..257 the byte tokens, every other id is "<id>"."""
    if token_id in (1, 2):
        return "<|bos|>" if token_id == 1 else "<|eos|>"
    if token_id <= 257:
        return f"<0x{max(token_id - 2, 0):02X}>"
    return f"<{token_id}>"


def assert_prompt_logprobs(
    prompt_logprobs: list | None, prompt: list[int], ref: torch.Tensor, k: int
) -> None:
    """Entry 0 is None; entry i holds prompt[i] and the top k of ref[i - 1], with the logprobs
    and ranks of the reference (ranks checked against the reference's sorted values, so a
    near-tie within ATOL cannot make the test flaky)."""
    assert prompt_logprobs is not None
    assert len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[i], ref[i - 1], prompt[i]
        sorted_row = row.sort(descending=True).values
        assert token in entry
        for token_id, lp in entry.items():
            assert lp.decoded_token == _synthetic_token_string(token_id)
            assert lp.logprob == pytest.approx(row[token_id].item(), abs=ATOL)
            assert lp.logprob == pytest.approx(sorted_row[lp.rank - 1].item(), abs=ATOL)
        others = {token_id: lp.rank for token_id, lp in entry.items() if token_id != token}
        expected_ids = set(row.topk(k).indices.tolist()) - {token}
        assert set(others) == expected_ids
        assert set(others.values()) == set(range(1, k + 1)) - {entry[token].rank}


def test_prompt_logprobs_equal_transformers(tiny_llama_dir, reference):
    prompt, ref = reference
    engine = _engine(tiny_llama_dir)
    engine.add_request("scored", prompt, _params(3, logprobs=2))
    engine.add_request("plain", prompt[:9], _params(None))
    finished, snapshots = _run(engine)
    out = finished["scored"]
    assert_prompt_logprobs(out.prompt_logprobs, prompt, ref, k=3)
    assert finished["plain"].prompt_logprobs is None
    # Complete in every snapshot, the first one included (one list, final once complete).
    scored = [s for s in snapshots if s.request_id == "scored"]
    assert len(scored) == 3
    assert all(s.prompt_logprobs is out.prompt_logprobs for s in scored)
    # The first sampled token is scored by the same distribution as the last prompt row would
    # give it: the prompt rows and the sampled row come from one forward pass.
    first = out.outputs[0].token_ids[0]
    assert out.outputs[0].logprobs[0][first].logprob == pytest.approx(
        ref[-1][first].item(), abs=ATOL
    )


def test_chunked_prefill_scores_every_chunk(tiny_llama_dir, reference):
    prompt, ref = reference
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=6)
    engine.add_request("scored", prompt, _params(2))
    num_prefill_steps = 0
    while not engine.step():
        num_prefill_steps += 1
    assert num_prefill_steps == 3  # chunks of 6, 6, 6 tokens, then 5 with the first sample
    finished, _ = _run(engine)
    assert_prompt_logprobs(finished["scored"].prompt_logprobs, prompt, ref, k=2)
    # Aborted after one chunk: the snapshot carries no partial list.
    engine.add_request("aborted", prompt, _params(2))
    assert engine.step() == []
    assert engine.abort("aborted").prompt_logprobs is None


def test_prompt_logprobs_request_bypasses_the_prefix_cache(tiny_llama_dir, reference):
    prompt, ref = reference
    engine = _engine(tiny_llama_dir)
    kv = engine.core.scheduler.kv_cache_manager
    engine.add_request("warm", prompt, _params(None))
    _run(engine)
    assert kv.num_prefix_cache_hits_tokens == 0
    engine.add_request("scored", prompt, _params(4))
    finished, _ = _run(engine)
    assert kv.num_prefix_cache_hits_tokens == 0  # recomputed, though 5 blocks were cached
    assert_prompt_logprobs(finished["scored"].prompt_logprobs, prompt, ref, k=4)
    engine.add_request("plain", prompt, _params(None))
    finished, _ = _run(engine)
    assert finished["plain"].prompt_logprobs is None
    assert kv.num_prefix_cache_hits_tokens == 20  # floor(22 / 4) = 5 blocks of 4


def test_n_samples_score_the_prompt_once(tiny_llama_dir, reference):
    prompt, ref = reference
    engine = _engine(tiny_llama_dir)
    engine.add_request("pair", prompt, _params(1, n=2))
    finished, _ = _run(engine)
    out = finished["pair"]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    assert_prompt_logprobs(out.prompt_logprobs, prompt, ref, k=1)
    # Sample 0 scores the prompt; sample 1 forks its 6 blocks of the first 22 tokens (no
    # prefix-cache lookup) and copies the partial sixth before writing the 23rd token into it.
    kv = engine.core.scheduler.kv_cache_manager
    assert len(prompt) == 23
    assert (kv.num_prefix_cache_hits_tokens, kv.num_block_copies) == (0, 1)


def test_k_zero_gives_only_the_prompt_token(tiny_llama_dir, reference):
    prompt, ref = reference
    engine = _engine(tiny_llama_dir)
    engine.add_request("zero", prompt, _params(0))
    engine.add_request("one", prompt[:1], _params(0))
    finished, _ = _run(engine)
    scored = finished["zero"].prompt_logprobs
    assert_prompt_logprobs(scored, prompt, ref, k=0)
    assert [list(entry) for entry in scored[1:]] == [[t] for t in prompt[1:]]
    assert finished["one"].prompt_logprobs == [None]


def test_preemption_keeps_the_first_scores(tiny_llama_dir, reference):
    """A pool too small for all requests: scored requests are preempted, some mid-prefill, and
    recomputed; every prompt position is recorded once and the lists still match."""
    prompt, ref = reference
    engine = _engine(
        tiny_llama_dir,
        num_kv_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    for name in "abc":
        engine.add_request(name, prompt, params)
    finished, _ = _run(engine)
    assert engine.core.scheduler.num_preemptions > 0
    for name in "abc":
        assert_prompt_logprobs(finished[name].prompt_logprobs, prompt, ref, k=1)
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0
