"""ProcessEngine: the engine core in a child process (real spawn, real ZeroMQ sockets, real
msgpack) on the tiny random Llama, checked against the in-process LLMEngine token by token."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedserve.engine import LLMEngine, RequestOutput, SamplingParams
from pagedserve.engine.frontend.client import EngineDeadError
from pagedserve.engine.frontend.process_client import ProcessEngine
from pagedserve.engine.messages import AddRequest
from tests.helpers import cpu_engine_config, process_alive, stream_with_rewind

PROMPTS = [[5 + i, 17, 33 + 2 * i, 9][: 1 + i % 4] + list(range(40, 40 + i)) for i in range(6)]


@pytest.fixture(scope="module")
def process_engine(tiny_llama_dir):
    engine = ProcessEngine(cpu_engine_config(tiny_llama_dir))
    engine.start()
    pid = engine.pid
    assert process_alive(pid)
    assert engine.stats.kv_blocks_total == 512  # from CoreReady: before any request
    yield engine
    engine.shutdown()
    assert not process_alive(pid)
    assert not os.path.exists(engine._folder)  # the ipc sockets' folder is removed


def _generate(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Run `requests` concurrently on a started client; their whole outputs, folded from
    deltas."""

    async def one(request_id, prompt, params):
        whole = None
        async for delta in engine.add_request(request_id, prompt, params):
            if whole is None:
                whole = delta
            else:
                whole.add(delta)
        return request_id, whole

    async def main():
        return dict(await asyncio.gather(*(one(i, *r) for i, r in requests.items())))

    return asyncio.run(main())


def _reference(tiny_llama_dir, requests) -> dict[str, RequestOutput]:
    engine = LLMEngine(cpu_engine_config(tiny_llama_dir))
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params.clone(output_kind="final"))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    return finished


def _essentials(out: RequestOutput):
    """Everything but the logprob values, which may differ in the last bits: requests that reach
    the core at different times batch differently (other matmul shapes)."""

    def shape(entries):
        if entries is None:
            return None
        return [None if e is None else {t: (p.rank, p.decoded_token) for t, p in e.items()}
                for e in entries]  # fmt: skip

    samples = [
        (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, shape(c.logprobs))
        for c in out.outputs
    ]
    return samples, shape(out.prompt_logprobs), out.finished


def _logprob_values(out: RequestOutput) -> list[float]:
    entries = [e for c in out.outputs for e in c.logprobs or []]
    entries += [e for e in out.prompt_logprobs or [] if e is not None]
    return [p.logprob for e in entries for p in e.values()]


def test_outputs_equal_the_in_process_engine(process_engine, tiny_llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind="delta")
    # A stop string taken from the middle of a greedy generation, so that it does stop it.
    probe = _reference(tiny_llama_dir, {"p": (PROMPTS[2], greedy.clone(max_tokens=40))})["p"]
    stop = probe.outputs[0].text[12:15]
    assert len(stop) == 3
    requests = {
        "greedy": (PROMPTS[0], greedy),
        "logprobs": (PROMPTS[1], greedy.clone(logprobs=2, prompt_logprobs=1)),
        "stop": (PROMPTS[2], greedy.clone(max_tokens=40, stop=[stop])),
        "seeded-n2": (PROMPTS[3], greedy.clone(temperature=0.9, seed=7, n=2)),
        "short": (PROMPTS[4], greedy.clone(max_tokens=1)),
    }
    want = _reference(tiny_llama_dir, requests)
    got = _generate(process_engine, requests)
    for request_id in requests:
        assert _essentials(got[request_id]) == _essentials(want[request_id]), request_id
        values = _logprob_values(want[request_id])
        assert _logprob_values(got[request_id]) == pytest.approx(values, abs=1e-4)
    assert len(_logprob_values(want["logprobs"])) > 24 * 2
    stopped = got["stop"].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert len(stopped.token_ids) < 40
    assert len(got["seeded-n2"].outputs) == 2
    assert got["seeded-n2"].outputs[0].token_ids != got["seeded-n2"].outputs[1].token_ids
    # Everything was freed in the core, and its stats say so.
    stats = process_engine.stats
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.kv_blocks_total == 512
    assert stats.num_requests_added >= len(requests)
    assert not process_engine.output_processor.has_unfinished_requests()


def test_leaving_a_stream_early_aborts_the_request_in_the_core(process_engine):
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind="delta")

    async def wait_until(predicate, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.005)

    async def main():
        received = 0
        async for out in process_engine.add_request("long", PROMPTS[5], params):
            received += len(out.outputs[0].token_ids)
            if received >= 3:
                break
        await wait_until(lambda: process_engine.stats.kv_blocks_used == 0)
        await wait_until(lambda: "long" not in process_engine._ids_in_use)
        outs = [o async for o in process_engine.add_request("long", PROMPTS[0], params)]
        return outs, received

    outs, received = asyncio.run(main())
    assert received == 3
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 400
    assert process_engine.stats.num_running == 0


