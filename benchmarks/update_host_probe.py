"""Where the compiled DSV step's predictor update costs time (probe, one GPU).

The 2.7B shape at 32k tokens (override with TOKENS), compiled blocks, DSV in stage 2 with the paper's profile:
the median step with and without the predictor update (their difference is the update's cost per step), then
one step under the profiler: the GPU's idle gaps, the host operators running during the largest ones, and the
host operators by self time. Under compiled blocks the update is a runtime op whose ~100 eager calls run on the
host's critical path, so its host calls show up as GPU idle time.

usage: PYTHONPATH=. python3 benchmarks/update_host_probe.py TAG OUTDIR   (writes OUTDIR/TAG.json.gz, the trace)
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsv.bench.train import _Run, square_grid
from dsv.parallel.planner import paper_profile
from dsv.train.config import apply_overrides
from dsv.train.recipes import get_recipe


def timed(run: _Run) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    tag, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    cfg = apply_overrides(get_recipe("dit_2p7b"), ["model.compile=inductor"])
    run = _Run(cfg, "dsv", square_grid(int(os.environ.get("TOKENS", "32768")), 64), torch.device("cuda"))
    run.step()
    run.enter_stage2(paper_profile(cfg.model.depth, cfg.model.heads))
    for _ in range(3):
        timed(run)
    with_update = statistics.median(timed(run) for _ in range(4))
    run.set_attention(learn_every_stage2=10**9)
    timed(run)
    without_update = statistics.median(timed(run) for _ in range(4))
    run.set_attention(learn_every_stage2=1)
    timed(run)
    print(f"{tag}: step {with_update:.1f} ms, without update {without_update:.1f} ms, "
          f"update {with_update - without_update:.1f} ms", flush=True)

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(run)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        raw = Path(f"{tmp}/trace.json").read_bytes()
    (out / f"{tag}.json.gz").write_bytes(gzip.compress(raw))
    events = [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, gaps, end = 0.0, [], None
    for start, stop in kernels:
        if end is not None and start > end:
            gaps.append((start - end, end))
        busy += max(0.0, stop - max(start, end if end is not None else start))
        end = stop if end is None else max(end, stop)
    print(f"{tag}: wall {wall:.1f} ms profiled, GPU busy {busy / 1e3:.1f} ms, gaps {sum(g for g, _ in gaps) / 1e3:.1f} "
          "ms; largest gaps:")
    host_categories = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
    host = [e for e in events if e.get("cat") in host_categories]
    for gap, at in sorted(gaps, reverse=True)[:12]:
        during = sorted((e for e in host if e["ts"] <= at + gap and e["ts"] + e["dur"] >= at and e["dur"] >= gap / 2),
                        key=lambda e: e["dur"])[:4]
        print(f"  gap {gap / 1e3:7.2f} ms: " + " | ".join(f"{e['name'][:60]} ({e['dur'] / 1e3:.1f})" for e in during))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
