from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagedserve.scheduler import (
    CachedRequestData,
    Request,
    RequestDelta,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.scheduler.mirror import UNKNOWN, MirroredScheduler, Scheduled

NUM_BLOCKS = 8
BLOCK_SIZE = 4


def make_scheduler(**overrides: object) -> Scheduler:
    settings: dict[str, object] = {
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 32,
        "enable_prefix_caching": True,
    }
    settings.update(overrides)
    return MirroredScheduler(SchedulerConfig(**settings))  # type: ignore[arg-type]


def add(
    scheduler: Scheduler,
    request_id: str,
    prompt: Sequence[int],
    eos_token_ids: Sequence[int] = (),
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 20)
    request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids)  # type: ignore[arg-type]
    scheduler.add_request(request)
    return request


def view(item: Scheduled) -> tuple[str, tuple[int, ...], int, tuple[int, ...], bool]:
    """The fields that change step to step, for exact comparisons."""
    return (item.request_id, item.token_ids, item.start_position, item.block_table, item.sample)


def free_list(scheduler: Scheduler) -> list[int]:
    return scheduler.kv_cache_manager.block_pool.free_block_ids()


def ref_cnts(scheduler: Scheduler) -> list[int]:
    return [block.ref_cnt for block in scheduler.kv_cache_manager.block_pool.blocks]


def assert_no_block_in_use(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.num_used_blocks == 0
    assert ref_cnts(scheduler) == [0] * kv.num_total_blocks


def fake_model_token(token_ids: Sequence[int]) -> int:
    """A deterministic "model": the next token is a function of the sequence so far."""
    return (token_ids[-1] * 7 + sum(token_ids) + len(token_ids)) % 90 + 10


def model_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[RequestDelta]]:
    output = scheduler.schedule()
    sampled = {
        item.request_id: fake_model_token(scheduler.requests[item.request_id].all_token_ids)
        for item in output.scheduled
        if item.sample
    }
    return output, scheduler.update_from_output(output, sampled)


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        _, deltas = model_step(scheduler)
        for delta in deltas:
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    raise AssertionError("requests did not finish")


# --------------------------------------------------------------------------- admission


def test_admission_and_decode_across_block_boundary() -> None:
    scheduler = make_scheduler()
    add(scheduler, "r1", [1, 2, 3, 4, 5, 6])
    add(scheduler, "r2", [7, 8, 9])
    assert (scheduler.num_waiting, scheduler.num_running) == (2, 0)

    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("r1", (1, 2, 3, 4, 5, 6), 0, (0, 1), True),
        ("r2", (7, 8, 9), 0, (2,), True),
    ]
    assert output.num_scheduled_tokens == 9
    assert output.preempted_request_ids == output.finished_request_ids == ()
    assert [item.num_output_tokens for item in output.scheduled] == [0, 0]
    assert (scheduler.num_waiting, scheduler.num_running) == (0, 2)
    assert scheduler.requests["r1"].num_computed_tokens == 6
    deltas = scheduler.update_from_output(output, {"r1": 100, "r2": 200})
    assert deltas == [
        RequestDelta("r1", (100,), RequestStatus.RUNNING, None, 6, 1),
        RequestDelta("r2", (200,), RequestStatus.RUNNING, None, 3, 1),
    ]

    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("r1", (100,), 6, (0, 1), True),
        ("r2", (200,), 3, (2,), True),
    ]
    assert [item.num_output_tokens for item in output.scheduled] == [1, 1]
    scheduler.update_from_output(output, {"r1": 101, "r2": 201})

    # r2's fifth token (position 4) opens a new block: the head of the free list, 3.
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("r1", (101,), 7, (0, 1), True),
        ("r2", (201,), 4, (2, 3), True),
    ]
    assert free_list(scheduler) == [4, 5, 6, 7]
    scheduler.update_from_output(output, {"r1": 102, "r2": 202})
    assert scheduler.requests["r1"].output_token_ids == [100, 101, 102]
    assert scheduler.requests["r2"].all_token_ids == [7, 8, 9, 200, 201, 202]

    assert scheduler.abort("r1") is not None
    assert scheduler.abort("r2") is not None
    assert_no_block_in_use(scheduler)