def test_rewind_reaches_the_core_and_comes_back_in_order(process_engine, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = _reference(tiny_llama_dir, {"r": (PROMPTS[4], params)})["r"].outputs[0].token_ids
    lengths, last = asyncio.run(
        stream_with_rewind(process_engine, "r", PROMPTS[4], params, at=12, num_tokens=5)
    )
    # The core rewinds 5 of the tokens it has when the message arrives (it may be ahead of
    # what the front end had shown: those tokens come first), and its next step's token comes
    # with the rewind's output: the front end's output is 4 shorter. Greedy decoding makes the
    # 5 tokens again.
    drop = next(i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1])
    assert lengths[drop] == lengths[drop - 1] - 5 + 1 >= 8
    assert last.outputs[0].token_ids == want and len(want) == 30
    with pytest.raises(ValueError, match="request 'r' is unknown or finished"):
        process_engine.rewind("r", 1)


def test_bad_requests_raise_in_the_front_end(process_engine):
    params = SamplingParams(temperature=0, max_tokens=2)

    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            process_engine.add_request("a", [1, 99999], params)
        with pytest.raises(ValueError, match="max_model_len is 512"):
            process_engine.add_request("a", [1] * 600, params)

    asyncio.run(main())
    assert process_engine.vocab_size == 512 and process_engine.max_model_len == 512


def test_a_request_that_cannot_be_sent_leaves_nothing_behind(process_engine, monkeypatch):
    """Encoding a request for the core can fail (an integer msgpack cannot carry, if one got
    past the checks): nothing of it may stay, or it would count against --max-queue-len for
    ever."""
    encoder = process_engine._encoder

    class RefusingEncoder:
        def encode(self, message):
            if isinstance(message, AddRequest):
                raise OverflowError("can't serialize ints > 2**64 - 1")
            return encoder.encode(message)

    monkeypatch.setattr(process_engine, "_encoder", RefusingEncoder())
    submitted = process_engine._num_submitted
    params = SamplingParams(temperature=0, max_tokens=2, output_kind="delta")

    async def main():
        with pytest.raises(OverflowError):
            process_engine.add_request("unsent", PROMPTS[0], params)

    asyncio.run(main())
    assert process_engine._num_submitted == submitted
    assert "unsent" not in process_engine._ids_in_use
    assert "unsent" not in process_engine.output_processor
    monkeypatch.undo()
    got = _generate(process_engine, {"unsent": (PROMPTS[0], params)})
    assert len(got["unsent"].outputs[0].token_ids) == 2


def test_a_config_the_core_refuses_is_a_value_error_and_leaves_no_process(tiny_llama_dir):
    engine = ProcessEngine(cpu_engine_config(tiny_llama_dir, num_kv_blocks=2))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        engine.start()
    assert not process_alive(engine.pid)
    assert not os.path.exists(engine._folder)


def test_a_killed_core_fails_every_stream_and_marks_the_engine_dead(tiny_llama_dir):
    engine = ProcessEngine(cpu_engine_config(tiny_llama_dir))
    engine.start()
    died, killed = [], []
    engine.on_dead = lambda: died.append(time.monotonic())
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True, output_kind="delta")

    counts = {"a": 0, "b": 0}

    async def consume(request_id, prompt):
        with pytest.raises(EngineDeadError, match="exited with code -9") as caught:
            async for out in engine.add_request(request_id, prompt, params):
                counts[request_id] += len(out.outputs[0].token_ids)
                # Killed once both streams have tokens (under load one may start a step late).
                if min(counts.values()) >= 2 and not killed:
                    killed.append(engine.pid)
                    os.kill(engine.pid, signal.SIGKILL)
        return counts[request_id], str(caught.value)

    async def main():
        results = await asyncio.gather(consume("a", PROMPTS[1]), consume("b", PROMPTS[2]))
        with pytest.raises(EngineDeadError, match="restart the server"):
            engine.add_request("c", PROMPTS[3], params)
        return results

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(0 < received < 480 for received, _ in results)
    assert len(died) == 1 and not engine.is_running
    assert str(engine.error) == "the engine core process exited with code -9"
    assert not process_alive(engine.pid)


def test_shutdown_does_not_wait_for_a_core_that_just_died(tiny_llama_dir, monkeypatch):
    # A signal to the whole process group ends the core as the server starts to shut down: the
    # core may still look alive when shutdown() sends it the stop message, but its socket is
    # gone, and a blocking send on a PUSH socket with no peer never returns.
    engine = ProcessEngine(cpu_engine_config(tiny_llama_dir))
    engine.start()
    pid = engine.pid
    os.kill(pid, signal.SIGKILL)
    while process_alive(pid):
        time.sleep(0.01)
    time.sleep(0.5)  # ZeroMQ has dropped the peer
    monkeypatch.setattr(engine._process, "is_alive", lambda: True)  # as seen a moment earlier
    start = time.monotonic()
    engine.shutdown(timeout=1.0)
    assert time.monotonic() - start < 10
    assert engine._process.exitcode == -signal.SIGKILL


def test_a_front_end_that_cannot_load_stops_the_launched_core(tiny_llama_dir, tmp_path):
    # The core is launched before the front end loads its tokenizer (they load at the same
    # time); a tokenizer that does not load is the caller's ValueError, and the core is gone.
    engine = ProcessEngine(cpu_engine_config(tiny_llama_dir, tokenizer=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="none"):
        engine.start()
    assert engine.pid is not None and not process_alive(engine.pid)
    assert not os.path.exists(engine._folder)
