"""The GPU-busy measure of the operator profiles."""

import json

import pytest
import torch

from dsv.bench.profiling import covered_ns, device_busy_us


def test_covered_time_counts_overlapping_kernels_once():
    # Two streams overlap on [5, 10); a gap [12, 20) is idle; a kernel inside another adds nothing.
    assert covered_ns([(0, 10), (5, 12), (20, 30), (22, 25)]) == 12 + 10
    assert covered_ns([(20, 30), (0, 10)]) == 20  # order of the events does not matter
    assert covered_ns([(0, 10), (10, 15)]) == 15  # touching intervals
    assert covered_ns([]) == 0


def test_device_busy_time_counts_only_device_work_of_a_trace():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 100.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "ts": 105.5, "dur": 10.0},  # another stream, overlapping
        {"ph": "X", "cat": "gpu_memcpy", "ts": 200.0, "dur": 2.25},
        {"ph": "X", "cat": "gpu_memset", "ts": 300.0, "dur": 1.0},
        # Spans that are not device work: an annotation over the whole step, host ops, profiler overhead.
        {"ph": "X", "cat": "gpu_user_annotation", "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "cpu_op", "ts": 0.0, "dur": 1000.0},
        {"ph": "X", "cat": "overhead", "ts": 400.0, "dur": 50.0},
        {"ph": "i", "cat": "kernel", "ts": 500.0},  # an instant event has no span
    ]}
    assert device_busy_us(trace) == pytest.approx(15.5 + 2.25 + 1.0)
    assert device_busy_us({"traceEvents": []}) == 0.0


def test_exported_trace_has_the_fields_the_busy_measure_reads(tmp_path):
    """The installed torch's trace export: timed events with a category, start and duration."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    timed = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert any(e.get("cat") == "cpu_op" and e["dur"] >= 0 and e["ts"] > 0 for e in timed)
    assert device_busy_us(trace) == 0.0  # no device work on the CPU
