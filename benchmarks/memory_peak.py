"""What is allocated at the peak of a CUDA allocator history (`torch.cuda.memory._dump_snapshot`).

    python benchmarks/memory_peak.py A.pickle [B.pickle] [--top 25] [--under /dsv/]

For each snapshot and device: the absolute peak of allocated bytes (what `torch.cuda.max_memory_allocated`
reports over the recorded steps), the allocation that sets it, and the blocks live then, grouped by allocating
site. Given two snapshots, also what B holds at its peak that A does not, by site. Reads the pickle with plain
Python, so it runs anywhere, GPU or not (`dsv bench train --memory-history` writes such files).

The trace only holds the events since the recording started, but the blocks allocated before then count
towards the peak too; without them, runs whose recordings start at different points do not compare. So the
replay starts from the memory held when the recording started, i.e. the blocks allocated at the dump minus the
trace's net change. Those older blocks are known by address: freed in the trace without being allocated in
it, or allocated at the dump without being allocated in the trace. They form the site "allocated before
recording".
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections import defaultdict
from typing import NamedTuple

GIB = 2**30
BEFORE_RECORDING = "allocated before recording"
TORCH = "site-packages/torch/"
AUTOGRAD_NODE = re.compile(r"torch::autograd::(?:generated::)?(\w+)::apply\(")
ATEN_OP = re.compile(r"at::_ops::(\w+)::")


class Peak(NamedTuple):
    bytes: int  # allocated at the peak, absolute
    start_bytes: int  # allocated when the recording started
    index: int  # of the event that sets the peak (an alloc); -1: the peak is the start
    event: dict | None  # that event
    live: dict[int, tuple[int, dict | None]]  # {addr: (size, its alloc event; None: allocated before recording)}
    events: int  # in the trace


def blocks_at_dump(snapshot: dict, device: int) -> dict[int, int]:
    """``{addr: size}`` of the blocks still allocated when the snapshot was dumped."""
    return {block["address"]: block["size"]
            for segment in snapshot.get("segments", []) if segment.get("device", 0) == device
            for block in segment["blocks"] if block["state"] == "active_allocated"}


def untraced_blocks(trace: list[dict], at_dump: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """What the trace alone does not tell: ``({addr: size} of the blocks allocated before recording,
    {index of an alloc event: its block's size} of the blocks the trace allocates and the dump still holds)``.

    The trace logs requested sizes, the dump (like ``max_memory_allocated``) whole blocks; the dump's sizes
    keep the replay's end equal to the dump. Blocks freed during the trace count at their requested size, so
    the peak can read slightly low (their rounding up to a block, ~1 MiB in all on the 64k snapshots)."""
    allocated: dict[int, int] = {}  # addr -> index of its alloc event, while the trace holds it
    before: dict[int, int] = {}
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            allocated[event["addr"]] = index
        elif event["action"] == "free_requested" and allocated.pop(event["addr"], None) is None:
            before[event["addr"]] = event["size"]  # frees a block the trace never allocated: an older one
    before.update({addr: size for addr, size in at_dump.items() if addr not in allocated})
    held_at_dump = {index: at_dump.get(addr, trace[index]["size"]) for addr, index in allocated.items()}
    return before, held_at_dump


def _replay(trace: list[dict], before: dict[int, int], held_at_dump: dict[int, int]):
    """Yields ``(index, allocated bytes, live blocks)`` at the start (index -1) and after each event; the live
    blocks as in ``Peak.live``, updated in place."""
    live: dict[int, tuple[int, dict | None]] = {addr: (size, None) for addr, size in before.items()}
    current = sum(before.values())
    yield -1, current, live
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            size = held_at_dump.get(index, event["size"])
            live[event["addr"]] = (size, event)
            current += size
        elif event["action"] == "free_requested" and event["addr"] in live:
            # Allocated bytes drop here; a free_completed that follows (stream-ordered frees) changes nothing.
            current -= live.pop(event["addr"])[0]
        yield index, current, live


def find_peak(snapshot: dict, device: int = 0) -> Peak:
    """The first highest point of one device's allocated bytes, replayed from when its recording started."""
    trace = snapshot["device_traces"][device]
    before, held_at_dump = untraced_blocks(trace, blocks_at_dump(snapshot, device))
    peak_index, _ = max(((index, current) for index, current, _ in _replay(trace, before, held_at_dump)),
                        key=lambda point: point[1])
    # Replay again up to the peak rather than copy the live blocks at every new high.
    _, peak_bytes, live = next(point for point in _replay(trace, before, held_at_dump)
                               if point[0] == peak_index)
    event = trace[peak_index] if peak_index >= 0 else None
    return Peak(peak_bytes, sum(before.values()), peak_index, event, dict(live), len(trace))


def _short(frame: dict, marker: str) -> str:
    """``dsv/x.py:3`` for ``/repo/dsv/x.py`` line 3 and marker ``/dsv/``."""
    package = marker.strip("/").rsplit("/", 1)[-1]
    return f"{package}/{frame['filename'].rsplit(marker, 1)[-1]}:{frame['line']}"


def site(event: dict | None, under: str = "/dsv/") -> str:
    """Where a block was allocated: its innermost frame in the project (``under``), else in torch."""
    if event is None:
        return BEFORE_RECORDING
    frames = event.get("frames", [])  # innermost first
    for marker in (under, TORCH):
        for frame in frames:
            if marker in frame["filename"]:
                return _short(frame, marker)
    # The autograd engine's threads run backward without Python frames: name the node, else the operator.
    for pattern, label in ((AUTOGRAD_NODE, "{} (autograd, no Python frame)"),
                           (ATEN_OP, "aten::{} (no Python frame)")):
        for frame in frames:
            match = pattern.match(frame["name"])
            if match:
                return label.format(match[1])
    return "? (no Python frame)"


def project_frames(event: dict, under: str = "/dsv/", depth: int = 3) -> str:
    """The innermost ``depth`` project frames, innermost first, else ``site``."""
    frames = [f"{_short(frame, under)} ({frame['name']})" for frame in event.get("frames", [])
              if under in frame["filename"]]
    return " < ".join(frames[:depth]) or site(event, under)


def by_site(peak: Peak, under: str = "/dsv/") -> dict[str, tuple[int, int]]:
    """``{site: (bytes, blocks)}`` of the blocks live at the peak."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, event in peak.live.values():
        group = groups[site(event, under)]
        group[0] += size
        group[1] += 1
    return {name: (size, count) for name, (size, count) in groups.items()}


def describe(name: str, peak: Peak, sites: dict[str, tuple[int, int]], top: int, under: str,
             max_entries: int) -> list[str]:
    lines = [f"{name}: peak {peak.bytes / GIB:.3f} GiB allocated ({peak.start_bytes / GIB:.3f} GiB when "
             f"the recording started), {len(peak.live)} blocks live"]
    if peak.events >= max_entries:
        lines.append(f"  warning: {peak.events} events, the recording's limit: its start was dropped, so the "
                     "peak is the highest point after that")
    if peak.event is None:
        lines.append("  at the start of the recording")
    else:
        lines.append(f"  at event {peak.index} of {peak.events}: a {peak.event['size'] / 2**20:.1f} MiB "
                     f"alloc at {project_frames(peak.event, under)}")
    for site_name, (size, count) in sorted(sites.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"  {size / GIB:8.3f} GiB  {count:5d} blocks  {site_name}")
    return lines


def diff(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
    """``[(site, B's bytes - A's bytes)]`` of the sites that differ, largest difference first."""
    changes = [(name, b.get(name, (0, 0))[0] - a.get(name, (0, 0))[0]) for name in set(a) | set(b)]
    return sorted(((name, change) for name, change in changes if change),
                  key=lambda item: (-item[1], item[0]))


def summarize(snapshots: dict[str, dict], top: int = 25, under: str = "/dsv/",
              max_entries: int = 200_000) -> str:
    """The report on one or two ``{name: snapshot}``, B minus A for two. ``max_entries``: the recording's
    ring-buffer size (`dsv bench train --memory-history` records 200,000 events)."""
    lines = []
    traces = [snapshot.get("device_traces", []) for snapshot in snapshots.values()]
    for device in range(min(len(device_traces) for device_traces in traces)):
        if not all(device_traces[device] for device_traces in traces):
            continue  # nothing recorded on this device in some snapshot
        peaks = {name: find_peak(snapshot, device) for name, snapshot in snapshots.items()}
        sites = {name: by_site(peak, under) for name, peak in peaks.items()}
        for name in snapshots:
            lines += describe(f"{name}, device {device}", peaks[name], sites[name], top, under, max_entries)
        if len(snapshots) == 2:
            a, b = snapshots
            changes = diff(sites[a], sites[b])
            difference = peaks[b].bytes - peaks[a].bytes
            lines.append(f"{b} - {a}, device {device}: {difference / GIB:+.3f} GiB ({difference / 2**20:+.2f} MiB) "
                         "at the peaks, by site")
            more = [change for change in changes if change[1] > 0][:top]
            less = [change for change in reversed(changes) if change[1] < 0][:top]
            for heading, part in ((f"held more by {b}", more), (f"held less by {b}", less)):
                if part:
                    lines.append(f"  {heading}:")
                    # MiB to the KiB too: the sites of a difference of a few MiB show.
                    lines += [f"  {change / GIB:+8.3f} GiB {change / 2**20:+12.3f} MiB  {name}"
                              for name, change in part]
    return "\n".join(lines) if lines else "no alloc events recorded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshots", nargs="+", metavar="SNAPSHOT", help="one, or two to compare (B - A)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--under", default="/dsv/", help="the project's frames: file paths containing this")
    args = parser.parse_args()
    if len(set(args.snapshots)) != len(args.snapshots) or len(args.snapshots) > 2:
        parser.error("give one snapshot, or two different ones")
    snapshots = {}
    for path in args.snapshots:
        with open(path, "rb") as f:
            snapshots[path] = pickle.load(f)
    print(summarize(snapshots, args.top, args.under))


if __name__ == "__main__":
    main()