def test_chunked_prefill_over_several_steps() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=5)
    add(scheduler, "long", range(13))
    add(scheduler, "short", [50, 51, 52, 53])

    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("long", (0, 1, 2, 3, 4), 0, (0, 1), False),
    ]
    assert output.num_scheduled_tokens == 5
    assert scheduler.num_waiting == 1  # budget used up: "short" waits
    assert scheduler.update_from_output(output, {}) == []

    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("long", (5, 6, 7, 8, 9), 5, (0, 1, 2), False),
    ]
    assert scheduler.update_from_output(output, {}) == []

    # The last chunk samples; the 2 leftover tokens of budget start "short"'s prefill.
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("long", (10, 11, 12), 10, (0, 1, 2, 3), True),
        ("short", (50, 51), 0, (4,), False),
    ]
    assert output.num_scheduled_tokens == 5
    deltas = scheduler.update_from_output(output, {"long": 77})
    assert [(delta.request_id, delta.new_token_ids) for delta in deltas] == [("long", (77,))]

    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("long", (77,), 13, (0, 1, 2, 3), True),
        ("short", (52, 53), 2, (4,), True),
    ]
    assert output.num_scheduled_tokens == 3
    deltas = scheduler.update_from_output(output, {"long": 78, "short": 88})
    assert [(delta.request_id, delta.new_token_ids) for delta in deltas] == [
        ("long", (78,)),
        ("short", (88,)),
    ]
    scheduler.abort("long")
    scheduler.abort("short")
    assert_no_block_in_use(scheduler)


def test_running_requests_are_served_before_waiting_ones_and_budget_is_shared() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    add(scheduler, "a", [1, 2, 3])
    output = scheduler.schedule()
    scheduler.update_from_output(output, {"a": 10})
    add(scheduler, "b", [20, 21, 22, 23, 24, 25, 26])
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("a", (10,), 3, (0,), True),
        ("b", (20, 21, 22, 23, 24), 0, (1, 2), False),
    ]
    assert output.num_scheduled_tokens == 6
    scheduler.update_from_output(output, {"a": 11})
    scheduler.abort("a")
    scheduler.abort("b")
    assert_no_block_in_use(scheduler)


def test_max_num_seqs_limits_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in ("r1", "r2", "r3"):
        add(scheduler, request_id, [1, 2], stop_token_ids=[5])
    output = scheduler.schedule()
    assert [item.request_id for item in output.scheduled] == ["r1", "r2"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    deltas = scheduler.update_from_output(output, {"r1": 5, "r2": 9})
    assert [(delta.request_id, delta.finish_reason) for delta in deltas] == [
        ("r1", "stop"),
        ("r2", None),
    ]
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("r2", (9,), 2, (1,), True),
        ("r3", (1, 2), 0, (2,), True),  # block 0, freed by r1, sits at the tail
    ]
    assert output.finished_request_ids == ("r1",)
    scheduler.abort("r2")
    scheduler.abort("r3")
    assert_no_block_in_use(scheduler)


def test_admission_is_fifo_without_overtaking() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=16)
    add(scheduler, "big", range(12))
    scheduler.update_from_output(scheduler.schedule(), {"big": 50})
    add(scheduler, "blocked", range(100, 108))  # needs 2 blocks, 1 is free
    add(scheduler, "small", [200, 201])  # would fit, but must not overtake
    output = scheduler.schedule()
    assert [item.request_id for item in output.scheduled] == ["big"]
    assert [request.request_id for request in scheduler.waiting] == ["blocked", "small"]
    scheduler.abort("big")
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("blocked", tuple(range(100, 108)), 0, (3, 2), True),
        ("small", (200, 201), 0, (1,), True),
    ]
    scheduler.abort("blocked")
    scheduler.abort("small")
    assert_no_block_in_use(scheduler)


def test_prefix_cache_hit_skips_cached_blocks() -> None:
    scheduler = make_scheduler()
    add(scheduler, "first", range(1, 11), max_tokens=1)
    deltas = scheduler.update_from_output(scheduler.schedule(), {"first": 42})
    assert deltas[0].finish_reason == "length"
    assert free_list(scheduler) == [3, 4, 5, 6, 7, 2, 1, 0]
    add(scheduler, "second", range(1, 11))
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("second", (9, 10), 8, (0, 1, 3), True),
    ]
    assert output.num_scheduled_tokens == 2
    kv = scheduler.kv_cache_manager
    assert (kv.num_prefix_cache_queries_tokens, kv.num_prefix_cache_hits_tokens) == (20, 8)
    scheduler.abort("second")
    assert_no_block_in_use(scheduler)


