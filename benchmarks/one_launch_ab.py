"""Round 17's A/B, as it ran (PYTHONPATH=. python benchmarks/one_launch_ab.py, ~40 s on one H200): the fused
backward as one launch with dq narrowed in place, against the two half-head launches it replaces and the split
backward; each checked against the split backward first; the extra peak memory. Kept in history only."""
# ruff: noqa: B007, B023, E731, F821  (a probe run as written: the loop's lambdas are called before `del p`)
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from kernel_sweep import TOL, Problem, rel_err  # noqa: E402

from dsv.ops.sparse_attention import hopper_backward as hb  # noqa: E402
from dsv.ops.sparse_attention import hopper_kernels as hk  # noqa: E402
from dsv.ops.sparse_attention import triton_kernels as tk  # noqa: E402


def two_launches(do, q, k, v, lse, delta, offsets, groups, group_size, kv_block, scale):
    B, H, S, D = q.shape
    dq, dk, dv = (torch.empty_like(q) for _ in range(3))
    heads = -(-H // 2)
    acc = torch.empty((B, heads, S, D), dtype=torch.float32, device=q.device)
    descriptors = [hk._descriptor(x, hb._SUB) for x in (q, do, k, v)]
    n_kt = -(-S // hb._KEYS)
    for h0 in range(0, H, heads):
        part = acc[:, : min(heads, H - h0)]
        part.zero_()
        num_tiles = n_kt * B * part.shape[1]
        hb._sparse_attn_bwd_fused_kernel[(num_tiles,)](
            *descriptors, hb._accumulator_descriptor(part), lse, delta, dk, dv, offsets, groups,
            S, H, h0, part.shape[1], -(-S // kv_block), num_tiles, scale * hk._LOG2E, scale,
            GROUP=group_size, KV_BLOCK=kv_block, SERVICE_REGS=hb._SERVICE_REGS, CONSUMER_REGS=hb._CONSUMER_REGS,
            num_warps=4, maxnreg=hb._MAXNREG)
        dq[:, h0:h0 + part.shape[1]].copy_(part)
    return dq, dk, dv


for S, sp in [(32768, 0.95), (32768, 0.9), (65536, 0.98), (65536, 0.95)]:
    p = Problem(S, sp, 128)
    cfg = tk.default_config(p.D, 128, 128, tma=True)
    km = (p.offsets, p.groups)
    args = lambda: (p.do, p.q, p.k, p.v, p.lse, tk._launch_bwd_delta(p.out, p.do, None), p.offsets, p.groups,  # noqa
                    p.block, p.block, p.scale)
    variants = dict(
        split=lambda: tk._launch_bwd(p.do, p.q, p.k, p.v, p.out, p.lse, None, p.index.indices, p.index.counts,
                                     lambda: km, 128, 128, p.scale, cfg),
        two_launches=lambda: two_launches(*args()),
        one_launch_in_place=lambda: hb.sparse_attention_bwd_hopper(*args()))
    want = variants["split"]()
    for name, fn in variants.items():
        errs = [rel_err(a, b) for a, b in zip(fn(), want)]
        assert max(errs) < TOL, (name, errs)
    del want
    line = []
    for rep in range(3):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = do_bench(fn, return_mode="median")
            line.append(f"{name} {ms:.3f} ms (+{peak:.0f} MiB)")
    print(f"S={S} sp={sp} K={p.index.indices.shape[3]}: " + " | ".join(line), flush=True)
    del p
