"""Randomised scheduler runs against a simulated paged KV cache and a deterministic model.

The "model" picks the next token as a function of the whole sequence, so a request's output
is fixed by its prompt and parameters: whatever the batching, chunking, prefix sharing or
preemption, a request that finishes by itself must produce exactly the reference output.
The simulated runner writes, per scheduled token, a fingerprint of the prefix it ends into
the token's KV slot, then checks that every live request reads back its own prefix through
its block table: a wrong block id, a shared block written twice or a block freed while in
use shows up as a fingerprint mismatch.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.scheduler import (
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tests.scheduler.mirror import UNKNOWN, ExpandedOutput, MirroredScheduler

VOCAB_SIZE = 16
EOS_TOKEN_ID = 0
MIN_OPS = 1500


def model_token(token_ids: Sequence[int], seed: int | None = None) -> int:
    """Deterministic next token from the last tokens, the length and the request's seed (the
    samples of one prompt get different seeds, so that they diverge: a block one of them wrote
    in place while the others shared it would then hold the wrong fingerprints for them)."""
    last = token_ids[-1]
    before = token_ids[-2] if len(token_ids) > 1 else 3
    return (last * 5 + before * 3 + len(token_ids) + 7 * (seed or 0)) % VOCAB_SIZE


def next_token(request: Request) -> int:
    return model_token(request.all_token_ids, request.sampling_params.seed)


def prefix_fingerprints(token_ids: Sequence[int]) -> list[int]:
    """fingerprints[p] identifies token_ids[: p + 1] (what the KV at position p encodes)."""
    fingerprints = []
    running = 0
    for position, token_id in enumerate(token_ids):
        running = hash((running, position, token_id))
        fingerprints.append(running)
    return fingerprints


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    """Tokens the request generates when nothing truncates it, and how it finishes."""
    params = request.sampling_params
    token_ids = list(request.prompt_token_ids)
    output: list[int] = []
    while True:
        token_id = model_token(token_ids, params.seed)
        token_ids.append(token_id)
        output.append(token_id)
        if token_id in params.stop_token_ids:
            return output, RequestStatus.FINISHED_STOPPED
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return output, RequestStatus.FINISHED_STOPPED
        if len(output) >= params.max_tokens or len(token_ids) >= max_model_len:
            return output, RequestStatus.FINISHED_LENGTH


class Choices:
    """Source of random choices: a seeded Random or a hypothesis data stream."""

    def __init__(self, rng: random.Random | None = None, data: st.DataObject | None = None):
        self._rng = rng
        self._data = data

    def below(self, n: int) -> int:
        """An int in [0, n)."""
        if self._rng is not None:
            return self._rng.randrange(n)
        assert self._data is not None
        return self._data.draw(st.integers(0, n - 1))

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent


@dataclass
class Driver:
    """Runs random operations on a Scheduler and checks its invariants after each one."""

    choices: Choices
    enable_prefix_caching: bool
    schedule_ahead: bool = False
    swap: bool = False  # swap preemption, into a host pool of a random size
    in_flight: ExpandedOutput | None = None  # with schedule_ahead: planned, not yet applied
    written: dict[str, int] = field(default_factory=dict)  # positions whose KV was written
    # The table each request's last run step wrote through (a copy-on-write the scheduler has
    # decided since takes effect when the step that carries it runs).
    run_tables: dict[str, tuple[int, ...]] = field(default_factory=dict)
    scheduler: Scheduler = field(init=False)
    config: SchedulerConfig = field(init=False)
    kv_slots: dict[int, int] = field(default_factory=dict)  # slot -> prefix fingerprint
    host_slots: dict[int, int] = field(default_factory=dict)  # the host pool's, when swapping
    all_requests: dict[str, Request] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    truncated: set[str] = field(default_factory=set)  # aborted or finished early
    # Rewound since the last schedule(): taken out of the batch without being preempted.
    rewound: set[str] = field(default_factory=set)
    # Rewound while a step of theirs was in flight (schedule_ahead): its token is dropped, and
    # what it writes is not part of their prefix any more.
    rewound_in_flight: set[str] = field(default_factory=set)
    num_forked: int = 0  # samples released by their parent (most of them sharing its blocks)
    num_rewinds: int = 0
    shared_prefixes: list[list[int]] = field(default_factory=list)
    num_steps: int = 0
    num_ops: int = 0
    next_id: int = 0

    def __post_init__(self) -> None:
        pick = self.choices.below
        block_size = (1, 2, 4, 4)[pick(4)]
        max_model_len = 8 + pick(40)
        # Between one and two max-length sequences' worth of KV, so that requests compete.
        min_num_blocks = math.ceil(max_model_len / block_size)
        num_blocks = min_num_blocks + pick(min_num_blocks + 1)
        self.config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=(1, 4, 8, 16)[pick(4)],
            max_num_batched_tokens=(1, 3, 8, 16, 64)[pick(5)],
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            # From none to room for every victim: some preemptions swap, some recompute.
            num_host_blocks=pick(2 * num_blocks + 1) if self.swap else 0,
        )
        self.scheduler = MirroredScheduler(self.config)
        self.shared_prefixes = [
            [1 + pick(VOCAB_SIZE - 1) for _ in range(2 + pick(10))] for _ in range(3)
        ]

    # ----------------------------------------------------------------------- operations

    def random_op(self) -> None:
        roll = self.choices.below(100)
        if roll < 15:
            self.add()
        elif roll < 87:
            self.step()
        elif roll < 90:
            self.rewind_random_request()
        elif roll < 97:
            self.end_random_request(RequestStatus.FINISHED_ABORTED)
        else:
            self.end_random_request(RequestStatus.FINISHED_STOPPED)
        self.num_ops += 1
        self.check_state()

    def add(self) -> None:
        pick = self.choices.below
        max_prompt_len = self.config.max_model_len - 1
        prompt: list[int] = []
        if pick(2):
            prompt.extend(self.shared_prefixes[pick(3)])
        prompt.extend(1 + pick(VOCAB_SIZE - 1) for _ in range(pick(8)))
        prompt = prompt[:max_prompt_len] or [1 + pick(VOCAB_SIZE - 1)]
        params = SamplingParams(
            max_tokens=1 + pick(16),
            stop_token_ids=[pick(VOCAB_SIZE)] if self.choices.chance(30) else [],
            ignore_eos=self.choices.chance(30),
        )
        # Sometimes several samples of one prompt (n > 1): the first is their parent.
        num_samples = 1 + pick(4) if self.choices.chance(25) else 1
        parent = None
        for k in range(num_samples):
            request_id = f"req-{self.next_id}"
            self.next_id += 1
            request = Request(
                request_id, prompt, params.clone(seed=k), eos_token_ids=[EOS_TOKEN_ID]
            )
            self.scheduler.add_request(request, fork_parent=parent)
            parent = parent or request
            self.all_requests[request_id] = request
            self.outputs[request_id] = []

    def rewind_random_request(self) -> None:
        scheduler = self.scheduler
        live = sorted(
            rid for rid, request in scheduler.requests.items() if request.output_token_ids
        )
        if not live:
            return
        request_id = live[self.choices.below(len(live))]
        request = scheduler.requests[request_id]
        in_flight = self.in_flight is not None and any(
            item.request_id == request_id for item in self.in_flight.scheduled
        )
        num_tokens = 1 + self.choices.below(len(request.output_token_ids))
        left = scheduler.rewind(request_id, num_tokens)
        del self.outputs[request_id][-num_tokens:]
        assert left == len(request.output_token_ids) == len(self.outputs[request_id])
        assert request.output_token_ids == self.outputs[request_id]
        assert request.num_output_placeholders == 0
        self.written[request_id] = min(self.written.get(request_id, 0), request.num_computed_tokens)
        self.rewound.add(request_id)
        if in_flight:
            self.rewound_in_flight.add(request_id)
        self.num_rewinds += 1

    def end_random_request(self, status: RequestStatus) -> None:
        live = sorted(self.scheduler.requests)
        if not live:
            return
        request_id = live[self.choices.below(len(live))]
        delta = self.scheduler.finish_request(request_id, status)
        assert delta is not None
        assert delta.new_token_ids == ()
        assert delta.status is status
        assert request_id not in self.scheduler.requests
        assert self.scheduler.kv_cache_manager.get_block_ids(request_id) == []
        self.truncated.add(request_id)

    def step(self, allow_abort: bool = True) -> None:
        """One engine step. With `schedule_ahead` (asynchronous scheduling) the step plans
        step N + 1 and then applies step N, whose tokens the model computes only now that all
        of their context is known, as a device filling in placeholders would."""
        scheduler = self.scheduler
        waiting_before = {request.request_id for request in scheduler.waiting}
        # Forked since the last step (by update_from_output), not yet sent to the runner.
        forked_before = {
            request.request_id
            for request in scheduler.running
            if request.send_in_full and not request.output_token_ids
        }
        attached_before = [
            child for parent in scheduler.requests.values() for child in parent.fork_children
        ]
        output = scheduler.schedule()
        self.num_steps += 1
        self.check_output(output, waiting_before)
        self.rewound.clear()
        # Until its step runs, a (re)admitted request reads nothing (its prefix-cache hit may
        # be written by a step still in flight).
        for request_id in (*output.preempted_request_ids, *waiting_before, *forked_before):
            self.written[request_id] = 0
            self.run_tables.pop(request_id, None)
        dropped: set[str] = set()
        if self.schedule_ahead:
            # (A step of swap-outs alone still runs, as the engine launches every step.)
            runs = output.scheduled or output.output.swap_out
            output, self.in_flight = self.in_flight, output if runs else None
            dropped, self.rewound_in_flight = self.rewound_in_flight, set()
            if output is None:
                return
        self.run_model(output, dropped)

        sampled = {
            item.request_id: next_token(self.all_requests[item.request_id])
            for item in output.scheduled
            if item.sample
        }
        # Sometimes the client goes away while the model runs: its token is dropped.
        if allow_abort and output.scheduled and self.choices.chance(5):
            aborted = output.scheduled[self.choices.below(len(output.scheduled))]
            if scheduler.abort(aborted.request_id) is not None:
                self.truncated.add(aborted.request_id)
        # Requests finished since the step was planned get no token.
        expected_ids = [
            item.request_id
            for item in output.scheduled
            if item.sample and item.request_id in scheduler.requests
            and item.request_id not in dropped
        ]  # fmt: skip

        deltas = scheduler.update_from_output(output, sampled)
        assert [delta.request_id for delta in deltas] == expected_ids
        self.num_forked += sum(child.fork_parent is None for child in attached_before)
        for delta in deltas:
            request = self.all_requests[delta.request_id]
            assert delta.new_token_ids == (sampled[delta.request_id],)
            self.outputs[delta.request_id].append(sampled[delta.request_id])
            assert request.output_token_ids == self.outputs[delta.request_id]
            assert delta.num_output_tokens == request.num_output_tokens
            assert delta.status is request.status
            assert delta.finished == (delta.request_id not in scheduler.requests)

    def drain(self) -> None:
        """Step until every request is finished (no random choices: nothing is aborted)."""
        for _ in range(10_000):
            if not self.scheduler.has_unfinished_requests() and self.in_flight is None:
                return
            self.step(allow_abort=False)
            self.check_state()
        raise AssertionError("scheduler did not drain")

    # ---------------------------------------------------------------------- the runner

    def run_model(self, output: ExpandedOutput, dropped: set[str] = frozenset()) -> None:
        """Write every scheduled token's KV, then check every scheduled request's reads.

        All writes come before any read, like a runner that writes the whole batch's KV
        before attention: a request may reuse a prefix block another request of the same
        step is computing.
        """
        block_size = self.config.block_size

        def copy_blocks(pairs, source_slots: dict[int, int], target_slots: dict[int, int]):
            for source, target in pairs:
                for offset in range(block_size):
                    value = source_slots.get(source * block_size + offset)
                    target_slots[target * block_size + offset] = value

        # Before the step, in the runner's order: swap-outs, copy-on-write, swap-ins.
        copy_blocks(output.output.swap_out, self.kv_slots, self.host_slots)
        copies = [(source, copy) for _, _, source, copy in output.output.block_copies]
        copy_blocks(copies, self.kv_slots, self.kv_slots)
        copy_blocks(output.output.swap_in, self.host_slots, self.kv_slots)
        for item in output.scheduled:
            request = self.all_requests[item.request_id]
            fingerprints = prefix_fingerprints(request.all_token_ids)
            for offset in range(len(item.token_ids)):
                position = item.start_position + offset
                block_id = item.block_table[position // block_size]
                # A request aborted before its placeholder's token came back computes garbage
                # there (nobody may read it).
                value = fingerprints[position] if position < len(fingerprints) else "garbage"
                self.kv_slots[block_id * block_size + position % block_size] = value
            if item.request_id not in dropped:
                self.written[item.request_id] = item.start_position + len(item.token_ids)
                self.run_tables[item.request_id] = item.block_table
        for item in output.scheduled:
            request = self.scheduler.requests.get(item.request_id)
            if request is not None:
                # A request rewound since the step was planned keeps only a shorter prefix.
                end = min(item.start_position + len(item.token_ids), request.num_computed_tokens)
                self.check_kv(item.request_id, item.block_table, end)

    def check_kv(self, request_id: str, block_table: Sequence[int], num_tokens: int) -> None:
        request = self.all_requests[request_id]
        fingerprints = prefix_fingerprints(request.all_token_ids[:num_tokens])
        block_size = self.config.block_size
        for position in range(num_tokens):
            slot = block_table[position // block_size] * block_size + position % block_size
            assert self.kv_slots.get(slot) == fingerprints[position], (request_id, position)

    # ---------------------------------------------------------------------- invariants

    def check_output(self, output: ExpandedOutput, waiting_before: set[str]) -> None:
        config = self.config
        kv = self.scheduler.kv_cache_manager
        assert output.num_scheduled_tokens == sum(len(item.token_ids) for item in output.scheduled)
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        scheduled_ids = [item.request_id for item in output.scheduled]
        assert len(set(scheduled_ids)) == len(scheduled_ids)
        # Running requests come first, newly admitted ones after them.
        is_new = [request_id in waiting_before for request_id in scheduled_ids]
        assert is_new == sorted(is_new)
        preempted = [rid for rid in output.preempted_request_ids if rid not in self.rewound]
        if preempted:
            assert not any(is_new)
        for item in output.scheduled:
            request = self.scheduler.requests[item.request_id]
            end = item.start_position + len(item.token_ids)
            assert request.status is RequestStatus.RUNNING
            assert len(item.token_ids) >= 1
            assert request.num_computed_tokens == end
            # Positions past the known tokens hold the ones still being sampled.
            known = request.all_token_ids[item.start_position : end]
            assert item.token_ids == (*known, *[UNKNOWN] * (end - item.start_position - len(known)))
            pending = request.num_output_placeholders
            # A chunk reaching the end of the tokens samples: one more placeholder.
            if item.sample:
                assert end + 1 == request.num_tokens + pending
            else:
                assert end < request.num_tokens + pending
            assert item.num_output_tokens == request.num_output_tokens + pending - item.sample
            assert len(item.block_table) == math.ceil(end / config.block_size)
            assert list(item.block_table) == kv.get_block_ids(item.request_id)
            assert item.sampling_params is request.sampling_params
        for request_id in preempted:
            request = self.scheduler.requests[request_id]
            assert request.status is RequestStatus.PREEMPTED
            # Swapped out: it keeps its progress; otherwise it recomputes.
            assert (request.num_computed_tokens > 0) == kv.is_swapped(request_id)
            assert request_id not in scheduled_ids
        assert not (output.output.swap_out and output.output.swap_in)
        swapped_out = [host for _, host in output.output.swap_out]
        assert len(set(swapped_out)) == len(swapped_out)
        copied = [copy for _, _, _, copy in output.output.block_copies]
        assert len(set(copied)) == len(copied)
        for request_id, index, source, copy in output.output.block_copies:
            assert kv.get_block_ids(request_id)[index] == copy != source

    def check_state(self) -> None:
        scheduler = self.scheduler
        config = self.config
        kv = scheduler.kv_cache_manager
        pool = kv.block_pool
        assert len(scheduler.running) <= config.max_num_seqs
        running_ids = [request.request_id for request in scheduler.running]
        waiting_ids = [request.request_id for request in scheduler.waiting]
        attached = [
            child for parent in scheduler.requests.values() for child in parent.fork_children
        ]
        attached_ids = [child.request_id for child in attached]
        assert sorted(running_ids + waiting_ids + attached_ids) == sorted(scheduler.requests)
        assert scheduler.num_waiting == len(waiting_ids) + len(attached_ids)
        assert scheduler.has_unfinished_requests() == bool(scheduler.requests)
        for child in attached:
            assert child in child.fork_parent.fork_children
            # (The parent may have a token already: one that came back while it was preempted.)
            assert child.fork_parent.request_id in scheduler.requests
            assert kv.get_block_ids(child.request_id) == [] and child.num_computed_tokens == 0

        occurrences: Counter[int] = Counter()
        for request in scheduler.running:
            assert request.status is RequestStatus.RUNNING
            # (A request rewound to its one-token prompt runs with nothing computed.)
            assert (
                (0 if request.send_in_full else 1)
                <= request.num_computed_tokens
                <= request.num_tokens + request.num_output_placeholders
            )
            assert request.num_output_placeholders <= (1 if self.schedule_ahead else 0)
            assert request.num_tokens < config.max_model_len or request.is_finished
            occurrences.update(self.check_table(request))
        num_swapped = 0
        for request in scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.get_block_ids(request.request_id) == []
            if kv.is_swapped(request.request_id):
                assert request.status is RequestStatus.PREEMPTED
                assert request.num_computed_tokens > 0
                num_swapped += kv.swapped_block_count(request.request_id)
            else:
                assert request.num_computed_tokens == 0
        assert kv.num_swapped_blocks == num_swapped

        for block in pool.blocks:
            assert block.ref_cnt == occurrences[block.block_id]
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash) is block
        free_ids = pool.free_block_ids()
        assert sorted(free_ids) == [b.block_id for b in pool.blocks if b.ref_cnt == 0]
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_total_blocks
        assert kv.num_used_blocks == len(occurrences)
        if not config.enable_prefix_caching:
            assert pool.num_cached_blocks == 0

    def check_table(self, request: Request) -> list[int]:
        """The request's table fits its progress, and its written prefix reads back right."""
        table = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        assert len(table) == len(set(table))
        assert len(table) == math.ceil(request.num_computed_tokens / self.config.block_size)
        # Every live request, scheduled this step or not, still finds its own prefix (as far as
        # the steps applied so far wrote it).
        written = min(request.num_computed_tokens, self.written.get(request.request_id, 0))
        self.check_kv(request.request_id, self.run_tables.get(request.request_id, table), written)
        return table

    def check_final(self) -> None:
        kv = self.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_total_blocks
        assert kv.num_used_blocks == 0
        assert kv.num_swapped_blocks == 0
        assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
        for request_id, request in self.all_requests.items():
            assert request.is_finished, request
            reference, status = reference_output(request, self.config.max_model_len)
            if request_id in self.truncated:
                assert reference[: len(self.outputs[request_id])] == self.outputs[request_id]
            else:
                assert self.outputs[request_id] == reference, request_id
                assert request.status is status, request_id