def test_prompt_logprobs_request_skips_prefix_cache_hits() -> None:
    """Cached tokens would skip the forward pass and so their logits: a request that scores its
    prompt recomputes it all, while a plain request with the same prompt still takes the hit."""
    scheduler = make_scheduler()
    add(scheduler, "first", range(1, 11), max_tokens=1)
    scheduler.update_from_output(scheduler.schedule(), {"first": 42})
    assert free_list(scheduler) == [3, 4, 5, 6, 7, 2, 1, 0]
    add(scheduler, "scored", range(1, 11), prompt_logprobs=0)
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("scored", tuple(range(1, 11)), 0, (3, 4, 5), True),
    ]
    assert output.scheduled[0].prompt_logprob_token_ids == tuple(range(2, 11))
    kv = scheduler.kv_cache_manager
    assert (kv.num_prefix_cache_queries_tokens, kv.num_prefix_cache_hits_tokens) == (20, 0)
    add(scheduler, "plain", range(1, 11))
    output = scheduler.schedule()
    # "scored" decodes its token still being sampled (scheduled before that step's update).
    assert [view(item) for item in output.scheduled] == [
        ("scored", (UNKNOWN,), 10, (3, 4, 5), True),
        ("plain", (9, 10), 8, (0, 1, 6), True),
    ]
    assert [item.prompt_logprob_token_ids for item in output.scheduled] == [(), ()]
    assert (kv.num_prefix_cache_queries_tokens, kv.num_prefix_cache_hits_tokens) == (30, 8)
    scheduler.abort("scored")
    scheduler.abort("plain")
    assert_no_block_in_use(scheduler)


def test_prompt_logprob_token_ids_follow_the_chunks() -> None:
    """Each chunk scores the prompt tokens its positions predict, the first token of the next
    chunk included; the last prompt position predicts a sampled token and is not scored."""
    scheduler = make_scheduler(max_num_batched_tokens=5)
    add(scheduler, "r", range(10, 23), prompt_logprobs=2)  # 13 prompt tokens
    chunks = []
    for token in (None, None, 77, 78):
        output = scheduler.schedule()
        (item,) = output.scheduled
        chunks.append((item.start_position, item.token_ids, item.prompt_logprob_token_ids))
        scheduler.update_from_output(output, {} if token is None else {"r": token})
    assert chunks == [
        (0, tuple(range(10, 15)), tuple(range(11, 16))),
        (5, tuple(range(15, 20)), tuple(range(16, 21))),
        (10, (20, 21, 22), (21, 22)),
        (13, (77,), ()),
    ]
    scheduler.abort("r")
    assert_no_block_in_use(scheduler)


def test_prefix_caching_disabled_recomputes_everything() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    add(scheduler, "first", range(1, 11), max_tokens=1)
    scheduler.update_from_output(scheduler.schedule(), {"first": 42})
    add(scheduler, "second", range(1, 11))
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("second", tuple(range(1, 11)), 0, (3, 4, 5), True),
    ]
    scheduler.abort("second")
    assert_no_block_in_use(scheduler)


# -------------------------------------------------------------------------- preemption


def test_preemption_of_latest_request_and_recompute() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    add(scheduler, "a", range(100, 112))  # 3 blocks
    add(scheduler, "b", range(200, 210))  # 3 blocks
    add(scheduler, "c", range(300, 306))  # 2 blocks: the pool is now full
    output = scheduler.schedule()
    assert [item.block_table for item in output.scheduled] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    scheduler.update_from_output(output, {"a": 1000, "b": 2000, "c": 3000})
    add(scheduler, "d", [400, 401])

    # "a" needs a 4th block: "c", the latest admitted, is preempted (7 then 6 freed) and
    # "a" takes block 7. Nobody is admitted in a step that preempted.
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("a", (1000,), 12, (0, 1, 2, 7), True),
        ("b", (2000,), 10, (3, 4, 5), True),
    ]
    assert output.preempted_request_ids == ("c",)
    assert free_list(scheduler) == [6]
    request_c = scheduler.requests["c"]
    assert request_c.status is RequestStatus.PREEMPTED
    assert (request_c.num_computed_tokens, request_c.num_preemptions) == (0, 1)
    assert request_c.all_token_ids == [*range(300, 306), 3000]
    assert scheduler.num_preemptions == 1
    assert [request.request_id for request in scheduler.waiting] == ["c", "d"]
    assert scheduler.kv_cache_manager.get_block_ids("c") == []
    scheduler.update_from_output(output, {"a": 1001, "b": 2001})

    # "c" needs 2 blocks, 1 is free: it stays at the head and "d" may not overtake.
    output = scheduler.schedule()
    assert [item.request_id for item in output.scheduled] == ["a", "b"]
    scheduler.update_from_output(output, {"a": 1002, "b": 2002})
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("a", (1002,), 14, (0, 1, 2, 7), True),
        ("b", (2002,), 12, (3, 4, 5, 6), True),
    ]
    scheduler.update_from_output(output, {"a": 1003, "b": 2003})

    # Aborting "a" frees 7 2 1 0; "c" resumes by recomputing prompt + its output token.
    scheduler.abort("a")
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("b", (2003,), 13, (3, 4, 5, 6), True),
        ("c", (*range(300, 306), 3000), 0, (7, 2), True),
        ("d", (400, 401), 0, (1,), True),
    ]
    assert [item.num_output_tokens for item in output.scheduled] == [4, 1, 0]
    assert output.finished_request_ids == ("a",)
    deltas = scheduler.update_from_output(output, {"b": 2004, "c": 3001, "d": 4000})
    assert [(delta.request_id, delta.new_token_ids) for delta in deltas] == [
        ("b", (2004,)),
        ("c", (3001,)),
        ("d", (4000,)),
    ]
    assert request_c.output_token_ids == [3000, 3001]
    assert request_c.status is RequestStatus.RUNNING
    for request_id in ("b", "c", "d"):
        scheduler.abort(request_id)
    assert_no_block_in_use(scheduler)


