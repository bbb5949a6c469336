"""The scheduler and LoRA adapters: at most `max_loras` adapters among the running requests (the
worker's device slots), a request whose adapter finds no slot waiting without holding up the
requests behind it, block hashes keyed by adapter, and the block map naming each request's."""

from __future__ import annotations

from pagedserve.scheduler import LoRARequest, Request, SamplingParams, Scheduler, SchedulerConfig
from pagedserve.scheduler.block_hash import ROOT_DIGEST, hash_block_tokens, root_digest
from pagedserve.scheduler.kv_map import kv_map

ADAPTERS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in (1, 2, 3)]


def _scheduler(max_loras: int = 2) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
            max_model_len=32, enable_prefix_caching=True, max_loras=max_loras,
        )
    )  # fmt: skip


def _add(scheduler: Scheduler, request_id: str, lora: LoRARequest | None) -> Request:
    request = Request(
        request_id, [7, 8, 9, 10, 11], SamplingParams(max_tokens=2), eos_token_ids=(), lora=lora
    )
    scheduler.add_request(request)
    return request


def test_a_third_adapter_waits_for_a_slot_while_the_requests_behind_it_run():
    scheduler = _scheduler(max_loras=2)
    _add(scheduler, "r1", ADAPTERS[0])
    _add(scheduler, "r2", ADAPTERS[1])
    _add(scheduler, "r3", ADAPTERS[2])  # no third slot
    _add(scheduler, "r4", None)  # the base model needs none
    _add(scheduler, "r5", ADAPTERS[0])  # its adapter has a slot already
    out = scheduler.schedule()
    assert [new.request_id for new in out.new_requests] == ["r1", "r2", "r4", "r5"]
    assert [new.lora for new in out.new_requests] == [ADAPTERS[0], ADAPTERS[1], None, ADAPTERS[0]]
    assert [r.request_id for r in scheduler.waiting] == ["r3"]
    assert scheduler.lora_names() == (("a1", "a2"), ("a3",))
    # r2 ends: a2's slot is free, and r3 is admitted at the next step.
    scheduler.finish_request("r2", scheduler.requests["r2"].status.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert [new.request_id for new in out.new_requests] == ["r3"]
    assert scheduler.lora_names() == (("a1", "a3"), ())


def test_without_lora_the_scheduler_admits_everyone():
    # max_loras 0 (an engine without adapters) never counts them.
    scheduler = _scheduler(max_loras=0)
    for i in range(3):
        _add(scheduler, f"r{i}", None)
    assert len(scheduler.schedule().new_requests) == 3


def test_block_hashes_chain_from_each_adapters_own_root():
    tokens = [1, 2, 3, 4]
    assert root_digest(0) == ROOT_DIGEST
    roots = {root_digest(i) for i in (0, 1, 2)}
    assert len(roots) == 3
    base, one = hash_block_tokens(None, tokens), hash_block_tokens(None, tokens, root_digest(1))
    assert base.token_ids == one.token_ids and base.digest != one.digest
    # The chain keeps them apart at every later block too.
    assert hash_block_tokens(base, tokens).digest != hash_block_tokens(one, tokens).digest


def test_equal_prompts_of_different_adapters_share_no_block():
    scheduler = _scheduler(max_loras=2)
    _add(scheduler, "base", None)
    scheduler.schedule()
    scheduler.finish_request("base", scheduler.requests["base"].status.FINISHED_ABORTED)
    lora = _add(scheduler, "lora", ADAPTERS[0])
    # The base request's full block is cached; the adapter's request finds nothing.
    assert scheduler.kv_cache_manager.get_computed_blocks(lora) == ([], 0)
    again = _add(scheduler, "again", None)
    assert scheduler.kv_cache_manager.get_computed_blocks(again)[1] == 4
    scheduler.schedule()
    requests = {r["id"]: r["lora"] for r in kv_map(scheduler)["requests"]}
    assert requests == {"lora": "a1", "again": None}