@pytest.mark.parametrize("schedule_ahead", [False, True], ids=["sync", "ahead"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_invariants(
    seed: int, enable_prefix_caching: bool, schedule_ahead: bool
) -> None:
    driver = Driver(Choices(rng=random.Random(seed)), enable_prefix_caching, schedule_ahead)
    while driver.num_ops < MIN_OPS:
        driver.random_op()
    driver.drain()
    driver.check_final()
    # The run must have exercised what it is meant to check.
    assert driver.num_steps > 300
    assert len(driver.all_requests) > 100
    # Enough requests ran to their natural end to check their outputs exactly.
    assert len(driver.all_requests) - len(driver.truncated) > 30
    # Samples forked their parent's blocks, some wrote into a shared one, requests rewound
    # (one sequence slot leaves no room for a fork, one token a block makes none partial).
    assert driver.num_forked > 5 and driver.num_rewinds > 5
    if driver.config.block_size > 1 and driver.config.max_num_seqs > 1:
        assert driver.scheduler.kv_cache_manager.num_block_copies > 0


@pytest.mark.parametrize("schedule_ahead", [False, True], ids=["sync", "ahead"])
# Seeds whose draws preempt (the others draw pools roomy enough not to); seed 4 draws a host
# pool of 4 blocks, too small for some victims, which then recompute.
@pytest.mark.parametrize("seed", [0, 2, 4])
def test_random_operations_with_swap_preemption(seed: int, schedule_ahead: bool) -> None:
    """Swapped-out blocks come back holding what the request wrote (the fingerprints are
    copied to the host pool and back, as the runner copies KV), whatever else ran meanwhile."""
    driver = Driver(Choices(rng=random.Random(seed)), True, schedule_ahead, swap=True)
    while driver.num_ops < MIN_OPS:
        driver.random_op()
        driver.check_state()
    driver.drain()
    driver.check_final()
    scheduler = driver.scheduler
    assert 0 < scheduler.num_swap_ins <= scheduler.num_swap_outs <= scheduler.num_preemptions
    if seed == 4:
        assert scheduler.num_swap_outs < scheduler.num_preemptions


def test_random_run_exercises_preemption_and_prefix_hits() -> None:
    # Seed 0 draws a pool of 9 blocks for 8 concurrent sequences: a run that never
    # preempted or never hit the prefix cache would leave those paths unchecked.
    driver = Driver(Choices(rng=random.Random(0)), enable_prefix_caching=True)
    while driver.num_ops < MIN_OPS:
        driver.random_op()
    driver.drain()
    assert driver.scheduler.num_preemptions > 0
    assert driver.scheduler.kv_cache_manager.num_prefix_cache_hits_tokens > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    enable_prefix_caching=st.booleans(),
    schedule_ahead=st.booleans(),
    swap=st.booleans(),
)
def test_hypothesis_operations_keep_invariants(
    data: st.DataObject, enable_prefix_caching: bool, schedule_ahead: bool, swap: bool
) -> None:
    driver = Driver(Choices(data=data), enable_prefix_caching, schedule_ahead, swap=swap)
    num_ops = data.draw(st.integers(1, 60))
    while driver.num_ops < num_ops:
        driver.random_op()
    driver.drain()
    driver.check_final()
