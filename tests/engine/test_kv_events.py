"""KV events (--kv-events-config): a ZeroMQ subscriber, as a KV-aware router runs one, decodes
every batch with vLLM's msgspec structs (tests/kv_events_wire.py), and the blocks it replays are
the engine's prefix cache."""

from __future__ import annotations

import hashlib
from array import array

import msgspec
import pytest
import zmq

from pagedserve.engine.frontend.llm_engine import LLMEngine
from pagedserve.scheduler import SamplingParams
from pagedserve.scheduler.block_hash import BlockHash, hash_block_tokens
from pagedserve.scheduler.block_pool import BlockPool
from pagedserve.scheduler.kv_events import AllBlocksCleared as LogCleared
from pagedserve.scheduler.kv_events import BlockRemoved as LogRemoved
from pagedserve.scheduler.kv_events import BlockStored as LogStored
from pagedserve.scheduler.kv_events import KVEventLog
from tests.helpers import cpu_engine_config
from tests.kv_events_wire import (
    AllBlocksCleared,
    ArrayAllBlocksCleared,
    ArrayBlockStored,
    ArrayKVEventBatch,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    apply,
    events_config,
    free_ports,
    kv_map_hashes,
    receive_all,
    replay,
    router_hashes,
    subscribe,
)

BLOCK = 4
SHARED = [5, 9, 14, 20, 26, 31, 40, 41, 42, 43, 44, 45]  # 3 full blocks every prompt starts with


def test_a_router_replays_the_prefix_cache_from_the_events_through_hits_evictions_and_preemption(
    tiny_llama_dir,
):
    pub, rep = free_ports(2)
    config = cpu_engine_config(
        tiny_llama_dir,
        num_kv_blocks=24,
        max_model_len=64,
        max_num_seqs=4,
        kv_events_config=events_config(pub, rep),
    )
    engine = LLMEngine(config)
    # A router joining a running engine: what it missed (batch 0, usually) comes from replay.
    sub = subscribe(f"tcp://127.0.0.1:{pub}", b"kv-events")
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        prompts = [SHARED + [60 + i, 70 + i, 80 + i, 90 + i, 100 + i] for i in range(8)]
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        frames = receive_all(sub)
        everything = replay(f"tcp://127.0.0.1:{rep}", 0)
        cached = kv_map_hashes(engine.kv_map())
    finally:
        engine.close()
        sub.close(linger=0)
    # Every batch numbered in order from 0; what the subscriber got live is what replay gives
    # back from the first batch it saw on. Where that is depends on how soon its connection was
    # up (ZeroMQ's slow joiner): usually after batch 0, on a busy machine sometimes before.
    assert [seq for seq, _ in everything] == list(range(len(everything)))
    assert frames and all(topic == b"kv-events" for topic, _, _ in frames)
    live = [(seq, payload) for _, seq, payload in frames]
    assert live == everything[live[0][0] :]
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    batches = [decoder.decode(payload) for _, payload in everything]
    assert all(b.data_parallel_rank == 0 for b in batches)
    assert batches[0].events == [AllBlocksCleared()]
    events = [e for b in batches for e in b.events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert stored and removed  # the pool of 24 blocks evicted cached ones for new tokens
    # The blocks a router replays are the prefix cache's, exactly.
    blocks: set[int] = set()
    apply(blocks, events)
    assert blocks == cached and len(cached) > 3
    # Each stored run is the tokens it names, hashed by the documented rule.
    digests = {}
    for event in stored:
        assert event.block_size == BLOCK and event.medium == "CPU" and event.lora_id is None
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
        parent = bytes(32) if event.parent_block_hash is None else digests[event.parent_block_hash]
        assert router_hashes(event.token_ids, BLOCK, parent) == event.block_hashes
        for i, h in enumerate(event.block_hashes):
            block = event.token_ids[: (i + 1) * BLOCK]
            digests[h] = _digest(block, parent)
    # The shared prefix is stored once, by the first prompt, then hit.
    first = router_hashes(SHARED, BLOCK)
    assert sum(first[0] in e.block_hashes for e in stored) == 1


def _digest(token_ids: list[int], parent: bytes) -> bytes:
    for start in range(0, len(token_ids), BLOCK):
        parent = hashlib.sha256(parent + array("q", token_ids[start : start + BLOCK]).tobytes())
        parent = parent.digest()
    return parent


def test_the_event_log_merges_a_chain_and_the_pool_reports_every_change():
    pool = BlockPool(4, 2)
    pool.event_log = log = KVEventLog(2)
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(a, [3, 4])
    other = hash_block_tokens(None, [9, 9])
    blocks = pool.allocate(3)
    assert pool.cache_full_block(blocks[0], a, None)
    assert pool.cache_full_block(blocks[1], b, a)
    assert pool.cache_full_block(blocks[2], other, None)
    assert not pool.cache_full_block(blocks[2], BlockHash(other.digest, other.token_ids))
    (one, two) = log.take()
    assert isinstance(one, LogStored) and isinstance(two, LogStored)
    assert one.token_ids == [1, 2, 3, 4] and one.parent_block_hash is None
    assert one.block_hashes == router_hashes([1, 2, 3, 4], 2)
    assert two.block_hashes == router_hashes([9, 9], 2)
    pool.free(reversed(blocks))  # free list: 3, other, b, a
    pool.allocate(3)  # block 3 (never cached), then the ones holding other and b: evicted
    removed = log.take()
    assert removed == [LogRemoved([two.block_hashes[0], one.block_hashes[1]])]
    pool.reset_prefix_cache()
    assert log.take() == [LogCleared()]
    assert log.take() == []


@pytest.mark.parametrize(
    "bad",
    [
        '{"enable_kv_cache_events": true, "publisher": "kafka"}',
        '{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}',
        '{"enable_kv_cache_events": true, "topics": "x"}',
        "{not json",
    ],
)
def test_a_bad_kv_events_config_is_refused_with_the_reason(tiny_llama_dir, bad):
    with pytest.raises(ValueError, match="kv_events_config"):
        cpu_engine_config(tiny_llama_dir, kv_events_config=bad)


def test_the_array_encoding_decodes_with_vllms_earlier_structs(tiny_llama_dir):
    pub, rep = free_ports(2)
    config = cpu_engine_config(
        tiny_llama_dir, kv_events_config=events_config(pub, rep, encoding="array")
    )
    engine = LLMEngine(config)
    try:
        engine.add_request("a", SHARED, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        # A malformed request (no 8-byte number) is ignored; the publisher answers the next.
        bad = zmq.Context.instance().socket(zmq.DEALER)
        bad.connect(f"tcp://127.0.0.1:{rep}")
        bad.send_multipart((b"", b"xyz"))
        assert not bad.poll(300)
        bad.close(linger=0)
        batches = replay(f"tcp://127.0.0.1:{rep}", 0)
    finally:
        engine.close()
    decoder = msgspec.msgpack.Decoder(ArrayKVEventBatch)
    events = [e for _, payload in batches for e in decoder.decode(payload).events]
    assert [seq for seq, _ in batches] == [0, 1]
    assert events == [
        ArrayAllBlocksCleared(),  # batch 0: a restarted engine holds nothing
        ArrayBlockStored(router_hashes(SHARED, BLOCK), None, SHARED, BLOCK, None, "CPU"),
    ]
