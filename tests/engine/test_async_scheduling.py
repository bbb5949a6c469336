"""Asynchronous scheduling gives exactly the tokens of the synchronous loop.

With `async_scheduling`, step N + 1 is scheduled and launched before step N's tokens are back:
its placeholder tokens are filled in from step N's sampled ids on the device, and stop rules,
stop strings and aborts apply one step later. A random workload on a tiny Llama (greedy,
seeded sampling, penalties, logprobs, stop strings and stop ids, n > 1, prefix sharing, a KV
pool small enough to preempt, chunked prefill, aborts) runs both ways and must agree exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from pagedserve.engine.frontend.outputs import RequestOutput


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    abort_step: int | None  # the engine step before which the client goes away


def random_workload(seed: int, num_requests: int = 40) -> list[Arrival]:
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 12))] for _ in range(3)]
    arrivals = []
    for i in range(num_requests):
        prompt = (rng.choice(shared) if rng.random() < 0.5 else []) + [
            rng.randrange(3, 500) for _ in range(rng.randrange(1, 14))
        ]
        kind = rng.randrange(6)
        common = {"max_tokens": rng.randrange(1, 40), "ignore_eos": rng.random() < 0.5}
        if kind == 0:
            params = SamplingParams(temperature=0, **common)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=rng.randrange(1000), **common)
        elif kind == 2:  # penalties read the token history on the host
            params = SamplingParams(
                temperature=0.7,
                seed=rng.randrange(1000),
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                **common,
            )
        elif kind == 3:
            params = SamplingParams(temperature=0, logprobs=2, stop=["<0x", "<359>"], **common)
        elif kind == 4:
            params = SamplingParams(temperature=0, stop_token_ids=[359, 313], **common)
        else:
            params = SamplingParams(temperature=1.0, n=2, seed=rng.randrange(1000), **common)
        step = rng.randrange(0, 20)
        abort_step = step + rng.randrange(1, 12) if rng.random() < 0.15 else None
        arrivals.append(Arrival(step, f"r{i}", prompt, params, abort_step))
    return arrivals


def run(tiny_llama_dir, arrivals: list[Arrival], async_scheduling: bool):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_kv_blocks=20,  # 80 slots for up to 8 sequences of up to 64: preemptions
            max_model_len=64,
            max_num_seqs=8,
            max_num_batched_tokens=24,  # long prompts are prefilled in chunks
            async_scheduling=async_scheduling,
        )
    )
    finals: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    step = 0
    while step < 1000:
        for a in arrivals:
            if a.step == step:
                engine.add_request(a.request_id, a.prompt, a.params)
            if a.abort_step == step and (output := engine.abort(a.request_id)) is not None:
                finals[a.request_id] = output
                aborted.add(a.request_id)
        if step > max(a.step for a in arrivals) and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        step += 1
    assert not engine.has_unfinished_requests()
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0
    max_num_seqs = engine.core.config.scheduler.max_num_seqs
    assert engine.core.worker.runner.input_batch.num_reqs <= max_num_seqs
    return finals, aborted, engine


def summary(output: RequestOutput) -> list[tuple]:
    """Everything exact but logprob values: a batch of another shape rounds the float32 matmuls
    differently in the last bits (ids and ranks must still agree)."""
    return [
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            None
            if c.logprobs is None
            else [
                {
                    t: (lp.rank, lp.decoded_token, pytest.approx(lp.logprob, abs=1e-4))
                    for t, lp in e.items()
                }
                for e in c.logprobs
            ],
            None if c.cumulative_logprob is None else pytest.approx(c.cumulative_logprob, abs=1e-3),
        )
        for c in output.outputs
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_async_scheduling_gives_the_same_outputs(tiny_llama_dir, seed):
    arrivals = random_workload(seed)
    sync_finals, sync_aborted, sync_engine = run(tiny_llama_dir, arrivals, False)
    async_finals, async_aborted, async_engine = run(tiny_llama_dir, arrivals, True)
    assert (
        not sync_engine.core.worker.async_scheduling and async_engine.core.worker.async_scheduling
    )
    # The run exercised what it is meant to: preemption, prefix hits, aborts, stop strings.
    for engine in (sync_engine, async_engine):
        assert engine.core.scheduler.num_preemptions > 0
        assert engine.core.scheduler.kv_cache_manager.num_prefix_cache_hits_tokens > 0
    assert sync_aborted and sync_aborted == async_aborted
    stopped_by_string = [
        rid
        for rid, out in sync_finals.items()
        if any(isinstance(c.stop_reason, str) for c in out.outputs)
    ]
    assert stopped_by_string

    finished = {a.request_id for a in arrivals} - sync_aborted
    assert set(sync_finals) == set(async_finals) == {a.request_id for a in arrivals}
    for request_id in sorted(finished):
        assert summary(async_finals[request_id]) == summary(sync_finals[request_id]), request_id
    # An aborted request stops at a different step in each loop, on the same tokens.
    for request_id in sync_aborted:
        for s, a in zip(
            sync_finals[request_id].outputs, async_finals[request_id].outputs, strict=True
        ):
            shorter, longer = sorted((s.token_ids, a.token_ids), key=len)
            assert longer[: len(shorter)] == shorter
            assert "abort" in (s.finish_reason, a.finish_reason) or s.finish_reason == (
                a.finish_reason
            )
