"""Operator tables of one benchmarked step (torch.profiler), shared by the benchmark runners."""

from __future__ import annotations

from pathlib import Path

import torch


def write_op_profile(step, device: torch.device, path: Path) -> None:
    """Run `step()` once under torch.profiler and write its operators by total device time (host time
    off CUDA) to `path` as a table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70))
