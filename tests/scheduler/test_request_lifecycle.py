from __future__ import annotations

import pytest

from pagedserve.scheduler import Request, RequestStatus, SamplingParams


@pytest.mark.parametrize(
    ("status", "is_finished", "finish_reason"),
    [
        (RequestStatus.WAITING, False, None),
        (RequestStatus.RUNNING, False, None),
        (RequestStatus.PREEMPTED, False, None),
        (RequestStatus.FINISHED_STOPPED, True, "stop"),
        (RequestStatus.FINISHED_LENGTH, True, "length"),
        (RequestStatus.FINISHED_ABORTED, True, "abort"),
    ],
)
def test_status_finished_and_reason(
    status: RequestStatus, is_finished: bool, finish_reason: str | None
) -> None:
    assert status.is_finished is is_finished
    assert status.finish_reason == finish_reason
    assert (status > RequestStatus.PREEMPTED) is is_finished


def test_new_request_state() -> None:
    prompt = [5, 6, 7]
    request = Request("r", prompt, SamplingParams(), eos_token_ids=[2, 2, 9], arrival_time=1.5)
    prompt.append(99)  # the request keeps its own copy
    assert request.prompt_token_ids == [5, 6, 7]
    assert request.all_token_ids == [5, 6, 7]
    assert request.output_token_ids == []
    assert request.eos_token_ids == frozenset({2, 9})
    assert request.status is RequestStatus.WAITING
    assert (request.num_computed_tokens, request.num_preemptions) == (0, 0)
    assert request.arrival_time == 1.5
    assert (request.num_prompt_tokens, request.num_output_tokens, request.num_tokens) == (3, 0, 3)
    assert not request.is_finished
    assert request.finish_reason is None


def test_append_output_keeps_all_token_ids_in_sync() -> None:
    request = Request("r", [1, 2], SamplingParams())
    request.append_output_token_ids(3)
    request.append_output_token_ids([4, 5])
    assert request.output_token_ids == [3, 4, 5]
    assert request.all_token_ids == [1, 2, 3, 4, 5]
    assert request.prompt_token_ids == [1, 2]
    assert (request.num_output_tokens, request.num_tokens) == (3, 5)


def test_finished_request_reports_reason() -> None:
    request = Request("r", [1], SamplingParams())
    request.status = RequestStatus.FINISHED_LENGTH
    assert request.is_finished
    assert request.finish_reason == "length"
