"""bench.host_step runs a real engine (stubbed forward) and reports every part of a step."""

from __future__ import annotations

from bench.host_step import measure


def test_host_step_reports_each_part():
    result = measure(batch_size=4, context=20, steps=3)
    assert (result["batch_size"], result["context"], result["steps"]) == (4, 20, 3)
    assert set(result["parts_ms"]) == {
        "schedule",
        "execute",
        "execute.prepare_inputs",
        "execute.sampler",
        "update_from_output",
    }
    parts = result["parts_ms"]
    rounding = 0.002  # each figure is rounded to a microsecond on its own
    inner = parts["execute.prepare_inputs"] + parts["execute.sampler"]
    assert parts["execute"] >= inner - rounding
    assert result["step_ms"] >= parts["schedule"] + parts["execute"] - rounding
    assert parts["schedule"] > 0 and inner > 0
