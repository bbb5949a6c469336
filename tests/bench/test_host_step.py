"""benchmarks.host_step runs a real engine (stubbed forward) and reports each part of a
step."""

from __future__ import annotations

from benchmarks.host_step import measure


def test_host_step_reports_each_part():
    result = measure(batch_size=4, context=20, steps=3)
    assert (result["batch_size"], result["context"], result["steps"]) == (4, 20, 3)
    assert set(result["parts_ms"]) == {
        "schedule",
        "launch",
        "launch.prepare",
        "launch.sampler",
        "launch.lm_head",
        "finish",
        "update_from_output",
        "core.step_samples",
        "core.encode",
        "front_end.process",
    }
    parts = result["parts_ms"]
    rounding = 0.002  # each figure is rounded to a microsecond on its own
    inner = parts["launch.prepare"] + parts["launch.sampler"] + parts["launch.lm_head"]
    assert parts["launch"] >= inner - rounding
    assert result["step_ms"] >= parts["schedule"] + parts["launch"] - rounding
    assert parts["schedule"] > 0 and inner > 0
    assert result["outputs_and_detokenize_ms"] > 0
    # The step is the core's part and the front end's; the core process adds the encoding.
    core = parts["core.step_samples"]
    assert result["step_ms"] >= core + parts["front_end.process"] - rounding
    assert core >= parts["schedule"] + parts["launch"] + parts["update_from_output"] - rounding
    assert parts["core.encode"] > 0
    core_process = result["step_ms"] - parts["front_end.process"] + parts["core.encode"]
    assert abs(result["core_process_step_ms"] - core_process) <= rounding
    # The core's host time leaves out what a GPU computes: the lm_head and the sampler's work.
    device_work = parts["launch.lm_head"] + parts["launch.sampler"]
    assert parts["launch.lm_head"] > 0
    assert (
        abs(result["core_host_ms"] - (result["core_process_step_ms"] - device_work)) <= 2 * rounding
    )


def test_host_step_simulates_a_device_busy_for_each_step():
    """With --device-ms every step keeps a simulated device busy D ms and its result waits for
    that: the device runs one step at a time, so N timed steps take at least N * D, less the D
    that a step launched before the timer started may already have spent (asynchronous)."""
    from pagedserve.engine.worker.model_runner import StepHandle

    result_method = StepHandle.result
    steps = 3
    for async_scheduling in (False, True):
        result = measure(4, 20, steps, device_ms=20.0, async_scheduling=async_scheduling)
        assert result["async_scheduling"] is async_scheduling
        assert result["device_ms"] == 20.0
        floor = 20.0 if not async_scheduling else 20.0 * (steps - 1) / steps
        assert result["step_ms"] >= floor
    assert StepHandle.result is result_method  # the simulation is undone


def test_host_step_times_the_core_loop_alone():
    """--core-loop runs what the core process runs per step: no front end, outputs encoded."""
    result = measure(4, 20, 3, core_loop=True)
    assert result["loop"] == "core"
    parts = result["parts_ms"]
    assert "front_end.process" not in parts
    assert parts["core.step_samples"] >= parts["schedule"] + parts["launch"] - 0.002
    assert result["step_ms"] >= parts["core.step_samples"] - 0.001