def test_request_preempts_itself_when_it_is_the_latest() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    add(scheduler, "a", range(100, 108))
    add(scheduler, "b", range(200, 208))
    add(scheduler, "c", range(300, 308))
    add(scheduler, "d", range(400, 408))  # 2 full blocks each: the pool is now full
    output = scheduler.schedule()
    assert [item.block_table for item in output.scheduled] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    scheduler.update_from_output(output, {"a": 1, "b": 2, "c": 3, "d": 4})

    # Every request needs a 3rd block. "a" preempts "d" (blocks 7 6 freed), "b" takes
    # block 6, and "c", now the latest, preempts itself (5 4 freed); the loop ends there.
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [
        ("a", (1,), 8, (0, 1, 7), True),
        ("b", (2,), 8, (2, 3, 6), True),
    ]
    assert output.preempted_request_ids == ("d", "c")
    assert free_list(scheduler) == [5, 4]
    # Each victim went to the front, so the earlier-admitted "c" resumes first.
    assert [request.request_id for request in scheduler.waiting] == ["c", "d"]
    assert scheduler.num_preemptions == 2
    for request_id in ("a", "b", "c", "d"):
        scheduler.abort(request_id)
    assert_no_block_in_use(scheduler)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_does_not_change_generated_tokens(enable_prefix_caching: bool) -> None:
    prompts = {
        "a": list(range(10, 21)),
        "b": list(range(30, 37)),
        "c": list(range(10, 19)),  # shares a cached block with "a"
        "d": list(range(50, 55)),
    }

    def generate(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make_scheduler(
            num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        )
        for request_id, prompt in prompts.items():
            add(scheduler, request_id, prompt, max_tokens=12)
        outputs = run_to_completion(scheduler)
        assert_no_block_in_use(scheduler)
        return outputs, scheduler.num_preemptions

    reference, num_preemptions = generate(num_blocks=64)
    assert num_preemptions == 0
    outputs, num_preemptions = generate(num_blocks=NUM_BLOCKS)
    assert num_preemptions > 0
    assert outputs == reference
    assert all(len(tokens) == 12 for tokens in outputs.values())


# ------------------------------------------------------------------------------ aborts


def test_abort_waiting_request() -> None:
    scheduler = make_scheduler()
    add(scheduler, "r", [1, 2, 3])
    delta = scheduler.abort("r")
    assert delta == RequestDelta("r", (), RequestStatus.FINISHED_ABORTED, "abort", 3, 0)
    assert delta.finished
    assert not scheduler.has_unfinished_requests()
    assert scheduler.abort("r") is None
    output = scheduler.schedule()
    assert output.scheduled == ()
    assert output.finished_request_ids == ("r",)
    assert not output.is_empty
    assert scheduler.schedule().is_empty
    assert_no_block_in_use(scheduler)


def test_abort_running_request_frees_blocks_now() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "r", range(9))
    scheduler.update_from_output(scheduler.schedule(), {"r": 70})
    assert scheduler.kv_cache_manager.get_block_ids("r") == [0, 1, 2]
    delta = scheduler.abort("r")
    assert delta == RequestDelta("r", (), RequestStatus.FINISHED_ABORTED, "abort", 9, 1)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.num_running == 0
    assert free_list(scheduler) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert_no_block_in_use(scheduler)


