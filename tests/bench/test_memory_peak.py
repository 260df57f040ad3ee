"""benchmarks/memory_peak.py on synthetic snapshots of the `torch.cuda.memory._snapshot()` format."""

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_peak.py"
spec = importlib.util.spec_from_file_location("memory_peak", SCRIPT)
memory_peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_peak)

GIB = 2**30
BEFORE = "allocated before recording"
# C++ frames come first (innermost first), as with `_record_memory_history(stacks="all")`.
ALLOCATOR = [{"filename": "CUDACachingAllocator.cpp", "line": 0, "name": "DeviceCachingAllocator::malloc()"},
             {"filename": "??", "line": 0, "name": "at::_ops::empty_strided::call(long)"}]


def py(path, line, name="f"):
    return {"filename": path, "line": line, "name": name}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": ALLOCATOR + list(frames)}


def free(addr, size, completed=True):
    """A free as the trace logs it (with the requested size); ``completed``: also the free_completed."""
    events = [{"action": "free_requested", "addr": addr, "size": size, "frames": []}]
    return events + ([{"action": "free_completed", "addr": addr, "size": size, "frames": []}] if completed else [])


def snapshot(trace, *held, device=0):
    """``held``: ``(addr, block size, requested size)`` of the blocks allocated at the dump."""
    blocks = [{"address": addr, "size": size, "requested_size": requested, "state": "active_allocated",
               "frames": []} for addr, size, requested in held]
    blocks.append({"address": 900, "size": 8 * GIB, "requested_size": 0, "state": "inactive", "frames": []})
    other_device = {"device": 1, "blocks": [{"address": 901, "size": 8 * GIB, "requested_size": 8 * GIB,
                                             "state": "active_allocated", "frames": []}]}
    return {"segments": [{"device": device, "blocks": blocks}, other_device], "device_traces": [trace]}


