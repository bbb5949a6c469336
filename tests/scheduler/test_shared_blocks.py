"""Blocks shared through ref counts: the samples of one prompt fork the first one's blocks, the
first write into a shared block copies it (copy-on-write), and rewind gives blocks back. Ref
counts, copies and block tables are asserted step by step on a plain scheduler."""

from __future__ import annotations

import pytest

from pagedserve.scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

BLOCK = 4


def _scheduler(num_blocks: int = 32, max_num_seqs: int = 8, **changes) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            max_model_len=64,
            enable_prefix_caching=changes.pop("enable_prefix_caching", True),
        )
    )


def _add_group(scheduler: Scheduler, prompt: list[int], n: int, max_tokens: int) -> list[Request]:
    requests = []
    for k in range(n):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=k)
        request = Request(f"s{k}", prompt, params)
        scheduler.add_request(request, fork_parent=requests[0] if requests else None)
        requests.append(request)
    return requests


def _step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = {rid: token for rid in out.num_scheduled_tokens if _samples(scheduler, out, rid)}
    scheduler.update_from_output(out, sampled)
    return out


def _samples(scheduler: Scheduler, out, request_id: str) -> bool:
    return any(r.request_id == request_id for r in scheduler._sampling.get(out.step_id, ()))


def test_four_samples_share_the_prompt_and_copy_the_partial_block_once_each():
    scheduler = _scheduler()
    kv = scheduler.kv_cache_manager
    prompt = list(range(10, 20))  # 10 tokens: the samples share the first 9, in 3 blocks
    s0, s1, s2, s3 = _add_group(scheduler, prompt, n=4, max_tokens=8)
    assert scheduler.num_waiting == 4 and scheduler.waiting[0] is s0

    # Step 1: sample 0 computes the prompt; the others wait attached to it.
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"s0": 10}
    b0, b1, b2 = table = kv.get_block_ids("s0")
    assert kv.ref_counts("s0") == [1, 1, 1] and out.block_copies == ()
    assert [r.fork_parent for r in (s1, s2, s3)] == [s0] * 3
    scheduler.update_from_output(out, {"s0": 7})
    # Its token came back: the others forked its 3 blocks (positions 0..8) and run.
    assert [r.status for r in (s1, s2, s3)] == [RequestStatus.RUNNING] * 3
    for sample in (s1, s2, s3):
        assert kv.get_block_ids(sample.request_id) == table
        assert sample.num_computed_tokens == 9
    assert kv.ref_counts("s0") == [4, 4, 4]
    assert kv.num_used_blocks == 3

    # Step 2: sample 0 writes position 10 and the others position 9, all into the shared third
    # block: the first three to write get a copy each, the last one keeps it.
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"s0": 1, "s1": 1, "s2": 1, "s3": 1}
    assert [new.request_id for new in out.new_requests] == ["s1", "s2", "s3"]
    copies = out.block_copies
    assert [(rid, index, src) for rid, index, src, _ in copies] == [
        ("s0", 2, b2),
        ("s1", 2, b2),
        ("s2", 2, b2),
    ]
    c0, c1, c2 = (dst for *_, dst in copies)
    assert len({b0, b1, b2, c0, c1, c2}) == 6
    assert kv.get_block_ids("s0") == [b0, b1, c0]
    assert [new.block_ids for new in out.new_requests] == [(b0, b1, c1), (b0, b1, c2), (b0, b1, b2)]
    assert kv.ref_counts("s3") == [4, 4, 1] and kv.ref_counts("s0") == [4, 4, 1]
    assert kv.num_used_blocks == 6 and kv.num_block_copies == 3

    # Later steps write only blocks of their own: no more copies.
    for _ in range(3):
        assert _step(scheduler).block_copies == ()
    # Position 12 opened a fourth block, of its own, for each.
    assert [kv.ref_counts(f"s{k}") for k in range(4)] == [[4, 4, 1, 1]] * 4

    # An abort gives back the sample's own blocks and one reference to the shared ones.
    scheduler.abort("s1")
    assert kv.ref_counts("s0")[:2] == [3, 3]
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_total_blocks
    assert kv.num_block_copies == 3