def test_abort_preempted_request() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    add(scheduler, "a", range(100, 116))
    add(scheduler, "b", range(200, 216))
    scheduler.update_from_output(scheduler.schedule(), {"a": 1, "b": 2})
    output = scheduler.schedule()
    assert output.preempted_request_ids == ("b",)
    delta = scheduler.abort("b")
    assert delta is not None and delta.finish_reason == "abort"
    assert scheduler.num_waiting == 0
    scheduler.update_from_output(output, {"a": 3})
    scheduler.abort("a")
    assert_no_block_in_use(scheduler)


def test_abort_mid_chunked_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, "r", range(10))
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [("r", (0, 1, 2, 3), 0, (0,), False)]
    assert scheduler.update_from_output(output, {}) == []
    output = scheduler.schedule()
    assert [view(item) for item in output.scheduled] == [("r", (4, 5, 6, 7), 4, (0, 1), False)]
    delta = scheduler.abort("r")
    assert delta == RequestDelta("r", (), RequestStatus.FINISHED_ABORTED, "abort", 10, 0)
    assert scheduler.update_from_output(output, {}) == []
    assert_no_block_in_use(scheduler)


def test_abort_between_schedule_and_update_drops_the_sampled_token() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", [1, 2])
    add(scheduler, "b", [3, 4])
    output = scheduler.schedule()
    scheduler.abort("a")
    deltas = scheduler.update_from_output(output, {"a": 9, "b": 8})
    assert [(delta.request_id, delta.new_token_ids) for delta in deltas] == [("b", (8,))]
    # A new request reusing the aborted id is not confused with the stale output.
    add(scheduler, "a", [5, 6])
    assert scheduler.update_from_output(output, {"a": 9, "b": 8}) == []
    assert scheduler.requests["a"].output_token_ids == []
    assert scheduler.requests["b"].output_token_ids == [8]
    scheduler.abort("a")
    scheduler.abort("b")
    assert_no_block_in_use(scheduler)


def test_finish_request_stops_a_running_request() -> None:
    scheduler = make_scheduler()
    add(scheduler, "r", [1, 2, 3])
    scheduler.update_from_output(scheduler.schedule(), {"r": 11})
    delta = scheduler.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert delta == RequestDelta("r", (), RequestStatus.FINISHED_STOPPED, "stop", 3, 1)
    assert scheduler.finish_request("r", RequestStatus.FINISHED_STOPPED) is None
    assert scheduler.finish_request("unknown", RequestStatus.FINISHED_LENGTH) is None
    assert scheduler.schedule().finished_request_ids == ("r",)
    assert_no_block_in_use(scheduler)


def test_finish_request_needs_a_finished_status() -> None:
    scheduler = make_scheduler()
    add(scheduler, "r", [1, 2, 3])
    with pytest.raises(ValueError, match="needs a FINISHED_\\* status, got RUNNING"):
        scheduler.finish_request("r", RequestStatus.RUNNING)
    assert scheduler.has_unfinished_requests()
    scheduler.abort("r")
    assert_no_block_in_use(scheduler)


# ------------------------------------------------------------------------ stop rules


@pytest.mark.parametrize(
    ("params", "eos_token_ids", "sampled", "expected_outputs", "finish_reason"),
    [
        # A stop token ends generation and is part of the output.
        ({"stop_token_ids": [7]}, (), [5, 7, 9], [5, 7], "stop"),
        # Stop tokens win over max_tokens on the same token.
        ({"stop_token_ids": [7], "max_tokens": 2}, (), [5, 7], [5, 7], "stop"),
        ({"max_tokens": 3}, (), [5, 6, 8, 9], [5, 6, 8], "length"),
        ({}, (2,), [5, 2, 9], [5, 2], "stop"),
        ({"ignore_eos": True, "max_tokens": 3}, (2,), [2, 2, 2, 9], [2, 2, 2], "length"),
        # ignore_eos does not disable explicit stop tokens.
        ({"ignore_eos": True, "stop_token_ids": [2]}, (2,), [5, 2], [5, 2], "stop"),
    ],
)
def test_stop_conditions(
    params: dict[str, object],
    eos_token_ids: tuple[int, ...],
    sampled: list[int],
    expected_outputs: list[int],
    finish_reason: str,
) -> None:
    scheduler = make_scheduler()
    add(scheduler, "r", [1, 2, 3], eos_token_ids, **params)
    deltas: list[RequestDelta] = []
    for token in sampled:
        if not scheduler.has_unfinished_requests():
            break
        deltas.extend(scheduler.update_from_output(scheduler.schedule(), {"r": token}))
    assert [delta.new_token_ids[0] for delta in deltas] == expected_outputs
    assert [delta.finish_reason for delta in deltas] == [None] * (len(deltas) - 1) + [finish_reason]
    assert deltas[-1].finished
    assert deltas[-1].num_output_tokens == len(expected_outputs)
    assert not scheduler.has_unfinished_requests()
    assert_no_block_in_use(scheduler)


