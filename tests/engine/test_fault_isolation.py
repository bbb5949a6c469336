"""A fault in one request fails that request alone: non-finite logits, an exception while
detokenizing, running out of memory in a large prefill. The others finish with the tokens they
get without the faulty one, and no block stays held.

The NaN comes from a real model: `nan_llama_dir`, the tiny Llama with a NaN embedding row. The
detokenizer's exception and the out-of-memory error cannot be caused for real on this machine, so
they are injected (monkeypatched) into one request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.frontend.detokenizer import IncrementalDetokenizer
from pagedserve.engine.worker.worker import is_out_of_memory
from tests.helpers import NAN_TOKEN as BAD_TOKEN
from tests.helpers import cpu_engine_config, finish_all

GOOD_PROMPTS = {"a": list(range(3, 13)), "b": list(range(40, 47))}
# BAD_TOKEN early in a 12-token prompt: with block_size 4 a prefix-cache hit would cover it.
BAD_PROMPT = [5, 6, BAD_TOKEN, 9, 10, 11, 12, 13, 14, 15, 16, 17]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model_dir: Path, **changes) -> LLMEngine:
    changes = {"num_kv_blocks": 32, "max_model_len": 128, **changes}
    return LLMEngine(cpu_engine_config(model_dir, **changes))


def _good(params: SamplingParams = GREEDY) -> dict:
    return {rid: (prompt, params) for rid, prompt in GOOD_PROMPTS.items()}


def _tokens(outputs: dict, request_ids) -> dict:
    return {rid: [c.token_ids for c in outputs[rid].outputs] for rid in request_ids}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> dict:
    """The good prompts' greedy tokens, run alone."""
    return _tokens(finish_all(_engine(tiny_llama_dir), _good()), GOOD_PROMPTS)


@pytest.mark.parametrize(
    "backend, bad_params",
    [
        ("torch", GREEDY),
        ("torch", SamplingParams(temperature=0.8, seed=3)),
        # Under the interpreter: about 20 s here, so with the slow cases (`make test-slow`).
        pytest.param("triton", GREEDY, marks=pytest.mark.slow),
    ],
)
def test_nan_logits_fail_their_request_alone(nan_llama_dir, reference, backend, bad_params):
    engine = _engine(nan_llama_dir, attention_backend=backend)
    # First, so that it holds block 0 (which shorter sequences' padding once read) in the step
    # that writes NaN into its blocks.
    out = finish_all(engine, {"bad": (BAD_PROMPT, bad_params), **_good()})
    (failed,) = out["bad"].outputs
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert out["bad"].error.startswith("the model produced non-finite logits")
    assert _tokens(out, GOOD_PROMPTS) == reference
    assert all(out[rid].error is None for rid in GOOD_PROMPTS)
    # The failed request's blocks were cleared: no NaN is left for their next owner...
    for k_cache, v_cache in engine.core.worker.runner.kv_caches:
        assert torch.isfinite(k_cache).all() and torch.isfinite(v_cache).all()
    # ...and left the prefix cache: the same prompt fails again rather than reading zeros.
    again = finish_all(
        engine, {"bad-again": (BAD_PROMPT, GREEDY), "a": (GOOD_PROMPTS["a"], GREEDY)}
    )
    assert again["bad-again"].outputs[0].finish_reason == "error"
    assert _tokens(again, ["a"]) == {"a": reference["a"]}


def test_an_exception_while_detokenizing_fails_its_request_alone(
    tiny_llama_dir, reference, monkeypatch
):
    engine = _engine(tiny_llama_dir)
    for rid, (prompt, params) in _good().items():
        engine.add_request(rid, prompt, params)
    # Sample 1 of a 2-sample request fails on its third token.
    engine.add_request("bad", [20, 21, 22], SamplingParams(temperature=0, n=2, max_tokens=12))
    detokenizer = engine.output_processor._samples["1:bad"].detokenizer
    calls = []

    def failing_add_tokens(token_ids):
        calls.append(token_ids)
        if len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return IncrementalDetokenizer.add_tokens(detokenizer, token_ids)

    monkeypatch.setattr(detokenizer, "add_tokens", failing_add_tokens)
    out = finish_all(engine, {})
    assert [(c.index, c.finish_reason) for c in out["bad"].outputs] == [(0, "abort"), (1, "error")]
    assert out["bad"].error == (
        "processing the output failed: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff "
        "in position 0: injected"
    )
    # Sample 1 forked sample 0's prompt after sample 0's first token, so sample 0 is one token
    # ahead: its fourth came in the step of sample 1's third, which failed.
    assert [len(c.token_ids) for c in out["bad"].outputs] == [4, 3]
    assert _tokens(out, GOOD_PROMPTS) == reference


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_running_out_of_memory_in_a_large_prefill_fails_that_request_alone(
    tiny_llama_dir, reference, monkeypatch, async_scheduling
):
    engine = _engine(tiny_llama_dir, async_scheduling=async_scheduling)
    runner = engine.core.worker.runner
    forward = runner._forward
    step_sizes = []

    def forward_with_a_memory_limit(inputs):
        step_sizes.append(inputs.input_ids.shape[0])
        if inputs.input_ids.shape[0] > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(inputs)

    monkeypatch.setattr(runner, "_forward", forward_with_a_memory_limit)
    for rid, (prompt, params) in _good().items():
        engine.add_request(rid, prompt, params)
    for _ in range(3):  # a and b are decoding when the large prompt arrives
        engine.step()
    engine.add_request("large", list(range(100, 150)), GREEDY)
    preemptions = engine.core.scheduler.num_preemptions
    out = finish_all(engine, {})
    (failed,) = out["large"].outputs
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert out["large"].error.startswith("the server ran out of memory computing 50 tokens")
    # The failed step held all 50 prompt tokens and one decode token each of a and b.
    assert 52 in step_sizes
    # a and b were preempted out of that step and recomputed, to the same tokens.
    assert engine.core.scheduler.num_preemptions == preemptions + 2
    assert _tokens(out, GOOD_PROMPTS) == reference


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    try:
        torch.empty(2**62, dtype=torch.uint8)  # the CPU allocator refuses this
    except RuntimeError as e:
        assert is_out_of_memory(e)
    else:
        pytest.fail("allocating 4 EiB succeeded")
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))
