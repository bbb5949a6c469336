"""Where the ranks of a tensor-parallel group meet (`TPEndpoint`): from torchrun's environment, or
chosen by rank 0 when it starts the other ranks itself. Plain data, shared by the front end (the
`pagedserve` command under torchrun, the in-process `LLM`) and the worker's ranks."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class TPEndpoint:
    """Where rank `rank` of `size` finds the others: the rendezvous store at `address:port`,
    which rank 0 hosts unless torchrun's agent already does (`agent_store`). `local_rank` picks
    the GPU on a node; `num_threads` is the rank's CPU share."""

    rank: int
    size: int
    address: str
    port: int
    local_rank: int
    num_threads: int | None = None
    agent_store: bool = False

    @classmethod
    def from_torchrun(cls) -> TPEndpoint | None:
        """The endpoint torchrun's environment describes (RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT, LOCAL_RANK), or None outside torchrun."""
        env = os.environ
        if "WORLD_SIZE" not in env or "MASTER_ADDR" not in env:
            return None
        return cls(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            int(env.get("LOCAL_RANK", env["RANK"])),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the rendezvous store binds it right after)."""
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]