def test_max_model_len_ends_generation() -> None:
    scheduler = make_scheduler(max_model_len=8)
    add(scheduler, "r", range(6), max_tokens=100)
    first = scheduler.update_from_output(scheduler.schedule(), {"r": 40})
    second = scheduler.update_from_output(scheduler.schedule(), {"r": 41})
    assert first == [RequestDelta("r", (40,), RequestStatus.RUNNING, None, 6, 1)]
    assert second == [RequestDelta("r", (41,), RequestStatus.FINISHED_LENGTH, "length", 6, 2)]
    assert_no_block_in_use(scheduler)


def test_missing_sampled_token_is_an_error() -> None:
    scheduler = make_scheduler()
    add(scheduler, "r", [1, 2])
    with pytest.raises(KeyError, match="no sampled token for request 'r'"):
        scheduler.update_from_output(scheduler.schedule(), {})


def test_schedule_ahead_decodes_the_token_still_being_sampled() -> None:
    """Asynchronous scheduling: step 2 is planned before step 1's token is back. The position
    of that token is scheduled (its id is filled in on the device), and the updates, applied in
    order, append each token once."""
    scheduler = make_scheduler()
    request = add(scheduler, "r", [1, 2, 3, 4])
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [view(item) for item in second.scheduled] == [("r", (UNKNOWN,), 4, (0, 1), True)]
    assert request.num_output_placeholders == 2
    assert (request.num_computed_tokens, request.num_tokens) == (5, 4)
    assert [d.new_token_ids for d in scheduler.update_from_output(first, {"r": 7})] == [(7,)]
    third = scheduler.schedule()
    assert [view(item) for item in third.scheduled] == [("r", (UNKNOWN,), 5, (0, 1), True)]
    scheduler.update_from_output(second, {"r": 8})
    scheduler.update_from_output(third, {"r": 9})
    assert request.output_token_ids == [7, 8, 9]
    assert request.num_output_placeholders == 0
    # Applying an output twice is a no-op: its samples were consumed.
    assert scheduler.update_from_output(third, {"r": 9}) == []
    scheduler.abort("r")
    assert_no_block_in_use(scheduler)


def test_schedule_ahead_stops_at_the_last_token() -> None:
    """The token in flight is the last one max_tokens allows: nothing more is scheduled for it,
    and a token sampled in a step planned before a stop is dropped."""
    scheduler = make_scheduler()
    add(scheduler, "short", [1, 2], max_tokens=1)
    add(scheduler, "eos", [5, 6], eos_token_ids=[0])
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [item.request_id for item in second.scheduled] == ["eos"]
    deltas = scheduler.update_from_output(first, {"short": 3, "eos": 0})
    assert [(d.request_id, d.finish_reason) for d in deltas] == [
        ("short", "length"),
        ("eos", "stop"),
    ]
    assert scheduler.update_from_output(second, {"eos": 9}) == []
    assert not scheduler.has_unfinished_requests()
    assert_no_block_in_use(scheduler)


def test_preempted_with_a_token_in_flight_resumes_once_it_is_back() -> None:
    """A request preempted while its token is being sampled still gets that token (it was
    sampled from its whole context) and is re-admitted only then, with every id known."""
    scheduler = make_scheduler(num_blocks=3, max_model_len=12)
    add(scheduler, "a", [1, 2, 3, 4])
    b = add(scheduler, "b", [5, 6, 7, 8])
    first = scheduler.schedule()  # a: blocks 0, b: block 1
    # Both decode into a second block each, but one block is left: b (the latest) is preempted.
    second = scheduler.schedule()
    assert second.preempted_request_ids == ("b",)
    assert [view(item) for item in second.scheduled] == [("a", (UNKNOWN,), 4, (0, 2), True)]
    assert b.num_output_placeholders == 1 and b.status is RequestStatus.PREEMPTED
    scheduler.abort("a")
    assert scheduler.schedule().scheduled == ()  # blocks are free, but b's token is not back
    scheduler.update_from_output(first, {"a": 10, "b": 20})
    assert b.output_token_ids == [20] and b.num_output_placeholders == 0
    resumed = scheduler.schedule()
    # Its first block is a prefix-cache hit; the token that came back is computed.
    assert [view(item) for item in resumed.scheduled] == [("b", (20,), 4, (1, 2), True)]
    scheduler.update_from_output(second, {"a": 11})  # a was aborted: dropped
    scheduler.update_from_output(resumed, {"b": 21})
    assert b.output_token_ids == [20, 21]
    scheduler.abort("b")
    assert_no_block_in_use(scheduler)


