"""`--kv-events-config`: vLLM's JSON, read the way vLLM reads it, so that a router's deployment
recipe for vLLM works unchanged (engine/core/kv_events.py publishes what it asks for).

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}

One key is pagedserve's own: `encoding`. vLLM's events were msgpack arrays (msgspec's
`array_like`) until vLLM PR 42892 made each event a map with its type under "type"; routers
read both today (llm-d-kv-cache since v0.9). "map", the default, is vLLM's current form;
"array" the earlier one, for a consumer that only reads that.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's KVEventsConfig fields, with vLLM's defaults."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM's rule).
    publisher: Literal["null", "zmq"] | None = None
    # A PUB socket: bound when the address has a wildcard (tcp://*:5557), is ipc:// or
    # inproc://, else connected (to a forwarder). With data parallelism, core i adds i to the port.
    endpoint: str = "tcp://*:5557"
    # A ROUTER socket where a subscriber that missed batches asks for them again by number.
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    encoding: Literal["map", "array"] = "map"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The JSON of `--kv-events-config`; ValueError naming what is wrong."""
    try:
        config = msgspec.json.decode(text.encode(), type=KVEventsConfig)
    except msgspec.DecodeError as e:
        raise ValueError(
            f"kv_events_config: {e} (expected vLLM's JSON, e.g. "
            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\')'
        ) from None
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise ValueError(f"kv_events_config: {name} must be at least 1")
    for name in ("endpoint", "replay_endpoint"):
        address = getattr(config, name)
        if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"kv_events_config: {name} must be a ZeroMQ address (tcp://HOST:PORT, "
                f"ipc://PATH or inproc://NAME), got {address!r}"
            )
        if address is not None and address.startswith("tcp://"):
            if not address.rpartition(":")[2].isdigit():
                raise ValueError(f"kv_events_config: {name} {address!r} has no port number")
    return config


def offset_endpoint(address: str | None, rank: int) -> str | None:
    """Data-parallel core `rank`'s address: its TCP port + rank, or an ipc/inproc name with
    `_dp{rank}` appended (as vLLM does, so a consumer finds every core's events)."""
    if address is None or rank == 0:
        return address
    if address.startswith("tcp://"):
        host, _, port = address.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{address}_dp{rank}"
