"""The engine core's own process (`pagedserve serve`'s default): `run_engine_core` loads the model,
says CoreReady, then loops: take what the front end sent (AddRequest, AbortSamples, RewindSamples,
GetKVMap, Shutdown), step, send CoreOutputs. The front end's side of the ZeroMQ sockets, the
messages' road and the supervision are described in engine/frontend/process_client.py.

This module imports the core (torch and the model code) only inside `run_engine_core`: the front
end imports it to name the process's target.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys

import msgspec
import zmq

from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.messages import (
    AbortSamples,
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreOutputs,
    CoreReady,
    GetKVMap,
    KVMap,
    RewindSamples,
)

logger = logging.getLogger("pagedserve")

_PARENT_CHECK_MS = 1000  # how often an idle core checks that its parent is alive
_PR_SET_PDEATHSIG = 1


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    log_level: int,
    num_threads: int | None = None,
) -> None:
    """The engine core process: load the model, say CoreReady, then loop (take inputs, step,
    send outputs) until Shutdown, SIGTERM or the parent's death. `num_threads`: torch's
    intra-op threads, set before the model is built (None: torch's default, every CPU)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_now)
    parent = _die_with_parent()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from pagedserve.engine.core.engine_core import (
        EngineCore,  # torch and the model code: only in this process
    )
    from pagedserve.engine.cpu_allocator import keep_large_allocations_in_heap

    keep_large_allocations_in_heap()  # the process's own entry point sets it (why: there)
    if (
        num_threads is not None
    ):  # this process's share of the CPUs (engine/frontend/data_parallel.py)
        torch.set_num_threads(num_threads)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        try:
            core = EngineCore(config)
        except Exception as e:
            if not isinstance(e, ValueError):
                logger.exception("the engine core could not start")
            outputs.send(encoder.encode(CoreFailed(str(e), isinstance(e, ValueError))))
            return
        # What the start built lives as long as this process (about 240K objects for SmolLM2:
        # modules, tokenizer, block pool): out of the cycle collector's scans, each of which
        # otherwise walks them all (2-3% of a single stream's time; docs/benchmarks-history.md,
        # "Rows interleaved by 8"). As vLLM's engine core does; this process ends with the core.
        gc.collect()
        gc.freeze()
        outputs.send(encoder.encode(CoreReady(core.max_model_len, core.describe(), core.stats())))
        try:
            _serve(core, inputs, outputs, encoder, parent)
        finally:
            core.close()  # tensor parallel: the workers stop with it
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)  # let the last message out
        context.term()


def _serve(core, inputs: zmq.Socket, outputs: zmq.Socket, encoder, parent: int) -> None:
    decoder = msgspec.msgpack.Decoder(CoreInput)
    while True:
        if not core.has_work():  # idle: block on the input socket, watching the parent
            while not inputs.poll(_PARENT_CHECK_MS):
                if os.getppid() != parent:
                    return
        rewound = []  # outputs of rewinds, ahead of the step's
        while True:  # everything that arrived during the last step
            try:
                frame = inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = decoder.decode(frame)
            if isinstance(message, AddRequest):
                core.add_samples(message.samples)
            elif isinstance(message, AbortSamples):
                core.abort_samples(message.request_ids, stopped=message.stopped)
            elif isinstance(message, GetKVMap):  # answered at once, between two steps
                outputs.send(encoder.encode(KVMap(message.query_id, core.kv_map())))
            elif isinstance(message, RewindSamples):
                try:
                    rewound += core.rewind_samples(message.request_ids, message.num_tokens)
                except ValueError as e:
                    logger.warning("rewind of %s dropped: %s", message.request_ids, e)
            else:
                return  # Shutdown
        samples = rewound + (core.step_samples() if core.has_work() else [])
        outputs.send(encoder.encode(CoreOutputs(samples, core.stats())))


def _exit_now(signum: int, frame: object) -> None:
    sys.exit(0)


def _die_with_parent() -> int:
    """Ask Linux to SIGTERM this process when its parent dies; return the parent's pid (an idle
    core also checks it, where prctl is not available)."""
    parent = multiprocessing.parent_process().pid
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(0)
    return parent