# ----------------------------------------------------------------------- invariants
# Prompts and options are checked where they enter (LLMEngine.process_prompt, EngineConfig); the
# scheduler asserts what it relies on, so a caller that skips those checks fails loudly here.


def test_add_request_asserts_its_invariants() -> None:
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "dup", [1])
    with pytest.raises(AssertionError, match="request id 'dup' is already in use"):
        add(scheduler, "dup", [2])
    with pytest.raises(AssertionError, match="request 'empty' has 0 prompt tokens"):
        add(scheduler, "empty", [])
    with pytest.raises(AssertionError, match="has 16 prompt tokens \\(max_model_len 16\\)"):
        add(scheduler, "long", range(16))
    add(scheduler, "longest", range(15))
    finished = Request("old", [1], SamplingParams())
    finished.status = RequestStatus.FINISHED_STOPPED
    with pytest.raises(AssertionError, match="request 'old' is not new"):
        scheduler.add_request(finished)
    assert sorted(scheduler.requests) == ["dup", "longest"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be an int >= 1, got 0"),
        ({"block_size": 0}, "block_size must be an int >= 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1, got 0"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be an int >= 1, got -1"),
        ({"max_model_len": 2.0}, "2.0"),
        ({"max_num_seqs": True}, "max_num_seqs must be an int >= 1, got True"),
        ({"enable_prefix_caching": 1}, "1"),
        (
            {"max_model_len": 33},
            "the KV cache has 8 blocks of 4 tokens, but one request of max_model_len=33 "
            "tokens needs 9",
        ),
    ],
)
def test_scheduler_config_asserts_its_invariants(
    overrides: dict[str, object], message: str
) -> None:
    settings: dict[str, object] = {
        "num_blocks": 8,
        "block_size": 4,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 16,
        "max_model_len": 32,
        "enable_prefix_caching": True,
    }
    settings.update(overrides)
    with pytest.raises(AssertionError, match=message):
        SchedulerConfig(**settings)  # type: ignore[arg-type]


def test_empty_schedule() -> None:
    scheduler = make_scheduler()
    output = scheduler.schedule()
    assert output.output == SchedulerOutput(1, (), CachedRequestData(), {}, 0, (), ())
    assert output.is_empty
    assert scheduler.update_from_output(output, {}) == []
    assert not scheduler.has_unfinished_requests()


def test_prefill_takes_its_share_or_the_cap_only_while_streams_decode() -> None:
    scheduler = make_scheduler(
        max_prefill_tokens_while_decoding=3, max_num_batched_tokens=12, num_blocks=16
    )
    for name, prompt in zip("abcd", ([1, 2], [3, 4], [5, 6], [7, 8]), strict=True):
        add(scheduler, name, prompt)
    # Nobody decodes yet: the whole budget.
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == 8
    scheduler.update_from_output(output, dict(zip("abcd", (10, 11, 12, 13), strict=True)))
    add(scheduler, "long", list(range(20, 30)))
    # 4 streams decode, 1 prompt wants in: its share, 12 x 1/5, is under the cap, so 3 tokens.
    output = scheduler.schedule()
    assert [(i.request_id, i.token_ids) for i in output.scheduled] == [
        ("a", (10,)), ("b", (11,)), ("c", (12,)), ("d", (13,)), ("long", (20, 21, 22)),
    ]  # fmt: skip
    scheduler.update_from_output(output, dict(zip("abcd", (14, 15, 16, 17), strict=True)))
    add(scheduler, "next", [40, 41])
    # 2 prompts want in: their share is 12 x 2/6 = 4 tokens, all to the running chunk first.
    output = scheduler.schedule()
    assert [(i.request_id, i.token_ids) for i in output.scheduled][4:] == [
        ("long", (23, 24, 25, 26)),
    ]
    assert scheduler.num_waiting == 1
    for name in "abcd":
        scheduler.abort(name)
    scheduler.update_from_output(output, {})
    # Nobody decodes any more: uncapped.
    output = scheduler.schedule()
    assert [(i.request_id, i.token_ids) for i in output.scheduled] == [
        ("long", (27, 28, 29)),
        ("next", (40, 41)),
    ]
    scheduler.abort("long")
    scheduler.abort("next")
    assert_no_block_in_use(scheduler)


