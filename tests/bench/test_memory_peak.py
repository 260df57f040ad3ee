"""benchmarks/memory_peak.py on a synthetic allocator history of the snapshot format."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_peak.py"
spec = importlib.util.spec_from_file_location("memory_peak", SCRIPT)
memory_peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_peak)

GIB = 2**30


def alloc(addr, gib, file, line):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB),
            "frames": [{"filename": "/site-packages/torch/x.py", "line": 1, "name": "op"},
                       {"filename": f"/repo/dsv/{file}", "line": line, "name": "f"}]}


def free(addr, action="free_completed"):
    return {"action": action, "addr": addr, "size": 0}


def test_peak_blocks_grouped_by_the_innermost_project_frame():
    trace = [
        alloc(1, 1.0, "a.py", 10), alloc(2, 2.0, "b.py", 20), free(1, "free_requested"), free(1),
        alloc(3, 0.5, "a.py", 10), alloc(4, 1.0, "a.py", 10),  # peak: 2 + 0.5 + 1 = 3.5 GiB
        free(2), free(99),  # a block from before the recording: ignored
        alloc(5, 3.0, "c.py", 30),  # 0.5 + 1 + 3 = 4.5 GiB: the new peak
        free(5),
    ]
    peak, blocks = memory_peak.live_at_peak(trace)
    assert peak == int(4.5 * GIB) and sorted(blocks) == [3, 4, 5]
    text = memory_peak.summarize({"device_traces": [trace]}, top=5)
    lines = text.splitlines()
    assert lines[0].startswith("device 0: peak rise 4.50 GiB") and "3 blocks" in lines[0]
    assert "3.000 GiB" in lines[1] and "c.py:30" in lines[1]  # largest site first
    assert "1.500 GiB" in lines[2] and "2 blocks" in lines[2] and "a.py:10" in lines[2]
    assert memory_peak.summarize({"device_traces": [[]]}) == "no alloc events recorded"
    assert "warning: 10 events, the recording's limit" in memory_peak.summarize({"device_traces": [trace]},
                                                                                max_entries=10)
