"""One worker's adapters: those loaded in host memory and those in its device slots.

    request's LoRARequest ──load (once; again after host eviction)──> host: LRU of LoRAAdapters
                                                                     (max_cpu_loras)
    a step's adapters ──`set_step`──> device slots (max_loras), filled least recently used first
                                     from the host copies, then each token's slot for the layers

The scheduler admits at most `max_loras` adapters among the running requests (scheduler.py), so a
step's adapters always fit the slots; an adapter stays in its slot after its requests end, until
another needs the slot, so returning adapters cost nothing.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.engine.lora.adapter import (
    LoRAAdapter,
    LoRAWeights,
    load_adapter,
    projection_parts,
)
from pagedserve.engine.lora.layers import NO_SLOT, LoRAProjection, LoRAStep
from pagedserve.engine.models.model import MLP, CausalLM
from pagedserve.engine.models.model_config import ModelConfig
from pagedserve.engine.models.parallel import TPShard
from pagedserve.scheduler import LoRARequest


class LoRAManager:
    """Attaches slot weights to every adaptable projection of `model` and fills them per step."""

    def __init__(
        self,
        model: CausalLM,
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        base_config: ModelConfig | None = None,
    ) -> None:
        # Adapters are read against the whole model (`base_config`); with tensor parallelism
        # (`model.shard`) each projection then keeps this rank's part (TPShard.slice_lora).
        self.base_config: ModelConfig = base_config or model.config
        self.shard: TPShard | None = model.shard
        self.config: ModelConfig = model.config
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.step = LoRAStep(max_tokens, max_loras, dtype, device)
        parts = projection_parts(self.config)

        def projection(name: str) -> LoRAProjection:
            outs, in_features = parts[name]
            return LoRAProjection(self.step, outs, in_features, max_loras, max_rank, dtype)

        self.layers: list[dict[str, LoRAProjection]] = []
        for layer in model.layers:
            attention = layer.self_attn
            attention.qkv_lora, attention.o_lora = projection("qkv"), projection("o")
            projections = {"qkv": attention.qkv_lora, "o": attention.o_lora}
            if isinstance(layer.mlp, MLP):
                layer.mlp.gate_up_lora = projections["gate_up"] = projection("gate_up")
                layer.mlp.down_lora = projections["down"] = projection("down")
            self.layers.append(projections)
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter id in each slot
        # Slots by last use, least recent first (free ones are put first).
        self._slot_order: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by last use too
        self.num_slot_loads = 0  # adapters copied into a slot: the slots' churn

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for layer in self.layers for p in layer.values())

    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from its path if it is not there (ValueError when
        it does not fit the model); the least recently used one beyond max_cpu_loras goes."""
        adapter = self.host.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_adapter(lora.lora_path, self.base_config, self.max_rank, lora.lora_name)
            if self.shard is not None:
                adapter = self._rank_part(adapter)
            self.host[lora.lora_int_id] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lora.lora_int_id)
        return adapter

    def _rank_part(self, adapter: LoRAAdapter) -> LoRAAdapter:
        layers = [
            {
                name: LoRAWeights(*self.shard.slice_lora(name, w.a, w.b, self.base_config))
                for name, w in layer.items()
            }
            for layer in adapter.layers
        ]
        return dataclasses.replace(adapter, layers=layers)

    def set_step(self, loras: Sequence[LoRARequest | None], query_lens: np.ndarray) -> None:
        """Put the step's adapters in slots and tell the layers each token's slot. `loras`: each
        sequence's adapter in batch order, `query_lens` its number of tokens."""
        if not any(loras):
            self.step.clear()
            return
        slot_of: dict[int, int] = {}
        for lora in loras:
            if lora is not None and lora.lora_int_id not in slot_of:
                slot_of[lora.lora_int_id] = self._slot_for(lora, slot_of)
        seq_slots = np.array(
            [NO_SLOT if lora is None else slot_of[lora.lora_int_id] for lora in loras], np.int32
        )
        self.step.set(np.repeat(seq_slots, query_lens))

    def _slot_for(self, lora: LoRARequest, taken: dict[int, int]) -> int:
        """The slot holding `lora`, filling the least recently used one that this step's other
        adapters do not hold when it is in none."""
        lora_id = lora.lora_int_id
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            busy = set(taken.values())
            free = [s for s in self._slot_order if s not in busy]
            if not free:
                raise RuntimeError(
                    f"a step holds more than max_loras={self.max_loras} adapters (the scheduler "
                    "admits at most that many)"
                )
            slot = free[0]
            self._fill(slot, lora)
        self._slot_order.move_to_end(slot)
        return slot

    def _fill(self, slot: int, lora: LoRARequest) -> None:
        adapter = self.add(lora)
        for layer, projections in enumerate(self.layers):
            weights = adapter.layers[layer] if layer < len(adapter.layers) else {}
            for name, projection in projections.items():
                projection.load(slot, weights.get(name))
        self.slot_ids[slot] = lora.lora_int_id
        self.step.slot_ranks[slot] = adapter.rank
        self.num_slot_loads += 1
