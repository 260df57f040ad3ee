"""Operator tables of one benchmarked step (torch.profiler), shared by the benchmark runners."""

from __future__ import annotations

import time
from pathlib import Path

import torch

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Kineto activity types that occupy the GPU. The profiler's CUDA-side records also hold annotation ranges
(`record_function`, compiled regions) and its own overhead records ("Command Buffer Full"), which span idle
time too: only these types count."""


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


def write_op_profile(step, device: torch.device, path: Path) -> None:
    """Run `step()` once under torch.profiler and write its operators by total device time (host time
    off CUDA) to `path` as a table. On CUDA the first line says how much of the step's wall time the GPU
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
    sort_by = "cuda_time_total" if cuda else "cpu_time_total"
    head = ""
    if cuda:
        events = prof.profiler.kineto_results.events()
        if events and not hasattr(events[0], "activity_type"):
            # torch 2.11's events carry no activity type, and without it annotation ranges would count as
            # busy: say so rather than print a figure that hides idle time.
            head = "GPU busy time not measured: this torch's profiler events carry no activity type\n"
        else:
            busy_ms = covered_ns([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
                                  if e.activity_type() in DEVICE_WORK]) / 1e6
            head = (f"GPU busy {busy_ms:.1f} ms of the step's {wall_ms:.1f} ms wall time under the profiler "
                    f"(idle {wall_ms - busy_ms:.1f} ms, {1 - busy_ms / wall_ms:.1%})\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70))
