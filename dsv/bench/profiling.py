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


# Kernel-name fragments (lower case) of each category, checked in this order: DSV's own kernels first, then
# the dense attention of cuDNN's SDPA (its fprop/bprop kernels and `cudnn::fusion` helpers; cuDNN's
# convolution kernels, of the patch embedding, are not attention) or FlashAttention, then the GEMM libraries
# (cuBLAS's nvjet and xmma kernels, CUTLASS), then the optimizer's multi-tensor kernels.
KERNEL_CATEGORIES = (
    ("sparse attention forward", ("sparse_attn_fwd",)),
    ("sparse attention backward", ("sparse_attn_bwd",)),
    ("critical-KV estimation", ("score_topk", "segment_mean")),
    ("dense attention", ("sdpa", "cudnn::fusion", "flash", "fmha")),
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass")),
    ("optimizer", ("multi_tensor_apply",)),
)


def kernel_category(name: str, cat: str) -> str:
    """The category of one device event (trace name and Kineto category) in `device_time_by_category`."""
    if cat == "gpu_memcpy":
        return "copies"
    if cat == "gpu_memset":
        return "memsets"
    lowered = name.lower()
    return next((label for label, fragments in KERNEL_CATEGORIES if any(f in lowered for f in fragments)),
                "elementwise, norms and other")


def device_time_by_category(trace: dict) -> list[tuple[str, float, int]]:
    """``[(category, µs, events)]`` of a trace's device work (`kernel_category`), most time first. Durations
    are summed: kernels that overlap on several streams count each, unlike `device_busy_us`."""
    totals: dict[str, tuple[float, int]] = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") in DEVICE_WORK and e.get("ph") == "X":
            label = kernel_category(e.get("name", ""), e["cat"])
            us, count = totals.get(label, (0.0, 0))
            totals[label] = (us + e["dur"], count + 1)
    return sorted(((label, us, count) for label, (us, count) in totals.items()), key=lambda r: (-r[1], r[0]))


LAUNCHES = ("cuda_runtime", "cuda_driver")
"""Trace categories of the host's launch calls; each shares a ``correlation`` id with the work it queued."""
HOST_OPS = ("cpu_op", "user_annotation")


def idle_by_host_op(trace: dict, min_gap_us: float = 10.0) -> tuple[float, list[tuple[str, float, int]]]:
    """Where the host was while the device waited: ``(idle µs between device work, [(host op, idle µs,
    gaps)])``, most idle first (then by name).

    A gap is a stretch of at least ``min_gap_us`` with no kernel, copy or memset between the first and the
    last. It ends when the host's launch of the next work lands, so it is charged to every host op (operator
    or ``record_function`` range) open on the launching thread at that launch: each name once per gap, so
    an op's figure includes the gaps of the ops it calls (an inclusive view, like a call tree's totals)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    work = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    host_ops: dict = {}
    for e in events:
        if e.get("cat") in HOST_OPS:
            host_ops.setdefault(e.get("tid"), []).append(e)
    total, charged = 0.0, {}
    reach = None
    for e in work:
        gap = e["ts"] - reach if reach is not None else 0.0
        if gap >= min_gap_us:
            total += gap
            launch = launches.get(e.get("args", {}).get("correlation"))
            names = {"(launch not in the trace)"} if launch is None else {
                op["name"] for op in host_ops.get(launch.get("tid"), [])
                if op["ts"] <= launch["ts"] <= op["ts"] + op["dur"]} or {"(no host op open)"}
            for name in names:
                idle, count = charged.get(name, (0.0, 0))
                charged[name] = (idle + gap, count + 1)
        reach = max(reach if reach is not None else e["ts"], e["ts"] + e["dur"])
    ranked = sorted(((name, idle, count) for name, (idle, count) in charged.items()), key=lambda r: (-r[1], r[0]))
    return total, ranked


def write_op_profile(step, device: torch.device, path: Path) -> list[tuple[str, float, int]]:
    """Run `step()` once under torch.profiler and write its operators by self device time (the kernels
    themselves, so a parent op's time is not counted again in its children; total host time off CUDA) to
    `path` as a table. On CUDA the first line says how much of the step's wall time the GPU
    was busy: the rest is time it waited for the host (launches, Python, synchronisation); then come the idle
    gaps by host op and the GPU time by kernel category (`device_time_by_category`), which is also returned
    (empty off CUDA)."""
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
    head, categories = "", []
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            trace_path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace_path))
            trace = json.loads(trace_path.read_text())
        busy_ms = device_busy_us(trace) / 1e3
        gaps_us, by_op = idle_by_host_op(trace)
        categories = device_time_by_category(trace)
        head = (f"GPU busy {busy_ms:.1f} ms of the step's {wall_ms:.1f} ms wall time under the profiler "
                f"(idle {wall_ms - busy_ms:.1f} ms, {1 - busy_ms / wall_ms:.1%})\n"
                f"GPU idle gaps of 10 µs or more between its first and last work: {gaps_us / 1e3:.1f} ms; host ops "
                "open at the launch that ended them (inclusive), most idle first:\n"
                + "".join(f"  {idle / 1e3:8.1f} ms  {count:6d} gaps  {name[:90]}\n"
                          for name, idle, count in by_op[:25])
                + "GPU time by kernel category (summed durations):\n"
                + "".join(f"  {us / 1e3:8.1f} ms  {count:6d} events  {label}\n"
                          for label, us, count in categories))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + prof.key_averages().table(sort_by=sort_by, row_limit=50, max_name_column_width=70))
    return categories
