"""Data parallelism: M engine cores behind one API server (`pagedserve serve
--data-parallel-size M`), each a process of its own with its own model, scheduler and KV cache.

    API server process                                       engine core processes
    ──────────────────                                       ─────────────────────
    HTTP, InputProcessor (one tokenizer)                     core 0: EngineCore (scheduler,
    DataParallelEngine.add_request ─ PrefixRouter.assign ─┬─> ProcessEngine 0    KV cache, model)
                                                          └─> ProcessEngine 1 ─> core 1: ...
    each ProcessEngine's receiver thread: its core's outputs, detokenized, to the streams

`DataParallelEngine` is an EngineClient over M `ProcessEngine`s (engine/frontend/process_client.py)
that share the server's InputProcessor. A request is checked once (`add_request`, as for one core),
then routed to one core, which owns it to the end: its aborts, rewinds and outputs go through that
core's ProcessEngine, and when it finishes its work is taken off the core's load.

Routing (`PrefixRouter`). Each core's load is the work it has outstanding, in tokens: prompt
tokens + max_tokens x samples (best_of, else n) of every request routed there and not finished.
Each core also has a bounded LRU set of the prefixes routed to it: the digests of the full
blocks of every prompt it was sent, hashed as the scheduler's prefix cache keys them
(scheduler/block_hash.py, chained per block of the engine's `block_size`), so a request's
"cached prefix" on a core is the number of its leading full blocks found in that set: the blocks
the core's prefix cache probably still holds (the set keeps at most as many blocks as the core's
pool, and forgets the least recently routed first, as the pool evicts). The rule:

1. candidates: the cores whose load is at most least + max(BALANCE_MIN_TOKENS,
   BALANCE_FRACTION x least), "least" being the smallest load;
2. among them the longest cached prefix wins, then the least load, then the lowest index.

So a prefix goes back to the core that computed it while that core is not much busier than the
others; a hot prefix (one system prompt for every request) fills its core only up to the
threshold, then spills to the next core, which then caches it too, and from there on both have it
and the load decides. Without prefix caching (`--no-enable-prefix-caching`) only the load counts.

The sets keep bare sha256 digests (32 bytes a block, not the token ids the cache's keys also
hold): a collision could only misroute a request, never give it another's KV.

What the server shows: `stats` is the sum over the cores (what the queue limit and a single-core
reading of /metrics mean: the whole server), `core_stats` each one's; with M > 1 /metrics labels
every engine-state family `engine="0"`..`"M-1"` (server/metrics/); `GET /v1/kv?engine=i` is
core i's block map (default 0).

A core that dies fails the whole server, as one core does: its own streams end with
EngineDeadError, the other cores' open requests too (they are aborted there), `is_running` turns
false and `on_dead` is called (server/api_server.py then exits with status 1).

On CPU each core runs torch with its share of the CPUs (`core_threads`): M processes each with a
thread per CPU would only fight over them. On CUDA core i gets GPUs i*N .. i*N + N-1 from the
configured one, N being the tensor-parallel size (`core_configs`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

import torch

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.frontend.client import (
    EngineClient,
    EngineDeadError,
    RequestStream,
    check_core_index,
)
from pagedserve.engine.frontend.inputs import InputProcessor, NewRequest, Prompt
from pagedserve.engine.frontend.process_client import ProcessEngine, front_end_inputs
from pagedserve.engine.messages import EngineStats
from pagedserve.scheduler import SamplingParams
from pagedserve.scheduler.block_hash import hash_block_tokens, root_digest

logger = logging.getLogger("pagedserve")

# The balance threshold (routing rule 1). A cached prefix saves its prefill, a few hundred to a
# few thousand tokens of work; letting its core run up to 2048 tokens ahead of the least loaded
# one (a few typical requests) is worth that, and a hot prefix still spills to another core after
# a few requests. Under heavy load the fraction takes over: a core may be at most a quarter
# busier than the least loaded one, whatever it has cached.
BALANCE_MIN_TOKENS = 2048
BALANCE_FRACTION = 0.25
# How many block digests a core's prefix set holds before the core's pool size is known (it is
# then the pool's number of blocks: the core cannot cache more).
DEFAULT_PREFIX_BLOCKS = 1 << 16


def pick_by_rule(loads: Sequence[float], cached: Sequence[int]) -> int:
    """The routing rule (this module's docstring) on bare numbers: the index it picks, given
    each target's load and its cached prefix (in any unit, the same for all). Shared with
    server/ray_serve/routing.py, which routes over Ray Serve replicas instead of cores."""
    least = min(loads)
    limit = least + max(BALANCE_MIN_TOKENS, BALANCE_FRACTION * least)
    candidates = [i for i, load in enumerate(loads) if load <= limit]
    return min(candidates, key=lambda i: (-cached[i], loads[i], i))


def leading_known(hashes: Sequence[bytes], known: Container[bytes]) -> int:
    """How many of the leading digests of `hashes` are in `known`: a block's KV depends on every
    block before it, so the count stops at the first miss."""
    count = 0
    for digest in hashes:
        if digest not in known:
            break
        count += 1
    return count


class PrefixRouter:
    """Picks the core for each request (the rule: this module's docstring) and keeps the loads
    and the per-core prefix sets. Thread-safe."""

    def __init__(
        self,
        num_cores: int,
        block_size: int,
        prefix_caching: bool = True,
        max_blocks: int = DEFAULT_PREFIX_BLOCKS,
    ) -> None:
        if num_cores < 1 or block_size < 1 or max_blocks < 1:
            raise ValueError(f"bad router sizes: {num_cores=}, {block_size=}, {max_blocks=}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.loads = [0] * num_cores  # outstanding tokens per core
        self._prefixes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_cores)]
        self._max_blocks = [max_blocks] * num_cores
        self._lock = threading.Lock()

    @property
    def num_cores(self) -> int:
        return len(self.loads)

    def set_max_blocks(self, core: int, max_blocks: int) -> None:
        """Bound core `core`'s prefix set (its pool's number of blocks, once known)."""
        with self._lock:
            self._max_blocks[core] = max(1, max_blocks)
            self._trim(core)

    def prefix_hashes(self, token_ids: Sequence[int], lora_int_id: int = 0) -> list[bytes]:
        """The digests of the prompt's full blocks, chained as the prefix cache chains them
        (from the root of the request's LoRA adapter; empty without prefix caching)."""
        if not self.prefix_caching:
            return []
        size = self.block_size
        digests = []
        parent = None
        root = root_digest(lora_int_id)
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash_block_tokens(parent, token_ids[start : start + size], root)
            digests.append(parent.digest)
        return digests

    def cached_blocks(self, core: int, hashes: Sequence[bytes]) -> int:
        """How many of the leading blocks of `hashes` core `core` was sent before (and has not
        forgotten)."""
        return leading_known(hashes, self._prefixes[core])

    def pick(self, hashes: Sequence[bytes]) -> int:
        """The core the rule picks for a request with these prefix digests (nothing changes)."""
        with self._lock:
            return self._pick(hashes)

    def _pick(self, hashes: Sequence[bytes]) -> int:
        cached = [self.cached_blocks(i, hashes) for i in range(self.num_cores)]
        return pick_by_rule(self.loads, cached)

    def assign(self, hashes: Sequence[bytes], cost: int) -> int:
        """Pick a core for a request of `cost` tokens, add them to its load and its prefixes to
        its set; returns the core's index. Call `release(core, cost)` when the request ends."""
        with self._lock:
            core = self._pick(hashes)
            self.loads[core] += cost
            known = self._prefixes[core]
            for digest in hashes:
                known[digest] = None
                known.move_to_end(digest)
            self._trim(core)
            return core

    def release(self, core: int, cost: int) -> None:
        with self._lock:
            self.loads[core] -= cost

    def _trim(self, core: int) -> None:
        known = self._prefixes[core]
        while len(known) > self._max_blocks[core]:
            known.popitem(last=False)


def request_cost(prompt: Prompt, params: SamplingParams) -> int:
    """The work a request brings to its core, in tokens: its prompt and, for every sample, its
    largest output."""
    return len(prompt.token_ids) + params.max_tokens * (params.best_of or params.n)


def core_threads(num_cores: int) -> int | None:
    """torch threads for each of `num_cores` core processes: an equal share of the CPUs this
    process may run on (None for a single core: torch's default)."""
    if num_cores <= 1:
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // num_cores)


def core_configs(config: EngineConfig, num_cores: int) -> list[EngineConfig]:
    """Each core's config: core i is data-parallel rank data_parallel_rank + i (its KV events
    say so, on ports + i); on CUDA it gets GPUs i*N .. i*N + N-1 (N: the tensor-parallel size;
    its ranks count from the first); ValueError when there are not that many."""
    ranked = [
        dataclasses.replace(config, data_parallel_rank=config.parallel.data_parallel_rank + i)
        for i in range(num_cores)
    ]
    device = config.model.torch_device()
    if num_cores == 1 or device.type != "cuda":
        return ranked
    per_core = config.parallel.tensor_parallel_size
    first = device.index or 0
    need = first + num_cores * per_core
    if need > torch.cuda.device_count():
        raise ValueError(
            f"--data-parallel-size {num_cores} x --tensor-parallel-size {per_core} from "
            f"cuda:{first} needs {need} GPUs; torch sees {torch.cuda.device_count()}"
        )
    return [
        dataclasses.replace(c, device=f"cuda:{first + i * per_core}") for i, c in enumerate(ranked)
    ]


def sum_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Field by field: the whole server's counters and gauges (summed; the LoRA adapters' names
    united; the block size, the same in every core, kept)."""

    def total(name: str):
        values = [getattr(s, name) for s in stats]
        if values and isinstance(values[0], tuple):
            return tuple(sorted(set().union(*values)))
        return max(values, default=0) if name == "block_size" else sum(values)

    return EngineStats(*(total(name) for name in EngineStats.__struct_fields__))


class _Core(ProcessEngine):
    """One core of a DataParallelEngine: a ProcessEngine that tells its owner when a request
    ends (however it ends: finished, aborted, failed)."""

    def __init__(
        self,
        owner: DataParallelEngine,
        index: int,
        config: EngineConfig,
        num_threads: int | None,
    ) -> None:
        super().__init__(config, num_threads=num_threads)  # the owner hands it the inputs
        self.index = index
        self._owner = owner
        self.on_dead = lambda: owner._core_died(index)

    def _finish(self, request_id: str, stream: RequestStream) -> None:
        super()._finish(request_id, stream)
        self._owner._request_finished(request_id, stream)


class DataParallelEngine(EngineClient):
    """The server's engine with `data_parallel_size` engine cores, each in a process of its own;
    requests are routed by `PrefixRouter` (this module's docstring)."""

    def __init__(
        self, config: EngineConfig, data_parallel_size: int, max_queue_len: int | None = None
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        super().__init__(None, max_queue_len)  # the inputs load in `start`, as the cores do
        self.config = config
        self.description = ""  # the cores' device, dtype and KV cache, once started
        self.on_dead: Callable[[], None] | None = None  # called on a core's receiver thread
        threads = core_threads(data_parallel_size)
        self.cores = [
            _Core(self, i, config, threads)
            for i, config in enumerate(core_configs(config, data_parallel_size))
        ]
        self.router = PrefixRouter(data_parallel_size, config.cache.block_size)
        self._routes: dict[str, tuple[int, int]] = {}  # request id -> (core, cost); by _lock

    # ---- what handlers may read ------------------------------------------------------------------

    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def core_stats(self) -> list[EngineStats]:
        return [core.stats for core in self.cores]

    @property
    def core_pids(self) -> list[int | None]:
        return [core.pid for core in self.cores]

    @property
    def stats(self) -> EngineStats:
        """The sum over the cores (`core_stats` has each one's)."""
        return sum_stats(self.core_stats)

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        pass  # EngineClient.__init__'s empty snapshot: the cores publish their own

    @property
    def is_running(self) -> bool:
        return self._running and self._error is None and all(c.is_running for c in self.cores)

    @property
    def error(self) -> BaseException | None:
        if self._error is not None:
            return self._error
        return next((c.error for c in self.cores if c.error is not None), None)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every core, their models loading at the same time; return once all are ready.
        When one fails to start, the others are stopped and its error is raised (ValueError when
        it refused the config, RuntimeError when it died)."""
        if self._running or any(core.pid is not None for core in self.cores):
            raise RuntimeError("DataParallelEngine was already started")
        launched = []
        try:
            for core in self.cores:
                core.launch()
                launched.append(core)
            self._use_inputs(
                front_end_inputs(self.config.model, self.config.lora)
            )  # while the cores load the model
        except BaseException:
            for core in launched:
                core.abandon(timeout=0)
            raise
        errors: list[BaseException] = []
        failed = threading.Event()

        def wait(core: _Core) -> None:
            try:
                core.wait_started()
            except BaseException as e:
                errors.append(e)  # (list.append is atomic)
                failed.set()

        waiters = [
            threading.Thread(target=wait, args=(c,), name=f"pagedserve-core-{c.index}-start")
            for c in self.cores
        ]
        for waiter in waiters:
            waiter.start()
        try:
            while any(w.is_alive() for w in waiters) and not failed.wait(0.1):
                pass
        except BaseException:  # Ctrl-C while the models load
            self._stop_starting_cores(waiters)
            raise
        if failed.is_set():
            self._stop_starting_cores(waiters)
            raise errors[0]
        self.description = self.cores[0].description
        for core in self.cores:
            self.router.set_max_blocks(core.index, core.stats.kv_blocks_total)
        self._running = True
        logger.info(
            "%d engine cores ready in processes %s",
            len(self.cores),
            ", ".join(str(core.pid) for core in self.cores),
        )

    def _use_inputs(self, inputs: InputProcessor) -> None:
        self.inputs = inputs
        for core in self.cores:
            core.use_inputs(inputs)
        # An encoder-decoder's cores cache no prefixes (its KV depends on the audio): only the
        # load routes its requests.
        self.router.prefix_caching = self.config.cache.enable_prefix_caching and not (
            inputs.max_audio_samples
        )

    def _stop_starting_cores(self, waiters: list[threading.Thread]) -> None:
        for core in self.cores:
            if not core.is_running:
                core.terminate()  # its wait_started then raises and cleans up
        for waiter in waiters:
            waiter.join()
        self._shutdown_cores(timeout=5.0, cores=[c for c in self.cores if c.is_running])

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every core (requests in flight end with EngineDeadError), all at once. Safe to
        call more than once, from any thread but a core's receiver."""
        self._shutdown_cores(timeout)
        self._running = False

    def _shutdown_cores(self, timeout: float, cores: list[_Core] | None = None) -> None:
        stoppers = [
            threading.Thread(target=core.shutdown, args=(timeout,), daemon=True)
            for core in (self.cores if cores is None else cores)
        ]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()

    def _core_died(self, index: int) -> None:
        """Core `index`'s receiver thread, once the core failed its own requests: fail the
        others' too, go dead, tell the server."""
        core = self.cores[index]
        self._error = RuntimeError(f"{core.error} (engine core {index} of {len(self.cores)})")
        error = EngineDeadError(self._dead_message())
        for other in self.cores:
            if other is not core:
                other.fail_requests(error)
        if self.on_dead is not None:
            self.on_dead()

    # ---- requests --------------------------------------------------------------------------------

    def _submit(self, request: NewRequest, stream: RequestStream) -> None:
        cost = request_cost(request.prompt, request.params)
        lora_id = request.lora.lora_int_id if request.lora else 0
        hashes = self.router.prefix_hashes(request.prompt.token_ids, lora_id)
        index = self.router.assign(hashes, cost)
        with self._lock:
            self._routes[request.request_id] = (index, cost)
        try:
            self.cores[index]._submit(request, stream)
        except BaseException:
            self._release(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        core = self._core_of(request_id)
        if core is not None:
            core.abort(request_id)

    def rewind(self, request_id: str, num_tokens: int) -> None:
        core = self._core_of(request_id)
        if core is None:
            raise ValueError(f"request {request_id!r} is unknown or finished")
        core.rewind(request_id, num_tokens)

    def _core_of(self, request_id: str) -> _Core | None:
        with self._lock:
            route = self._routes.get(request_id)
        return None if route is None else self.cores[route[0]]

    def _request_finished(self, request_id: str, stream: RequestStream) -> None:
        """A core ended the request (its delivering thread): it leaves this client's ids and
        its core's load."""
        self._finish(request_id, stream)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.pop(request_id, None)
        if route is not None:
            self.router.release(*route)

    # ---- the live block map ----------------------------------------------------------------------

    async def kv_map(self, timeout: float = 10.0, engine: int = 0) -> bytes:
        """Core `engine`'s live block map (EngineClient.kv_map)."""
        check_core_index(engine, self.num_cores)
        if not self.is_running:
            raise EngineDeadError(self._dead_message())
        return await self.cores[engine].kv_map(timeout)

    def _ask_kv_map(self, query_id: int) -> None:
        raise AssertionError("unused: kv_map asks the core itself")
