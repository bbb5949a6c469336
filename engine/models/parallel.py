"""Tensor parallelism: how a model's weights split over N ranks (`TPShard`), and the process group
the ranks talk over (`TPGroup`, torch.distributed: gloo on CPU, NCCL between GPUs).

Each rank holds a slice of every layer (Megatron's split, as vLLM does it):

    q/k/v, gate/up   column-parallel: each rank computes its heads / its share of the MLP width
    o, down          row-parallel: each rank multiplies its columns, one all-reduce sums them
    embedding        vocab-parallel: rows [r*s, (r+1)*s) per rank, the others look up zeros,
                     an all-reduce sums the one non-zero row
    lm_head          vocab-parallel: each rank scores its rows; rank 0 gathers the logits and
                     samples, then broadcasts the sampled ids (the ranks need them as inputs)
    norms, rotary    replicated: every rank computes them on the same (all-reduced) values

KV heads go with their query heads: rank r holds the K/V of its KV heads only, in blocks of its
own cache tensors, under the one block table the scheduler (rank 0's) keeps for all ranks.

    uneven   KV heads that do not divide by N (SmolLM2: 3 KV heads on 2 ranks) split as evenly as
             they go, 2 + 1, each with its whole group of query heads
    fewer    fewer KV heads than ranks: each KV head is replicated on the ranks that share its
             group of query heads (each rank still needs one query head of its own)

A mixture of experts is refused for now (its experts would need their own split).

Rank 0 runs the engine core (scheduler, sampler, front end); ranks 1..N-1 run only the model
(engine/worker/tp_worker.py). Rank 0 broadcasts each step's plain-data SchedulerOutput over a gloo
group (`TPGroup.send`), and every rank runs the same ModelRunner code on it, so the collectives
inside the forward pass line up.
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.tp_endpoint import TPEndpoint
from pagedserve.scheduler.utils import cdiv

# How long the ranks wait for each other to appear at start-up (loading weights comes after).
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)
# The control group's operations: a worker waits in one for as long as the server is idle. A
# peer that dies breaks the connection, which ends the wait at once (gloo raises).
IDLE_TIMEOUT = datetime.timedelta(days=3650)


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` of range(n) cut into `parts` nearly equal parts, the larger
    ones first."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `size` holds: ranges [start, end) of query heads, KV heads, MLP width
    and vocabulary rows (the last padded to `vocab_rows`, the same on every rank)."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_rows: int

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: its heads and MLP width (the vocabulary stays whole:
        the model pads its embedding rows itself)."""
        return dataclasses.replace(
            config,
            num_attention_heads=self.num_q_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate[1] - self.intermediate[0],
        )

    def _slices(self, config: ModelConfig) -> tuple[slice, slice, slice]:
        """This rank's rows of q and of k (or v) out of the whole model's, and its MLP width."""
        d = config.head_dim
        q = slice(self.q_heads[0] * d, self.q_heads[1] * d)
        kv = slice(self.kv_heads[0] * d, self.kv_heads[1] * d)
        return q, kv, slice(*self.intermediate)

    def _qkv_rows(self, stacked: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's rows of q, k and v stacked in that order (rows of the whole model's)."""
        q, kv, _ = self._slices(config)
        d = config.head_dim
        q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
        qs, ks, vs = stacked.split((q_out, kv_out, kv_out))
        return torch.cat((qs[q], ks[kv], vs[kv]))

    def _gate_up_rows(self, stacked: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        gate, up = stacked.split((config.intermediate_size, config.intermediate_size))
        inter = slice(*self.intermediate)
        return torch.cat((gate[inter], up[inter]))

    def slice_lora(
        self, projection: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's weights for one projection (engine/lora/adapter.py's
        layout: a [parts, rank, in], b [out, rank], whole-model sizes). A column-parallel
        projection (qkv, gate_up) keeps A whole and takes its own rows of B; a row-parallel one
        (o, down) takes its own columns of A and keeps B whole: each rank's B (A_r x_r) is a
        partial sum that the all-reduce after the projection adds up with the base output's."""
        q, _, inter = self._slices(config)
        if projection == "qkv":
            return a, self._qkv_rows(b, config)
        if projection == "gate_up":
            return a, self._gate_up_rows(b, config)
        return (a[..., q] if projection == "o" else a[..., inter]), b

    def slice_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of each checkpoint tensor (Hugging Face names, full shapes)."""
        q, kv, inter = self._slices(config)
        for name, tensor in weights:
            attn = name.rsplit(".", 2)[-2] if ".self_attn." in name else None
            if attn == "q_proj":
                tensor = tensor[q]
            elif attn in ("k_proj", "v_proj"):
                tensor = tensor[kv]
            elif attn == "o_proj":
                tensor = tensor[:, q]
            elif attn == "qkv_proj":  # Phi-3 stores q, k and v stacked
                tensor = self._qkv_rows(tensor, config)
            elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                tensor = tensor[inter]
            elif name.endswith("mlp.down_proj.weight"):
                tensor = tensor[:, inter]
            elif name.endswith("mlp.gate_up_proj.weight"):  # Phi-3: gate and up stacked
                tensor = self._gate_up_rows(tensor, config)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = tensor.new_zeros(self.vocab_rows, tensor.shape[1])
                rows[: self.vocab[1] - self.vocab[0]] = tensor[slice(*self.vocab)]
                tensor = rows
            yield name, tensor


def plan_shards(config: ModelConfig, size: int) -> list[TPShard]:
    """Each rank's slice of `config` over `size` ranks; ValueError when the model cannot be split
    that way (saying what would work)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.num_experts:
        raise ValueError(
            f"tensor parallelism does not split mixtures of experts yet ({config.architecture}); "
            "run it on one rank (--tensor-parallel-size 1), or as replicas with "
            "--data-parallel-size"
        )
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    if size > nh:
        raise ValueError(
            f"--tensor-parallel-size {size} exceeds the model's {nh} attention heads: each rank "
            f"needs one; use at most {nh}"
        )
    group = nh // nkv  # query heads per KV head
    vocab_rows = cdiv(config.vocab_size, size)
    shards = []
    for rank in range(size):
        if nkv >= size:
            kv = _split(nkv, size, rank)
            q = (kv[0] * group, kv[1] * group)
        else:  # replicate: the ranks sharing a KV head split its query heads
            head = rank * nkv // size
            sharing = [r for r in range(size) if r * nkv // size == head]
            # At most ceil(size / nkv) <= group ranks share a head, since size <= nh.
            assert len(sharing) <= group, (size, nh, nkv)
            start, end = _split(group, len(sharing), sharing.index(rank))
            kv = (head, head + 1)
            q = (head * group + start, head * group + end)
        vocab = (min(rank * vocab_rows, config.vocab_size),
                 min((rank + 1) * vocab_rows, config.vocab_size))  # fmt: skip
        shards.append(
            TPShard(
                rank, size, q, kv, _split(config.intermediate_size, size, rank), vocab, vocab_rows
            )
        )
    return shards


def describe_shards(config: ModelConfig, shards: list[TPShard]) -> str:
    """How the heads went, for the start-up log (an uneven or replicated split says so)."""
    size, nkv = len(shards), config.num_key_value_heads
    heads = ", ".join(f"{s.num_q_heads}/{s.num_kv_heads}" for s in shards)
    if nkv < size:
        how = f"{nkv} KV heads replicated over {size} ranks"
    elif nkv % size:
        how = f"{nkv} KV heads do not divide by {size}: uneven split"
    else:
        how = "even split"
    return f"tensor parallel over {size} ranks, query/KV heads per rank {heads} ({how})"


class TPGroup:
    """The ranks of one tensor-parallel model. Collectives run on `device` (NCCL between GPUs,
    gloo on CPU); rank 0's control messages (`send` / `receive`) always go over gloo.

    Every rank must call the same collectives in the same order: the model's forward pass does
    (its all-reduces and the logits' gather), and so does the runner (the sampled ids)."""

    def __init__(self, endpoint: TPEndpoint, device: torch.device) -> None:
        self.rank, self.size, self.device = endpoint.rank, endpoint.size, device
        self.is_driver = endpoint.rank == 0
        store = dist.TCPStore(
            endpoint.address,
            endpoint.port,
            endpoint.size,
            endpoint.rank == 0 and not endpoint.agent_store,
            timeout=STARTUP_TIMEOUT,
        )
        self._store = store  # rank 0's object holds the store's server (without torchrun)
        self._control = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), self.rank, self.size, IDLE_TIMEOUT
        )
        if device.type == "cuda":
            self._data = dist.ProcessGroupNCCL(
                dist.PrefixStore("data", store), self.rank, self.size
            )
        else:
            self._data = dist.ProcessGroupGloo(
                dist.PrefixStore("data", store), self.rank, self.size, STARTUP_TIMEOUT
            )

    # ---- collectives of the forward pass and the runner -----------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        self._data.allreduce([tensor]).wait()
        return tensor

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0 gets every rank's [rows, vocab_rows] logits side by side, cut to the real
        vocabulary; the other ranks get None."""
        options = dist.GatherOptions()
        options.rootRank = 0
        logits = logits.contiguous()
        if not self.is_driver:
            self._data.gather([], [logits], options).wait()
            return None
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self._data.gather([parts], [logits], options).wait()
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (same shape and dtype), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._data.broadcast([tensor], options).wait()
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank has room for)."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        tensor = torch.tensor([value], dtype=torch.int64)
        self._control.allreduce([tensor], options).wait()
        return int(tensor.item())

    # ---- control messages: rank 0 -> the others -------------------------------------------------

    def send(self, message: object) -> None:
        """Rank 0: hand every other rank `message` (plain data: a SchedulerOutput, block ids)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._bcast_control(torch.tensor([payload.numel()], dtype=torch.int64))
        self._bcast_control(payload)

    def receive(self) -> object:
        """Ranks 1..N-1: wait for rank 0's next message."""
        length = self._bcast_control(torch.zeros(1, dtype=torch.int64))
        payload = self._bcast_control(torch.empty(int(length.item()), dtype=torch.uint8))
        return pickle.loads(payload.numpy().tobytes())

    def _bcast_control(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._control.broadcast([tensor], options).wait()
        return tensor
