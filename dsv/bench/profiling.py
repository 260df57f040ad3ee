"""Operator tables of one benchmarked step (torch.profiler), shared by the benchmark runners."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Trace categories (Kineto activity types) that occupy the GPU. The profiler's GPU-side records also hold
annotation ranges (`record_function`, compiled regions) and its own overhead records ("Command Buffer Full"),
which span idle time too: only these categories count."""


def covered_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of ``(start, end)`` intervals: time the device had at least one thing running
    (kernels on several streams overlap, so their durations cannot simply be added)."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


def device_busy_us(trace: dict) -> float:
    """Time in µs during which the device ran at least one kernel, copy or memset, from a profiler trace
    (``export_chrome_trace``'s JSON): the union of those events' spans. Read from the exported trace because
    its categories are there in every torch version, while the in-memory events of some (2.11) lack them."""
    # Trace times are µs with ns digits after the point: integers in ns keep the union exact.
    spans = [(round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3)) for e in trace.get("traceEvents", [])
             if e.get("cat") in DEVICE_WORK and e.get("ph") == "X"]
    return covered_ns(spans) / 1e3


def write_op_profile(step, device: torch.device, path: Path) -> None:
    """Run `step()` once under torch.profiler and write its operators by self device time (the kernels
    themselves, so a parent op's time is not counted again in its children; total host time off CUDA) to
    `path` as a table. On CUDA the first line says how much of the step's wall time the GPU
    was busy: the rest is time it waited for the host (launches, Python, synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    sort_by = "self_device_time_total" if cuda else "cpu_time_total"
    head = ""
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            trace_path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace_path))
            busy_ms = device_busy_us(json.loads(trace_path.read_text())) / 1e3
        head = (f"GPU busy {busy_ms:.1f} ms of the step's {wall_ms:.1f} ms wall time under the profiler "
                f"(idle {wall_ms - busy_ms:.1f} ms, {1 - busy_ms / wall_ms:.1%})\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + prof.key_averages().table(sort_by=sort_by, row_limit=50, max_name_column_width=70))
