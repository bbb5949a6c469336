"""vLLM's KV-event structs (their field layout, vllm/distributed/kv_events.py, written out here)
and a router's side of the ZeroMQ protocol, for the tests of --kv-events-config: the map form
of vLLM's current releases, and the array form of the ones before (`array_like=True`, its first
six fields), which a consumer of those reads."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from array import array
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM's array form: the same names, tagged positionally.
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


def free_ports(n: int, run: int = 1) -> list[int]:
    """`n` free local ports, each the first of `run` consecutive free ones (data-parallel core i
    publishes on port + i)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        taken = [*ports, *(p + i for p in ports for i in range(run))]
        if first + run < 65536 and all(_free(first + i) for i in range(run)) and first not in taken:
            ports.append(first)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def events_config(pub: int, replay: int, **more: Any) -> str:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv-events",
        **more,
    }
    return json.dumps(config)


def router_hashes(token_ids: list[int], block_size: int, parent: bytes = bytes(32)) -> list[int]:
    """The block hashes of a token sequence as a router computes them from the documented rule
    (README "KV events"): digest = sha256(parent digest || the block's tokens as little-endian
    int64), 32 zero bytes before the first block; the hash is the digest's first 8 bytes,
    big-endian."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        parent = hashlib.sha256(parent + array("q", block).tobytes()).digest()
        hashes.append(int.from_bytes(parent[:8], "big"))
    return hashes


def subscribe(address: str, topic: bytes) -> zmq.Socket:
    """A SUB socket on `address`, returned once its connection is up (the publisher then has
    its subscription a moment later: a PUB drops what no subscriber asked for yet)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(address)
    assert monitor.poll(10_000), f"no connection to {address}"
    recv_monitor_message(monitor)
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.2)
    return sub


def receive_all(sub: zmq.Socket, quiet_ms: int = 300) -> list[tuple[bytes, int, bytes]]:
    frames = []
    while sub.poll(quiet_ms):
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
    return frames


def replay(address: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for the batches from `start` on. A DEALER, framed as a REQ would
    be (an empty delimiter first): a REQ socket takes only the first of the answers."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        assert dealer.poll(5000), "the replay socket did not answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            dealer.close(linger=0)
            assert payload == b""
            return out
        out.append((int.from_bytes(seq, "big"), payload))


def apply(blocks: set[int], events: list) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            blocks.difference_update(event.block_hashes)
        else:
            blocks.clear()


def kv_map_hashes(kv_map: bytes) -> set[int]:
    """The prefix hashes of the cached blocks of a GET /v1/kv answer."""
    return {h for h in json.loads(kv_map)["blocks"]["hash"] if h is not None}