def test_a_request_waiting_for_its_grammar_is_passed_by_until_it_is_ready() -> None:
    scheduler = make_scheduler()
    grammar = Request("g", [1, 2, 3], SamplingParams(max_tokens=4), waiting_for_grammar=True)
    scheduler.add_request(grammar)
    assert scheduler.only_grammars_awaited() and scheduler.num_waiting == 1
    assert scheduler.schedule().scheduled == ()  # nothing to do until it has compiled
    add(scheduler, "free", [4, 5])
    assert not scheduler.only_grammars_awaited()
    assert [item.request_id for item in scheduler.schedule().scheduled] == ["free"]
    assert [r.request_id for r in scheduler.waiting] == ["g"]
    scheduler.grammar_ready("g")
    scheduler.grammar_ready("unknown")  # (aborted meanwhile: nothing to do)
    output = scheduler.schedule()
    assert [item.request_id for item in output.scheduled] == ["free", "g"]
    assert grammar.status == RequestStatus.RUNNING
    # Aborted while its grammar compiles, a request leaves the queue at once.
    add(scheduler, "x", [7])
    late = Request("late", [8, 9], SamplingParams(max_tokens=4), waiting_for_grammar=True)
    scheduler.add_request(late)
    scheduler.abort("late")
    assert late.status == RequestStatus.FINISHED_ABORTED and late not in scheduler.waiting


def test_an_encoder_request_holds_its_encoder_blocks_from_admission_to_its_end() -> None:
    """Encoder-decoder requests (Whisper): blocks for the encoder's cross-attention are taken at
    admission besides the decoder's slots, cost the step's token budget (one admission a step at
    least), are sent to the runner with the input once, and are freed on preemption (which
    recomputes, encoder included) and at the end."""
    config = SchedulerConfig(
        num_blocks=12, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=64,
        max_model_len=32, enable_prefix_caching=False, encoder_blocks=3, encoder_tokens=40,
    )  # fmt: skip
    scheduler = Scheduler(config)  # (the plain outputs: the mirror does not know encoders)
    first = Request("a", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True),
                    encoder_input=b"audio-a")  # fmt: skip
    second = Request("b", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True),
                     encoder_input=b"audio-b")  # fmt: skip
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()  # 64 tokens: 2 + 40 for the first, not 40 more for the second
    (new,) = output.new_requests
    assert (new.request_id, new.encoder_input, len(new.encoder_block_ids)) == ("a", b"audio-a", 3)
    assert output.total_num_scheduled_tokens == 2
    kv = scheduler.kv_cache_manager
    assert kv.num_used_blocks == 3 + 1
    assert scheduler.kv_map()["requests"][0]["encoder_block_ids"] == list(new.encoder_block_ids)
    scheduler.update_from_output(output, {"a": 9})
    output = scheduler.schedule()
    assert [n.request_id for n in output.new_requests] == ["b"]
    assert kv.num_used_blocks == 2 * (3 + 1)
    # Growing past the pool preempts the later one: both its kinds of blocks go back.
    for _ in range(40):
        sampled = {rid: 9 for rid in output.num_scheduled_tokens if rid in scheduler.requests}
        scheduler.update_from_output(output, sampled)
        if second.num_preemptions:
            break
        output = scheduler.schedule()
    assert second.num_preemptions == 1 and kv.encoder_block_ids("b") == []
    assert all("b" not in owners for owners in kv.block_owners().values())
    assert kv.num_used_blocks == 3 + len(kv.get_block_ids("a"))
    # Readmitted, it is encoded again.
    while not any(n.request_id == "b" for n in output.new_requests):
        sampled = {rid: 9 for rid in output.num_scheduled_tokens if rid in scheduler.requests}
        scheduler.update_from_output(output, sampled)
        output = scheduler.schedule()
    (again,) = [n for n in output.new_requests if n.request_id == "b"]
    assert again.encoder_input == b"audio-b" and len(again.encoder_block_ids) == 3
    scheduler.abort("a")
    scheduler.abort("b")
    assert kv.num_used_blocks == 0
    with pytest.raises(AssertionError, match="cannot use the prefix cache"):
        make_scheduler(encoder_blocks=3, encoder_tokens=40)