def test_a_shared_prefix_of_whole_blocks_needs_no_copy():
    scheduler = _scheduler(enable_prefix_caching=False)
    kv = scheduler.kv_cache_manager
    _add_group(scheduler, list(range(10, 19)), n=3, max_tokens=4)  # 9 tokens: 8 shared, 2 blocks
    _step(scheduler)
    assert kv.ref_counts("s1") == [3, 3]
    out = _step(scheduler)
    assert out.block_copies == ()  # position 8 opens the third block, one per sample
    assert [kv.ref_counts(f"s{k}") for k in range(3)] == [[3, 3, 1]] * 3
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert kv.num_used_blocks == 0


def test_samples_fork_as_sequence_slots_free_up():
    scheduler = _scheduler(max_num_seqs=2)
    kv = scheduler.kv_cache_manager
    s0, s1, s2 = _add_group(scheduler, list(range(10, 16)), n=3, max_tokens=3)
    _step(scheduler)
    # One slot was free: sample 1 forked, sample 2 waits for another token of sample 0.
    assert (s1.status, s2.fork_parent) == (RequestStatus.RUNNING, s0)
    assert scheduler.num_waiting == 1 and kv.ref_counts("s0") == [2, 2]
    while s2.fork_parent is not None:
        _step(scheduler)
    # Sample 0 finished with its third token and handed over: sample 2 computes alone.
    assert s0.is_finished and s2 in scheduler.waiting and s2.num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert len(s2.output_token_ids) == 3 and kv.num_used_blocks == 0


def test_samples_of_an_aborted_parent_compute_their_prompt_alone():
    scheduler = _scheduler()
    s0, s1, s2 = _add_group(scheduler, list(range(10, 16)), n=3, max_tokens=2)
    scheduler.abort("s0")  # before its prompt ran
    assert list(scheduler.waiting) == [s1, s2] and s1.fork_parent is None
    scheduler.abort("s2")  # queued, not attached any more
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"s1": 6}
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert len(s1.output_token_ids) == 2 and scheduler.kv_cache_manager.num_used_blocks == 0


def test_an_attached_sample_can_be_aborted():
    scheduler = _scheduler()
    s0, s1, s2 = _add_group(scheduler, list(range(10, 16)), n=3, max_tokens=2)
    scheduler.abort("s1")
    assert s0.fork_children == [s2] and scheduler.num_waiting == 2
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert [len(r.output_token_ids) for r in (s0, s1, s2)] == [2, 0, 2]


def test_rewind_frees_the_blocks_past_the_new_end_and_recomputes_one_token():
    scheduler = _scheduler()
    kv = scheduler.kv_cache_manager
    request = Request("r", list(range(10, 16)), SamplingParams(max_tokens=30, ignore_eos=True))
    scheduler.add_request(request)
    for _ in range(21):
        _step(scheduler)
    # 6 prompt + 21 outputs = 27 tokens, 26 computed: 7 blocks.
    assert (request.num_tokens, request.num_computed_tokens, len(kv.get_block_ids("r"))) == (
        27,
        26,
        7,
    )
    free_before = kv.num_free_blocks
    assert scheduler.rewind("r", 8) == 13
    # 19 tokens left; the 19th is computed again for its logits: 18 kept, in 5 blocks.
    assert (request.num_tokens, request.num_computed_tokens) == (19, 18)
    assert len(kv.get_block_ids("r")) == 5 and kv.num_free_blocks == free_before + 2
    out = scheduler.schedule()
    assert out.preempted_request_ids == ("r",)  # the runner drops its row...
    assert [new.request_id for new in out.new_requests] == ["r"]  # ...and gets it in full
    assert out.new_requests[0].num_computed_tokens == 18
    assert out.num_scheduled_tokens == {"r": 1}
    with pytest.raises(ValueError, match="it has 13 output tokens"):
        scheduler.rewind("r", 14)
    with pytest.raises(ValueError, match="unknown or finished"):
        scheduler.rewind("nope", 1)
