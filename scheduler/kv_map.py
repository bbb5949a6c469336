"""The live block map a scheduler serves (GET /v1/kv): a read of its state, nothing more."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler.block_hash import external_hash
from pagedserve.scheduler.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED
from pagedserve.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from pagedserve.scheduler.scheduler import Scheduler


def kv_map(scheduler: Scheduler) -> dict:
    """The live block map (GET /v1/kv): every block's state, ref count, owners and prefix
    hash, every live request's blocks, and the pool's totals. Plain JSON-ready data;
    O(blocks + table entries), a few milliseconds for tens of thousands of blocks."""
    kv = scheduler.kv_cache_manager
    states, refs, cached = kv.block_pool.block_states()
    owners = kv.block_owners()
    size = kv.block_size
    running = set(map(id, scheduler.running))
    requests = []
    num_unused = 0
    for request in scheduler.requests.values():
        if id(request) in running:
            status = "running"
        elif kv.is_swapped(request.request_id):
            status = "swapped"
        elif request.status == RequestStatus.PREEMPTED:
            status = "preempted"
        else:
            status = "waiting"
        unused = kv.num_unused_slots(request)
        num_unused += unused
        requests.append(
            {
                "id": request.request_id,
                "status": status,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_output_tokens": request.num_output_tokens,
                "num_computed_tokens": request.num_computed_tokens,
                # null: a sliding-window block given back
                "block_ids": kv.table_entries(request.request_id),
                "num_swapped_blocks": kv.swapped_block_count(request.request_id),
                # an encoder-decoder's cross-attention blocks (empty for a decoder-only model)
                "encoder_block_ids": kv.encoder_block_ids(request.request_id),
                "num_unused_slots": unused,
                "num_preemptions": request.num_preemptions,
                "lora": request.lora.lora_name if request.lora else None,
            }
        )
    num_used = sum(state == BLOCK_USED for state in states)
    queries, hits = kv.num_prefix_cache_queries_tokens, kv.num_prefix_cache_hits_tokens
    host = kv.host_pool
    return {
        "block_size": size,
        "num_blocks": kv.num_total_blocks,
        "num_groups": kv.num_groups,
        "blocks": {
            "state": states,
            "ref_count": refs,
            "cached": cached,
            # the prefix hash KV events name the block by (null: not in the prefix cache)
            "hash": [
                None if b.block_hash is None else external_hash(b.block_hash)
                for b in kv.block_pool.blocks
            ],
        },
        # JSON object keys are strings: block id -> request ids holding it.
        "owners": {str(block_id): ids for block_id, ids in owners.items()},
        "requests": requests,
        "totals": {
            "used_blocks": num_used,
            "free_blocks": states.count(BLOCK_FREE),
            "cached_free_blocks": states.count(BLOCK_CACHED),
            "cached_blocks": kv.block_pool.num_cached_blocks,
            "shared_blocks": sum(ref > 1 for ref in refs),
            "usage": num_used / kv.num_total_blocks,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "host_blocks": 0 if host is None else host.num_blocks,
            "swapped_blocks": kv.num_swapped_blocks,
            "fragmentation_tokens": num_unused,
            "fragmentation": num_unused / (num_used * size) if num_used else 0.0,
            "num_running": len(scheduler.running),
            "num_waiting": scheduler.num_waiting,
            "num_preemptions": scheduler.num_preemptions,
            "num_swap_outs": scheduler.num_swap_outs,
            "num_swap_ins": scheduler.num_swap_ins,
        },
    }
