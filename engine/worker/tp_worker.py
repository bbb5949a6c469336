"""Ranks 1..N-1 of a tensor-parallel engine: processes that hold their slice of the model and its
KV cache, and run each step rank 0 broadcasts (engine/models/parallel.py says how the model splits).

    rank 0 (the engine core over its Worker)      rank r (`run_worker`: a Worker alone)
    ──────────────────────────────────            ──────────────────────────────────────────
    start_workers(): one process per rank ──────> main(): its arguments on stdin
    TPGroup: rendezvous on rank 0's store <─────> TPGroup
    the same start-up: weights (its slice), KV plan (all ranks take the fewest blocks), graphs
    step: send(("step", SchedulerOutput)) ──────> ModelRunner.launch(SchedulerOutput)
          forward + all-reduces <───────────────> forward + all-reduces
          gather logits, sample, broadcast ids ──> the ids, as the next step's inputs
    close(): send(("stop",)) ───────────────────> exit 0

On one node, rank 0 starts the others itself (`start_workers`, plain subprocesses: the engine core
may itself be a daemonic multiprocessing child, which may not have children of its own). Across
nodes, torchrun starts every rank and `pagedserve serve` on a rank other than 0 runs `run_worker`.

Failure: rank 0 watches its workers (`TPWorkers.watch`); one that exits while the engine runs
ends rank 0's process with status 1 at once (in a server, the engine core's process: the API
server then fails every open stream and exits non-zero). A worker dies with rank 0's process
(PR_SET_PDEATHSIG), and a broken connection ends a collective that waits for a dead peer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.tp_endpoint import TPEndpoint

logger = logging.getLogger("pagedserve")

_WATCH_S = 0.2  # how often rank 0 looks at its workers
_GRACE_S = 2.0  # how long rank 0 gets to stop by itself once a worker is gone
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process reads from its stdin."""

    config: EngineConfig
    endpoint: TPEndpoint
    parent_pid: int
    log_level: int


class TPWorkers:
    """The worker processes rank 0 started, and the thread that watches them."""

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes = processes
        self._stopping = threading.Event()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def watch(self) -> None:
        """From now on, a worker that exits ends this process with status 1 (see the module
        docstring): collectives with a dead rank could otherwise wait forever."""
        watcher = threading.Thread(target=self._watch, name="pagedserve-tp-watch", daemon=True)
        watcher.start()

    def _watch(self) -> None:
        while not self._stopping.wait(_WATCH_S):
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                # The grace lets rank 0 fail by itself first when it can (the same bad config
                # stops every rank; a collective with a dead peer raises): that error says more.
                if code is not None and not self._stopping.wait(_GRACE_S):
                    logger.error(
                        "tensor-parallel rank %d (pid %d) exited with code %d: the engine cannot "
                        "go on without it; exiting",
                        rank,
                        process.pid,
                        code,
                    )
                    logging.shutdown()
                    os._exit(1)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` seconds for the workers to exit (after rank 0's stop message),
        then kill what is left."""
        self._stopping.set()
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_workers(config: EngineConfig, endpoint: TPEndpoint) -> TPWorkers:
    """Start ranks 1..size-1 on this node; `endpoint` is rank 0's."""
    level = logging.getLogger("pagedserve").getEffectiveLevel()
    processes = []
    try:
        for rank in range(1, endpoint.size):
            args = WorkerArgs(
                config,
                TPEndpoint(
                    rank,
                    endpoint.size,
                    endpoint.address,
                    endpoint.port,
                    local_rank=rank,
                    num_threads=endpoint.num_threads,
                ),
                os.getpid(),
                level,
            )
            process = subprocess.Popen(
                [sys.executable, "-P", "-m", "pagedserve.engine.worker.tp_worker"],
                stdin=subprocess.PIPE,
            )
            processes.append(process)
            process.stdin.write(pickle.dumps(args))
            process.stdin.close()
    except BaseException:
        for process in processes:
            process.kill()
        raise
    logger.info(
        "tensor parallel: started ranks 1..%d (pids %s)",
        endpoint.size - 1,
        ", ".join(str(p.pid) for p in processes),
    )
    return TPWorkers(processes)


def run_worker(config: EngineConfig, endpoint: TPEndpoint) -> None:
    """Be rank `endpoint.rank`: build this rank's worker, then run rank 0's steps until it says
    stop."""
    # torch and the model: only once the process is set up
    from pagedserve.engine.models.model_source import resolve_model
    from pagedserve.engine.worker.worker import Worker

    source = resolve_model(config.model.model)
    max_model_len = config.model.model_len(source.config.max_position_embeddings)
    Worker(config, source, max_model_len, endpoint).serve()
    # Skip the interpreter's teardown: destroying the process groups while other ranks are still
    # connected aborts (std::terminate in gloo's threads), and there is nothing left to save.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process; rank 0 decides
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != args.parent_pid:  # rank 0 died before prctl took effect
        sys.exit(1)
    rank = args.endpoint.rank
    logging.basicConfig(
        level=args.log_level, format=f"%(levelname)s %(name)s [rank {rank}]: %(message)s"
    )
    from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap

    keep_large_allocations_in_heap()  # as in every pagedserve process (why: there)
    run_worker(args.config, args.endpoint)


if __name__ == "__main__":
    main()
