"""Data parallelism (engine/frontend/data_parallel.py): the router's picks for given loads and
cached prefixes, exactly; then a DataParallelEngine of two real core processes on the tiny random
Llama, checked against the in-process LLMEngine, with rewinds, aborts, the block maps and a core
that fails to start."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from pagedserve.engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from pagedserve.engine.frontend.client import EngineDeadError
from pagedserve.engine.frontend.data_parallel import (
    BALANCE_FRACTION,
    BALANCE_MIN_TOKENS,
    DataParallelEngine,
    PrefixRouter,
    core_configs,
    core_threads,
    request_cost,
    sum_stats,
)
from pagedserve.engine.frontend.inputs import Prompt
from pagedserve.engine.messages import EngineStats
from pagedserve.scheduler.block_hash import hash_block_tokens
from tests import kv_events_wire as wire
from tests.helpers import process_alive, stream_with_rewind
from tests.lora_adapters import ALL_TARGETS, save_random_peft_adapter

BLOCK = 4
A = list(range(100, 116))  # four blocks
B = list(range(200, 216))


def _router(num_cores: int = 2, **kwargs) -> PrefixRouter:
    return PrefixRouter(num_cores, BLOCK, **kwargs)


def _loaded(router: PrefixRouter, loads: list[int]) -> PrefixRouter:
    router.loads = list(loads)
    return router


def test_prefix_hashes_are_the_prefix_caches_full_blocks():
    router = _router()
    tokens = A + [1, 2, 3]  # the partial last block is not hashed
    parent, expected = None, []
    for start in range(0, 16, BLOCK):
        parent = hash_block_tokens(parent, tokens[start : start + BLOCK])
        expected.append(parent.digest)
    assert router.prefix_hashes(tokens) == expected
    assert router.prefix_hashes(tokens[:3]) == []
    assert _router(prefix_caching=False).prefix_hashes(tokens) == []


def test_without_cached_prefixes_the_least_loaded_core_wins_then_the_lowest_index():
    router = _router(3)
    assert router.pick([]) == 0
    assert _loaded(router, [5, 3, 3]).pick(router.prefix_hashes(A)) == 1
    assert _loaded(router, [5, 3, 1]).pick([]) == 2


def test_a_cached_prefix_wins_within_the_balance_threshold():
    router = _router()
    hashes = router.prefix_hashes(A)
    assert router.assign(hashes, 10) == 0
    router.release(0, 10)
    assert router.loads == [0, 0]
    # Core 0 holds the prefix: it wins while at most BALANCE_MIN_TOKENS ahead of core 1 ...
    assert _loaded(router, [BALANCE_MIN_TOKENS, 0]).pick(hashes) == 0
    # ... not beyond it.
    assert _loaded(router, [BALANCE_MIN_TOKENS + 1, 0]).pick(hashes) == 1
    # Under heavy load the fraction of the least load is the threshold.
    least = 4 * BALANCE_MIN_TOKENS
    within = least + int(BALANCE_FRACTION * least)
    assert _loaded(router, [within, least]).pick(hashes) == 0
    assert _loaded(router, [within + 1, least]).pick(hashes) == 1
    # A prompt sharing only the first block still prefers the core that has it.
    assert _loaded(router, [100, 0]).pick(router.prefix_hashes(A[:4] + B)) == 0
    assert router.pick(router.prefix_hashes(B)) == 1  # nothing cached: least load


def _cache(router: PrefixRouter, core: int, tokens: list[int]) -> None:
    router._prefixes[core].update(dict.fromkeys(router.prefix_hashes(tokens)))


def test_the_longest_cached_prefix_wins_then_the_least_load():
    router = _router(3)
    _cache(router, 0, A[:12])  # three blocks of A
    _cache(router, 1, A[:8] + B)  # two of A, then B
    _cache(router, 2, A)  # all four
    hashes = router.prefix_hashes(A)
    assert [router.cached_blocks(i, hashes) for i in range(3)] == [3, 2, 4]
    assert _loaded(router, [0, 0, 30]).pick(hashes) == 2  # 4 blocks beat 3, despite the load
    assert _loaded(router, [0, 0, BALANCE_MIN_TOKENS + 1]).pick(hashes) == 0  # over: next best
    _cache(router, 0, A)
    assert _loaded(router, [10, 0, 5]).pick(hashes) == 2  # 4 blocks each: the lesser load
    assert _loaded(router, [5, 0, 5]).pick(hashes) == 0  # and then the lower index


def test_a_hot_prefix_spills_over_to_another_core_and_then_balances():
    router = _router()
    hashes = router.prefix_hashes(A)
    cost = 500
    picks = [router.assign(hashes, cost) for _ in range(12)]
    # Core 0 takes it until it is more than BALANCE_MIN_TOKENS ahead of core 1 ...
    first = BALANCE_MIN_TOKENS // cost + 1
    assert picks[:first] == [0] * first
    assert picks[first] == 1
    # ... then both hold the prefix and the load decides: the loads stay within one request.
    assert abs(router.loads[0] - router.loads[1]) <= BALANCE_MIN_TOKENS + cost
    assert picks[first:].count(1) > picks[first:].count(0)
    assert router.cached_blocks(1, hashes) == 4


def test_each_cores_prefix_set_is_bounded_and_forgets_the_least_recent():
    router = _router(max_blocks=6)
    router.assign(router.prefix_hashes(A), 0)  # 4 blocks
    router.assign(router.prefix_hashes(A[:4]), 0)  # A's first block is recent again
    router.assign(router.prefix_hashes(B[:12]), 0)  # 3 more: 2 of A's go
    assert router.cached_blocks(0, router.prefix_hashes(B)) == 3
    assert router.cached_blocks(0, router.prefix_hashes(A)) == 1  # its blocks 1 and 2 went
    router.set_max_blocks(0, 1)
    assert len(router._prefixes[0]) == 1


def test_request_cost_sum_stats_and_threads():
    prompt = Prompt(list(range(10)))
    assert request_cost(prompt, SamplingParams(max_tokens=7)) == 17
    assert request_cost(prompt, SamplingParams(max_tokens=7, n=2, best_of=3)) == 31
    total = sum_stats([EngineStats(num_running=1, step_seconds=0.5), EngineStats(num_running=2)])
    assert (total.num_running, total.step_seconds) == (3, 0.5)
    assert core_threads(1) is None
    assert core_threads(1000) == 1


# ---- two real core processes -----------------------------------------------------------------


def _config_fields() -> dict:
    return dict(
        device="cpu", dtype="float32", block_size=BLOCK, num_kv_blocks=256, max_model_len=256
    )


def _config(tiny_llama_dir, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), **{**_config_fields(), **kwargs})


@pytest.fixture(scope="module")
def event_ports() -> list[int]:
    """The cores' KV events: publisher and replay ports, each + the core's index."""
    return wire.free_ports(2, run=2)


@pytest.fixture(scope="module")
def dp_engine(tiny_llama_dir, event_ports):
    # LoRA on: test_a_lora_adapter_reaches_every_core sends adapters through (the other tests ask
    # the base model, which an engine with adapters serves as before).
    # KV events on: test_every_core_publishes_its_own_kv_events reads them.
    config = _config(
        tiny_llama_dir, enable_lora=True, kv_events_config=wire.events_config(*event_ports)
    )
    engine = DataParallelEngine(config, 2)
    engine.start()
    pids = engine.core_pids
    assert len(set(pids)) == 2 and all(process_alive(p) for p in pids)
    assert engine.stats.kv_blocks_total == 512  # the sum of the two pools
    assert [s.kv_blocks_total for s in engine.core_stats] == [256, 256]
    yield engine
    engine.shutdown()
    assert not any(process_alive(p) for p in pids)


PROMPTS = {f"r{i}": [7 + i, 30, 31, 32, 33, 34 + i] + list(range(50, 50 + 3 * i)) for i in range(8)}


def test_requests_spread_over_the_cores_and_match_one_engine(dp_engine, tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0, output_kind="final")

    async def one(request_id, prompt):
        async for out in dp_engine.add_request(request_id, prompt, params):
            last = out
        return request_id, last

    async def main():
        return dict(await asyncio.gather(*(one(i, p) for i, p in PROMPTS.items())))

    before = [s.num_requests_added for s in dp_engine.core_stats]
    outputs = asyncio.run(main())
    reference = LLMEngine(_config(tiny_llama_dir))
    for request_id, prompt in PROMPTS.items():
        reference.add_request(request_id, prompt, params)
    expected = {}
    while reference.has_unfinished_requests():
        expected.update({o.request_id: o for o in reference.step()})
    for request_id, out in outputs.items():
        assert out.outputs[0].token_ids == expected[request_id].outputs[0].token_ids
    added = [s.num_requests_added - b for s, b in zip(dp_engine.core_stats, before, strict=True)]
    assert sum(added) == 8 and min(added) >= 2  # no shared full block: the loads alternate
    assert dp_engine.router.loads == [0, 0]  # released as they finished
    assert dp_engine.num_unfinished_requests == 0


def test_a_lora_adapter_reaches_every_core(dp_engine, tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    folder = save_random_peft_adapter(hf, tmp_path / "adapter", 8, 16, ALL_TARGETS, seed=2)
    lora = LoRARequest("a", 1, str(folder))
    params = SamplingParams(max_tokens=6, temperature=0, output_kind="final")

    async def one(request_id, prompt):
        async for out in dp_engine.add_request(request_id, prompt, params, lora_request=lora):
            last = out
        return request_id, last.outputs[0].token_ids

    async def main():
        return dict(await asyncio.gather(*(one(f"l{i}", p) for i, p in PROMPTS.items())))

    before = [s.num_requests_added for s in dp_engine.core_stats]
    outputs = asyncio.run(main())
    reference = LLM(str(tiny_llama_dir), **{**_config_fields(), "enable_lora": True})
    expected = reference.generate(list(PROMPTS.values()), params, lora_request=lora)
    assert list(outputs.values()) == [o.outputs[0].token_ids for o in expected]
    base = reference.generate(list(PROMPTS.values()), params)
    assert [o.outputs[0].token_ids for o in base] != list(outputs.values())  # it changed them
    added = [s.num_requests_added - b for s, b in zip(dp_engine.core_stats, before, strict=True)]
    assert min(added) >= 2  # both cores served the adapter's requests


def test_a_rewind_and_an_abort_reach_the_owning_core(dp_engine):
    params = SamplingParams(max_tokens=250, temperature=0, ignore_eos=True)

    async def main():
        added = [s.num_requests_added for s in dp_engine.core_stats]
        # Core 0 gets a long request; the rewound one, added before any output can come back,
        # goes to core 1, the less loaded.
        busy = dp_engine.add_request("busy", [5, 6, 7], params)
        assert dp_engine.router.loads == [253, 0]
        # 64 tokens: room to rewind before the request ends, however many tokens one output
        # brings (with 12, the core once finished before the client saw the 8th).
        lengths, last = await stream_with_rewind(
            dp_engine, "rw", [9, 8, 7], SamplingParams(max_tokens=64, temperature=0), 8, 3
        )
        assert lengths[-1] == 64 and last.finished
        assert any(b < a for a, b in zip(lengths, lengths[1:], strict=False))  # it was rewound
        now = [s.num_requests_added for s in dp_engine.core_stats]
        assert [now[0] - added[0], now[1] - added[1]] == [1, 1]
        # An abort reaches the core that owns the request: its output says so at once.
        dp_engine.abort("busy")
        outputs = [out async for out in busy]
        assert outputs[-1].finished
        assert outputs[-1].outputs[0].finish_reason in ("abort", "length")  # (if it was quick)
        assert dp_engine.router.loads == [0, 0]
        with pytest.raises(ValueError, match="unknown or finished"):
            dp_engine.rewind("busy", 1)
        for engine in (0, 1):
            assert b'"num_blocks":256' in await dp_engine.kv_map(engine=engine)
        with pytest.raises(ValueError, match="engine 2 does not exist"):
            await dp_engine.kv_map(engine=2)

    asyncio.run(main())
    assert dp_engine.num_unfinished_requests == 0


def test_every_core_publishes_its_own_kv_events(dp_engine, event_ports):
    # After the requests above: each core's events, asked again from its replay socket (port +
    # core index) and replayed, are its block map's prefix cache, tagged with its rank.
    decoder = msgspec.msgpack.Decoder(wire.KVEventBatch)
    for core in (0, 1):
        batches = [
            decoder.decode(payload)
            for _, payload in wire.replay(f"tcp://127.0.0.1:{event_ports[1] + core}", 0)
        ]
        assert {b.data_parallel_rank for b in batches} == {core}
        blocks: set[int] = set()
        wire.apply(blocks, [e for b in batches for e in b.events])
        cached = wire.kv_map_hashes(asyncio.run(dp_engine.kv_map(engine=core)))
        assert blocks == cached and len(cached) >= 4  # every core served prompts of full blocks
        # Both cores served adapter "a" (id 1) and the base model: their blocks say which.
        stored = [e for b in batches for e in b.events if isinstance(e, wire.BlockStored)]
        assert {(e.lora_id, e.lora_name) for e in stored} == {(None, None), (1, "a")}


def test_a_core_that_cannot_start_stops_the_others(tiny_llama_dir):
    # Too few blocks for one sequence: every core refuses its config; the error is the core's.
    engine = DataParallelEngine(_config(tiny_llama_dir, num_kv_blocks=2), 2)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.start()
    assert not any(process_alive(p) for p in engine.core_pids)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        engine.add_request("x", [1, 2], SamplingParams())


def test_each_core_gets_its_own_gpus(monkeypatch):
    # No GPU on this machine: torch is told it has four (a mock, only of the device count) so
    # that the mapping of cores to GPUs is checked; on CPU every core shares the config.
    cpu = core_configs(EngineConfig(device="cpu", data_parallel_rank=4), 2)
    assert cpu == [EngineConfig(device="cpu", data_parallel_rank=r) for r in (4, 5)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    devices = [c.model.device for c in core_configs(EngineConfig(device="cuda"), 4)]
    assert devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    tp = EngineConfig(device="cuda:1", tensor_parallel_size=1)
    assert [c.model.device for c in core_configs(tp, 3)] == ["cuda:1", "cuda:2", "cuda:3"]
    two = EngineConfig(device="cuda", tensor_parallel_size=2)
    assert [c.model.device for c in core_configs(two, 2)] == ["cuda:0", "cuda:2"]
    with pytest.raises(ValueError, match="x --tensor-parallel-size 2 from cuda:0 needs 6 GPUs"):
        core_configs(two, 3)
