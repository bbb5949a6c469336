"""KV events over ZeroMQ in vLLM's wire format: what a KV-aware router (llm-d's, the Gateway API
Inference Extension's, Dynamo's) reads to learn which prefixes each engine holds.

Each engine step's changes of the prefix cache (scheduler/kv_events.py) go out as one batch, a
three-frame message on a PUB socket:

    [topic, sequence number (8 bytes, big-endian), msgpack payload]

the payload being `[ts, [event, ...], data_parallel_rank]` and each event, with the default
`encoding: "map"`, a map tagged by "type" (vLLM's current form):

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": 16, "lora_id": id | None, "medium": "GPU" | "CPU",
     "lora_name": name | None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": ..., "group_idx": 0}
    {"type": "AllBlocksCleared"}

or, with `encoding: "array"`, the same fields in that order in an array after the type's name
(vLLM's msgspec `array_like` form before vLLM PR 42892). Sequence numbers count batches from 0;
a subscriber that sees a gap asks the ROUTER socket at `replay_endpoint` for the batches from a
number on: from a DEALER socket it sends `[b"", start (8 bytes, big-endian)]` and gets one
`[b"", seq, payload]` per batch still buffered (the last `buffer_steps`), then
`[b"", -1 (8 bytes, signed), b""]` (a REQ socket would keep only the first answer).

The sockets live in a thread of their own: the engine's step only hands it the step's events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from pagedserve.engine.kv_events_config import KVEventsConfig, offset_endpoint
from pagedserve.scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger("pagedserve")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket


class KVEventPublisher:
    """Publishes the batches of one engine core (data-parallel rank `rank`, whose sockets are on
    the configured ports + rank). `windows`: each KV-cache group's sliding window (None: full
    attention), for the events' cache-spec fields. `medium`: "GPU" or "CPU", where the cache is.
    ValueError when a socket cannot be bound or connected."""

    def __init__(
        self,
        config: KVEventsConfig,
        rank: int,
        medium: str,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.config = config
        self.rank = rank
        self.medium = medium
        self.windows = windows
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self.num_dropped = 0  # batches refused because the queue was full
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            _bind_or_connect(self._pub, self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open {self.endpoint} / {self.replay_endpoint} for KV "
                f"events ({e}); pick free ports (data-parallel core i uses port + i)"
            ) from None
        self._thread = threading.Thread(target=self._run, name="pagedserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events as a batch (nothing when there are none)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning("KV events: the publisher's queue is full; dropping batches")

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=200)  # a moment for the last batches to leave
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    # ---- the publisher thread --------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError as e:  # a subscriber gone mid-answer
                    logger.warning("KV events: a replay was cut short (%s)", e)
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encoder.encode([ts, [self._event(e) for e in events], self.rank])
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # (a bug): the batch is lost, its number skipped, the thread lives
                logger.exception("KV events: batch %d could not be sent", seq)
            else:
                self._buffer.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _event(self, event: KVEvent) -> dict | list:
        """One event as vLLM's msgspec structs encode it (`encoding`: map or array)."""
        if isinstance(event, BlockStored):
            lora = event.lora
            window = self.windows[event.group] if event.group < len(self.windows) else None
            fields = {
                "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": lora.lora_int_id if lora else None,
                "medium": self.medium,
                "lora_name": lora.lora_name if lora else None,
                "extra_keys": None,
                "group_idx": event.group,
                "kv_cache_spec_kind": "full_attention" if window is None else "sliding_window",
                "kv_cache_spec_sliding_window": window,
            }
        elif isinstance(event, BlockRemoved):
            fields = {
                "block_hashes": event.block_hashes,
                "medium": self.medium,
                "group_idx": event.group,
            }
        else:
            assert isinstance(event, AllBlocksCleared)
            fields = {}
        name = type(event).__name__
        if self.config.encoding == "map":
            return {"type": name, **fields}
        return [name, *fields.values()]


def _bind_or_connect(socket: zmq.Socket, address: str) -> None:
    """vLLM's convention: a wildcard host, ipc:// or inproc:// is bound here; any other address
    is a forwarder's, connected to."""
    host = address.split("://", 1)[1].rpartition(":")[0]
    if address.startswith(("ipc://", "inproc://")) or host in ("*", "[::]", "::"):
        socket.bind(address)
    else:
        socket.connect(address)