TORCH_OP = py("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 100, "linear")
A_FIRST = py("/repo/dsv/a.py", 10)
# Snapshot A: 3 GiB allocated before recording (2 GiB kept to the dump, 1 GiB freed in the trace).
A = snapshot([
    alloc(1, 1 * GIB, TORCH_OP, A_FIRST),  # the dump holds it, in a block 512 bytes larger: 4 GiB + 512
    alloc(2, GIB // 2, py("/repo/dsv/b.py", 20)),  # 4.5 GiB + 512: the peak
    *free(2, GIB // 2, completed=False),  # stream-ordered: the bytes drop now, the free completes below
    *free(200, 1 * GIB),  # allocated before recording: 3 GiB + 512
    alloc(3, 5 * GIB // 4, py("/repo/dsv/c.py", 30)),  # 4.25 GiB + 512, though the highest rise since the start
    {"action": "free_completed", "addr": 2, "size": GIB // 2, "frames": []},
    *free(3, 5 * GIB // 4, completed=False),
], (100, 2 * GIB, 2 * GIB), (1, GIB + 512, GIB))

# Snapshot B: 2 GiB allocated before recording, kept to the dump; its trace frees everything it allocates.
B = snapshot([
    alloc(1, 1 * GIB, A_FIRST),  # 3 GiB
    {**alloc(4, 2 * GIB), "frames": ALLOCATOR + [  # backward in the autograd engine's thread: no Python frame
        {"filename": "??", "line": 0, "name": "torch::autograd::generated::MulBackward0::apply(std::vector)"}]},
    alloc(5, GIB // 4, TORCH_OP),  # 5.25 GiB
    alloc(6, GIB // 2, TORCH_OP, py("/repo/dsv/c.py", 30, "inner"), py("/repo/lib/x.py", 5),
          py("/repo/dsv/d.py", 40, "outer")),  # 5.75 GiB: the peak
    *free(6, GIB // 2), *free(4, 2 * GIB), *free(5, GIB // 4), *free(1, GIB),  # 2 GiB
    alloc(9, 3 * GIB + 3 * GIB // 4, py("/repo/dsv/e.py", 50)), *free(9, 3 * GIB + 3 * GIB // 4),  # 5.75 again
], (100, 2 * GIB, 2 * GIB))


def test_peak_is_absolute_and_counts_blocks_from_before_the_recording():
    peak = memory_peak.find_peak(A)
    assert peak.start_bytes == 3 * GIB
    assert peak.bytes == 4 * GIB + GIB // 2 + 512 and peak.index == 1 and peak.events == len(A["device_traces"][0])
    assert memory_peak.site(peak.event) == "dsv/b.py:20"
    assert memory_peak.by_site(peak) == {BEFORE: (3 * GIB, 2), "dsv/a.py:10": (GIB + 512, 1),
                                         "dsv/b.py:20": (GIB // 2, 1)}

    peak = memory_peak.find_peak(B)  # the first of its two equal highs
    assert (peak.start_bytes, peak.bytes, peak.index) == (2 * GIB, 5 * GIB + 3 * GIB // 4, 3)
    assert memory_peak.project_frames(peak.event) == "dsv/c.py:30 (inner) < dsv/d.py:40 (outer)"
    assert memory_peak.by_site(peak) == {BEFORE: (2 * GIB, 1), "dsv/a.py:10": (GIB, 1),
                                         "MulBackward0 (autograd, no Python frame)": (2 * GIB, 1),
                                         "torch/nn/functional.py:100": (GIB // 4, 1),
                                         "dsv/c.py:30": (GIB // 2, 1)}


def test_peak_at_the_start_when_the_trace_only_frees():
    trace = [*free(7, 3 * GIB), alloc(8, GIB, A_FIRST)]
    peak = memory_peak.find_peak(snapshot(trace, (8, GIB, GIB)))
    assert (peak.bytes, peak.index, peak.event) == (3 * GIB, -1, None)
    assert memory_peak.by_site(peak) == {BEFORE: (3 * GIB, 1)}


def test_sites_without_project_frames():
    assert memory_peak.site(None) == BEFORE
    assert memory_peak.site(alloc(1, 1)) == "aten::empty_strided (no Python frame)"
    assert memory_peak.site({"frames": []}) == "? (no Python frame)"
    assert memory_peak.site(alloc(1, 1, TORCH_OP, A_FIRST), under="/other/") == "torch/nn/functional.py:100"


def test_diff_is_b_minus_a_by_site_largest_first():
    sites = {name: memory_peak.by_site(memory_peak.find_peak(s)) for name, s in (("a", A), ("b", B))}
    assert memory_peak.diff(sites["a"], sites["b"]) == [
        ("MulBackward0 (autograd, no Python frame)", 2 * GIB), ("dsv/c.py:30", GIB // 2),
        ("torch/nn/functional.py:100", GIB // 4), ("dsv/a.py:10", -512), ("dsv/b.py:20", -GIB // 2),
        (BEFORE, -GIB)]

    lines = memory_peak.summarize({"a": A, "b": B}, top=2).splitlines()
    assert lines[0] == ("a, device 0: peak 4.500 GiB allocated (3.000 GiB when the recording started), "
                        "4 blocks live")
    assert lines[1] == "  at event 1 of 8: a 512.0 MiB alloc at dsv/b.py:20 (f)"
    assert lines[2].split() == ["3.000", "GiB", "2", "blocks", "allocated", "before", "recording"]
    assert lines[4].startswith("b, device 0: peak 5.750 GiB allocated (2.000 GiB when")  # top=2: 2 sites
    assert lines[8] == "b - a, device 0: +1.250 GiB (+1280.00 MiB) at the peaks, by site"
    assert lines[9:] == ["  held more by b:",
                         "    +2.000 GiB    +2048.000 MiB  MulBackward0 (autograd, no Python frame)",
                         "    +0.500 GiB     +512.000 MiB  dsv/c.py:30",
                         "  held less by b:", "    -1.000 GiB    -1024.000 MiB  allocated before recording",
                         "    -0.500 GiB     -512.000 MiB  dsv/b.py:20"]


def test_summary_edge_cases():
    assert memory_peak.summarize({"a": {"device_traces": [[]]}}) == "no alloc events recorded"
    assert memory_peak.summarize({"a": A, "b": {"device_traces": [[]]}}) == "no alloc events recorded"
    assert "warning: 8 events, the recording's limit" in memory_peak.summarize({"a": A}, max_entries=8)
    assert "warning" not in memory_peak.summarize({"a": A}, max_entries=9)


def test_command_line(tmp_path):
    paths = []
    for name, s in (("a", A), ("b", B)):
        paths.append(tmp_path / f"{name}.pickle")
        paths[-1].write_bytes(pickle.dumps(s))
    run = subprocess.run([sys.executable, str(SCRIPT), *map(str, paths), "--top", "1"],
                         capture_output=True, text=True, check=True)
    assert f"{paths[1]} - {paths[0]}, device 0: +1.250 GiB (+1280.00 MiB) at the peaks, by site" in run.stdout
    run = subprocess.run([sys.executable, str(SCRIPT), str(paths[0]), str(paths[0])],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "two different ones" in run.stderr
