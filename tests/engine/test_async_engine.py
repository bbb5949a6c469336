"""AsyncEngine: the engine thread, per-request streams, aborts, queue limit, failure handling —
on the tiny random Llama (real weights written by transformers, real engine, real thread)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.frontend.async_engine import AsyncEngine
from pagedserve.engine.frontend.client import EngineDeadError, QueueFullError
from tests.helpers import cpu_engine_config, finish_all, stream_with_rewind

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9][: 1 + i % 4] + list(range(40, 40 + i)) for i in range(8)]


def _engine(tiny_llama_dir, **kwargs) -> LLMEngine:
    return LLMEngine(cpu_engine_config(tiny_llama_dir, **kwargs))


def _sync_tokens(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    return _sync_tokens_of(engine, PROMPTS, params)


def _sync_tokens_of(engine: LLMEngine, prompts, params: SamplingParams) -> list[list[int]]:
    finished = finish_all(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _run(async_engine: AsyncEngine, main):
    """Run `main()` on an event loop against the started engine; always stop the engine."""
    try:
        return asyncio.run(main())
    finally:
        async_engine.shutdown()


async def _wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.002)


def test_concurrent_requests_equal_the_synchronous_engine(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _sync_tokens(_engine(tiny_llama_dir), params)
    async_engine = AsyncEngine(_engine(tiny_llama_dir))
    async_engine.start()

    async def consume(i: int) -> tuple[list[int], list[int]]:
        lengths = []
        async for out in async_engine.add_request(f"r{i}", PROMPTS[i], params):
            lengths.append(len(out.outputs[0].token_ids))
            last = out
        assert last.finished and last.outputs[0].finish_reason == "length"
        return last.outputs[0].token_ids, lengths

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))

    results = _run(async_engine, main)
    for (tokens, lengths), want in zip(results, expected, strict=True):
        assert tokens == want
        assert lengths == sorted(lengths) and lengths[-1] == 24  # snapshots only grow
    stats = async_engine.stats
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.kv_blocks_total == 512


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(tiny_llama_dir):
    async_engine = AsyncEngine(_engine(tiny_llama_dir))
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        async for out in async_engine.add_request("long", PROMPTS[7], params):
            if len(out.outputs[0].token_ids) >= 3:
                assert async_engine.stats.kv_blocks_used > 0
                break
        await _wait_until(lambda: async_engine.stats.kv_blocks_used == 0, timeout=1.0)
        # The id is free again once the abort went through.
        await _wait_until(lambda: "long" not in async_engine._ids_in_use, timeout=1.0)
        outs = [
            o
            async for o in async_engine.add_request("long", PROMPTS[0], params.clone(max_tokens=2))
        ]
        return outs[-1]

    out = _run(async_engine, main)
    assert out.finished and len(out.outputs[0].token_ids) == 2
    assert async_engine.engine.num_unfinished_requests == 0


def test_bad_requests_raise_before_anything_is_queued(tiny_llama_dir):
    async_engine = AsyncEngine(_engine(tiny_llama_dir))
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async_engine.add_request("a", [1, 99999], params)
        with pytest.raises(ValueError, match="max_model_len is 512"):
            async_engine.add_request("a", [1] * 600, params)
        with pytest.raises(ValueError, match="SamplingParams"):
            async_engine.add_request("a", [1, 2], {"temperature": 0})
        stream = async_engine.add_request("dup", [1, 2, 3], params)
        with pytest.raises(ValueError, match="already in use"):
            async_engine.add_request("dup", [1, 2, 3], params)
        outs = [out async for out in stream]
        return outs[-1]

    last = _run(async_engine, main)
    assert last.finished and len(last.outputs[0].token_ids) == 50
    assert async_engine.engine.num_unfinished_requests == 0


def test_full_waiting_queue_refuses_new_requests(tiny_llama_dir):
    async_engine = AsyncEngine(_engine(tiny_llama_dir, max_num_seqs=1), max_queue_len=1)
    async_engine.start()
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2)

    async def main():
        running = async_engine.add_request("running", PROMPTS[1], long)
        it = running.__aiter__()
        await it.__anext__()  # admitted: it holds the only batch slot
        waiting = async_engine.add_request("waiting", PROMPTS[2], short)
        await _wait_until(lambda: async_engine.stats.num_waiting == 1)
        with pytest.raises(QueueFullError, match="1 requests are waiting"):
            async_engine.add_request("refused", PROMPTS[3], short)
        await it.aclose()  # abort the long one; the waiting one runs
        outs = [out async for out in waiting]
        return outs[-1]

    last = _run(async_engine, main)
    assert last.finished and len(last.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="max_queue_len"):
        AsyncEngine(async_engine.engine, max_queue_len=0)


def test_an_engine_failure_fails_every_request_and_marks_the_engine_dead(tiny_llama_dir):
    """Fault injection: step() is replaced by one that raises, as a CUDA error or a bug would."""
    engine = _engine(tiny_llama_dir)
    async_engine = AsyncEngine(engine)

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=5)

    async def main():
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            async for _ in async_engine.add_request("x", [1, 2, 3], params):
                pass
        await _wait_until(lambda: not async_engine.is_running)
        with pytest.raises(EngineDeadError, match="restart the server"):
            async_engine.add_request("y", [1, 2, 3], params)

    _run(async_engine, main)
    assert isinstance(async_engine.error, RuntimeError)


def test_shutdown_ends_streams_in_flight(tiny_llama_dir):
    async_engine = AsyncEngine(_engine(tiny_llama_dir))
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def main():
        stream = async_engine.add_request("x", PROMPTS[4], params)
        it = stream.__aiter__()
        await it.__anext__()
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            while True:
                await it.__anext__()

    asyncio.run(main())
    assert not async_engine.is_running


def test_rewind_is_applied_between_steps(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (expected,) = _sync_tokens_of(_engine(tiny_llama_dir), [PROMPTS[3]], params)
    async_engine = AsyncEngine(_engine(tiny_llama_dir))
    async_engine.start()

    async def main():
        with pytest.raises(ValueError, match="request 'nope' is unknown or finished"):
            async_engine.rewind("nope", 1)
        return await stream_with_rewind(async_engine, "r", PROMPTS[3], params, at=12, num_tokens=5)

    lengths, last = _run(async_engine, main)
    # The output after the rewind is 5 tokens shorter than the one before it; greedy decoding
    # then makes the same tokens again, up to max_tokens.
    drop = next(i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1])
    assert lengths[drop] == lengths[drop - 1] - 5 >= 7
    assert last.outputs[0].token_ids == expected and len(expected) == 30
    assert async_engine.stats.kv_blocks_used == 0
