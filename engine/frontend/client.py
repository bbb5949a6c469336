"""The engine as the server sees it, whichever way the core runs: `EngineClient` (request
streams, ids, the queue limit, failure state) and what its implementations share. The
implementations: `AsyncEngine` (engine/frontend/async_engine.py, the core on a thread of this
process), `ProcessEngine` (engine/frontend/process_client.py, the core in a process of its own)
and `DataParallelEngine` (engine/frontend/data_parallel.py, several such processes).

This module loads no model code: the server imports it whichever client it runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence

from pagedserve.engine.frontend.inputs import EMBEDDING_PARAMS, InputProcessor, NewRequest, Prompt
from pagedserve.engine.frontend.outputs import RequestOutput
from pagedserve.engine.messages import EngineStats
from pagedserve.scheduler import LoRARequest, SamplingParams

logger = logging.getLogger("pagedserve")


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue_len requests; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an unexpected error; no request can be served."""


class DrainingError(RuntimeError):
    """The server is shutting down: it finishes the requests it has and takes no new ones."""


class RequestStream:
    """The consumer side of one request: outputs arrive on an asyncio queue fed by the engine
    thread. Iterate it once; leaving the loop early (or `abort()`) aborts the request."""

    def __init__(self, owner: EngineClient, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.loop = loop
        self.finished = False  # set by the engine thread when the last output is queued
        self._owner = owner
        self._aborted = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._owner.abort(self.request_id)


class EngineClient(ABC):
    """What the server needs of an engine, wherever its core runs: the input checks, request
    streams, unique request ids, the waiting-queue limit and the engine's failure state.

    Subclasses deliver the engine's outputs (`_deliver`, on whichever thread they come from)
    and implement `_submit`, `abort`, `start` and `shutdown`."""

    def __init__(self, inputs: InputProcessor | None, max_queue_len: int | None = None) -> None:
        """`inputs` None: a subclass sets them before it starts (ProcessEngine.use_inputs)."""
        if max_queue_len is not None and max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1 or None (no limit), got {max_queue_len}")
        self.inputs = inputs
        self.max_queue_len = max_queue_len
        self._lock = threading.Lock()  # guards _num_submitted and _ids_in_use
        # Requests handed to the engine; the engine's stats count those it has queued, so the
        # difference is what is on its way and not yet in stats.num_waiting.
        self._num_submitted = 0
        self._ids_in_use: set[str] = set()
        self._streams: dict[str, RequestStream] = {}  # owned by the thread that delivers
        self._running = False
        self._error: BaseException | None = None
        self.draining = False  # set by start_draining(): new requests are refused
        self.stats = EngineStats()
        # kv_map() calls waiting for the core's answer: query id -> (event loop, future).
        self._kv_queries: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._query_ids = itertools.count()

    # ---- what handlers may read ------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.inputs.vocab_size

    def process_prompt(self, prompt: str | Sequence[int] | Prompt) -> Prompt:
        """`InputProcessor.process_prompt`, from the caller's thread."""
        return self.inputs.process_prompt(prompt)

    @property
    def is_running(self) -> bool:
        return self._running and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def num_unfinished_requests(self) -> int:
        """Requests accepted whose last output has not been delivered yet."""
        with self._lock:
            return len(self._ids_in_use)

    @property
    def num_cores(self) -> int:
        """Engine cores behind this client, each with its own scheduler and KV cache (more than
        one: engine/frontend/data_parallel.py)."""
        return 1

    @property
    def core_stats(self) -> list[EngineStats]:
        """Each core's stats, by index (`stats` is their sum)."""
        return [self.stats]

    @property
    def core_pids(self) -> list[int | None]:
        """The ids of the cores' own processes, by index (None: not running); empty when the
        core runs in this process."""
        return []

    def start_draining(self) -> None:
        """Refuse new requests (DrainingError) from now on; those accepted go on."""
        self.draining = True

    # ---- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Check a request (`InputProcessor.process_inputs`, on the caller's thread) and queue
        it; iterate the returned stream for its outputs (of `params.output_kind`: the server
        asks for "delta"). `lora_request`: the adapter it runs with (None: the base model).

        Raises at once (nothing queued) ValueError for inputs the engine cannot serve,
        QueueFullError when max_queue_len requests are already waiting, DrainingError once the
        server is shutting down and EngineDeadError when the engine has stopped. Call from a
        running event loop: outputs are delivered to it."""
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        if self.draining:
            raise DrainingError("the server is shutting down and accepts no new requests")
        prompt = self.inputs.process_inputs(prompt, params, lora_request)
        with self._lock:
            if request_id in self._ids_in_use:
                raise ValueError(f"request id {request_id!r} is already in use")
            stats = self.stats
            in_transit = self._num_submitted - stats.num_requests_added
            if (
                self.max_queue_len is not None
                and stats.num_waiting + in_transit >= self.max_queue_len
            ):
                raise QueueFullError(
                    f"the server's waiting queue is full ({self.max_queue_len} requests are "
                    "waiting); retry later"
                )
            self._num_submitted += 1
            self._ids_in_use.add(request_id)
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        try:
            arrival = arrival_time or time.time()
            request = NewRequest(request_id, prompt, params, arrival, lora_request)
            self._submit(request, stream)
        except BaseException:  # not queued after all: it must not count against the queue
            with self._lock:
                self._num_submitted -= 1
                self._ids_in_use.discard(request_id)
            raise
        return stream

    def encode(
        self,
        request_id: str,
        prompt: str | Sequence[int] | Prompt,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """An embedding engine's request: `add_request` of a prompt checked by
        `InputProcessor.process_embedding_prompt`; its stream yields one `PoolingOutput`."""
        return self.add_request(request_id, prompt, EMBEDDING_PARAMS, arrival_time)

    @abstractmethod
    def _submit(self, request: NewRequest, stream: RequestStream) -> None:
        """Hand a checked request to the engine; its outputs go to `stream`."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; a no-op when it already finished."""

    @abstractmethod
    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Queue a rewind of a request (`LLMEngine.rewind`) from any thread: it takes effect
        when the engine next takes commands, counting back from the tokens it has then; the
        request's next outputs show it. Raises ValueError at once for an unknown or finished
        request; a rewind the engine cannot apply then (the request ended, or has fewer tokens
        by then) is logged and dropped."""

    @abstractmethod
    def start(self) -> None:
        """Start the engine; requests are accepted once this returns."""

    @abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests in flight end with EngineDeadError."""

    # ---- the live block map ----------------------------------------------------------------------

    async def kv_map(self, timeout: float = 10.0, engine: int = 0) -> bytes:
        """Core `engine`'s live block map as JSON (`EngineCore.kv_map`), taken between two
        steps. Raises ValueError for an index outside [0, num_cores), EngineDeadError when the
        engine has stopped, TimeoutError when no answer comes."""
        check_core_index(engine, self.num_cores)
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            query_id = next(self._query_ids)
            self._kv_queries[query_id] = (loop, future)
        try:
            self._ask_kv_map(query_id)
            return await asyncio.wait_for(future, timeout)
        finally:
            with self._lock:
                self._kv_queries.pop(query_id, None)

    @abstractmethod
    def _ask_kv_map(self, query_id: int) -> None:
        """Have the core's map delivered to `_answer_kv_map(query_id, ...)`."""

    def _answer_kv_map(self, query_id: int, kv_map: bytes | BaseException) -> None:
        with self._lock:
            waiting = self._kv_queries.get(query_id)
        if waiting is not None:
            post_to_loop(waiting[0], resolve_future, waiting[1], kv_map)

    # ---- delivery (the delivering thread) --------------------------------------------------------

    def _finish(self, request_id: str, stream: RequestStream) -> None:
        stream.finished = True
        with self._lock:
            self._ids_in_use.discard(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        # One wake-up of each event loop per step, not one per request.
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self._finish(output.request_id, stream)
            batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in batches.items():
            post_to_loop(loop, put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in self._streams.items():
            self._finish(request_id, stream)
            post_to_loop(stream.loop, stream.queue.put_nowait, error)
        self._streams.clear()
        with self._lock:
            queries = list(self._kv_queries)
        for query_id in queries:
            self._answer_kv_map(query_id, error)

    def _dead_message(self) -> str:
        return f"the engine has stopped ({self._error!r}); restart the server"


def check_core_index(engine: int, num_cores: int) -> None:
    """ValueError unless `engine` names one of `num_cores` cores."""
    if not 0 <= engine < num_cores:
        raise ValueError(
            f"engine {engine} does not exist: this server has {num_cores} engine "
            f"core{'s' if num_cores > 1 else ''} (0 to {num_cores - 1})"
        )


def post_to_loop(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run `callback(*args)` on `loop`'s thread. A consumer whose event loop has already closed
    (its caller went away) simply misses the item: the engine must not die of it."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def resolve_future(future: asyncio.Future, value: object) -> None:
    if not future.done():  # (its caller may have timed out)
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)


def put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, output in items:
        q.put_nowait(output)
