"""What is allocated at the peak of a CUDA allocator history (`torch.cuda.memory._dump_snapshot`).

    python benchmarks/memory_peak.py SNAPSHOT.pickle [--top 25] [--under dsv/]

Replays the recorded alloc/free events of each device, finds the moment the bytes allocated during the
recording peak, and prints the blocks live then, grouped by the innermost stack frame whose file path
contains ``--under`` (the project's own code by default). Blocks allocated before the recording started are
outside the trace: the peak is the rise over what was already held. Reads the pickle with plain Python, so
it runs anywhere, GPU or not (`dsv bench train --memory-history` writes such files).
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict


def _live_after(trace: list[dict], stop: int) -> tuple[int, dict[int, dict], int]:
    """``(bytes, {addr: alloc event}, index of the highest point)`` of the blocks allocated during the
    recording, replayed over ``trace[:stop]``."""
    live: dict[int, dict] = {}
    current = peak = 0
    peak_index = -1
    for index, event in enumerate(trace[:stop]):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif action in ("free_requested", "free_completed") and event["addr"] in live:
            # A block leaves once (a stream-ordered free logs both steps; allocated bytes drop at the first).
            current -= live.pop(event["addr"])["size"]
    return current, live, peak_index


def live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """``(peak bytes, {addr: alloc event})`` of the blocks live at the peak of one device's trace.

    Only blocks allocated during the recording count; frees of older blocks are ignored, so if such memory
    is freed and reused the rise shown overstates the real one."""
    _, _, peak_index = _live_after(trace, len(trace))
    peak, live, _ = _live_after(trace, peak_index + 1)
    return peak, live


def site(event: dict, under: str) -> str:
    """The innermost frame whose file path contains ``under`` ("?" when the stack has none)."""
    for frame in event.get("frames", []):
        if under in frame["filename"]:
            return f"{frame['filename'].split(under, 1)[-1]}:{frame['line']} ({frame['name']})"
    return "?"


def summarize(snapshot: dict, top: int = 25, under: str = "dsv/", max_entries: int = 200_000) -> str:
    """The report; ``max_entries``: the recording's ring-buffer size (`dsv bench train --memory-history`
    records 200,000 events), reached means the start of the history was dropped."""
    lines = []
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        if not trace:
            continue
        if len(trace) >= max_entries:
            lines.append(f"device {device}: warning: {len(trace)} events, the recording's limit; its start was "
                         "dropped, so blocks allocated before it count as older blocks")
        peak, blocks = live_at_peak(trace)
        by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for event in blocks.values():
            entry = by_site[site(event, under)]
            entry[0] += event["size"]
            entry[1] += 1
        lines.append(f"device {device}: peak rise {peak / 2**30:.2f} GiB over the recording, "
                     f"{len(blocks)} blocks live then")
        for name, (size, count) in sorted(by_site.items(), key=lambda item: -item[1][0])[:top]:
            lines.append(f"  {size / 2**30:8.3f} GiB  {count:5d} blocks  {name}")
    return "\n".join(lines) if lines else "no alloc events recorded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--under", default="dsv/", help="group by the innermost frame whose path contains this")
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        print(summarize(pickle.load(f), args.top, args.under))


if __name__ == "__main__":
    main()
