"""Where one eager training step's GPU time goes, dense and DSV (paper profile), by kernel category (probe, as it ran
on one H200: `python3 benchmarks/step_profile_probe.py 65536 dsv,dense OUTDIR`)."""

import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsv.bench.profiling import device_busy_us
from dsv.bench.train import _Run, bench_config
from dsv.parallel.planner import paper_profile
from dsv.train.recipes import get_recipe

tokens = int(sys.argv[1])
modes = sys.argv[2].split(",")
out = Path(sys.argv[3])
recipe = os.environ.get("RECIPE", "dit_2p7b")
spatial = int(os.environ.get("SPATIAL", "64"))
cfg = bench_config(get_recipe(recipe), [])
dev = torch.device(os.environ.get("DEV", "cuda"))
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def category(name, cat):
    n = name.lower()
    if cat == "gpu_memcpy":
        return "memcpy " + ("HtoD" if "htod" in n else "DtoH" if "dtoh" in n else "DtoD")
    if cat == "gpu_memset":
        return "memset"
    if "sparse_attn_fwd" in n:
        return "sparse fwd"
    if "sparse_attn_bwd" in n:
        return "sparse bwd"
    if "score_topk" in n or "segment_mean" in n:
        return "estimation"
    if "cudnn" in n or "flash" in n or "fmha" in n or "sdpa" in n:
        return "dense attention"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n or "sm90" in n:
        return "gemm"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    return "other"


for mode in modes:
    run = _Run(cfg, mode, tokens, spatial, dev)
    if mode == "dsv":
        run.step()
        run.enter_stage2(paper_profile(cfg.model.depth, cfg.model.heads))
    run.warm_up(1)
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run.step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/t.json")
        trace = json.loads(Path(f"{tmp}/t.json").read_text())
    busy = device_busy_us(trace) / 1e3
    cats, names = collections.Counter(), collections.Counter()
    counts = collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            c = category(e["name"], e["cat"])
            cats[c] += e["dur"] / 1e3
            names[(c, e["name"][:110])] += e["dur"] / 1e3
            counts[(c, e["name"][:110])] += 1
    lines = [f"{mode} {tokens}: wall {wall:.1f} ms under profiler, GPU busy {busy:.1f} ms"]
    lines += [f"  {c:16s} {ms:9.1f} ms" for c, ms in cats.most_common()]
    lines += ["top kernels:"] + [f"  {ms:8.1f} ms {counts[k]:6d}x  [{k[0]}] {k[1]}" for k, ms in names.most_common(70)]
    text = "\n".join(lines)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{mode}-{tokens}.txt").write_text(text)
    del run
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
