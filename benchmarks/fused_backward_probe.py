"""Sweep rounds 16-17: where the fused Hopper backward's time goes at few blocks a group, one H200.

    PYTHONPATH=. python benchmarks/fused_backward_probe.py      (OUT=DIR for fused16.jsonl; ~90 s)

At 32k tokens and 95% sparsity (13 blocks a group) the fused backward (dsv/ops/sparse_attention/
hopper_backward.py) measured only ~2% faster than the split Triton backward, which leaves `dsv bench kernels`
at 14.4x cuDNN against the 15x target. This times, against the split backward (key-major view given) and at
six shapes: the fused backward as the package launches it (two launches of half the heads); one launch over
all heads (what the second launch costs); a persistent grid of 1 or 2 programs per SM (the kernel's loops
carry their barrier phases across tiles); and the pieces around the kernel (the delta pre-pass, zeroing the
accumulator, converting it into dq). Round 17 adds the order of the key tiles: as numbered (key tile fastest)
or the longest walks first (`longest_first_walks`), on the launched and the persistent grids, and the
package's own entry point. Every variant is checked against the split backward first.
Kept in history, not in the package.
"""

import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_sweep import TOL, Problem, rel_err  # noqa: E402

from dsv.ops.sparse_attention import hopper_backward as hb  # noqa: E402
from dsv.ops.sparse_attention import hopper_kernels as hk  # noqa: E402
from dsv.ops.sparse_attention import triton_kernels as tk  # noqa: E402


def fused(p, delta, heads_per_launch=None, programs_per_sm=0, longest_first=True):
    """The package's fused backward with the launch split, grid and tile order as given (None: the package's
    half)."""
    B, H, S, D = p.q.shape
    heads = heads_per_launch or -(-H // 2)
    dq, dk, dv = (torch.empty_like(p.q) for _ in range(3))
    acc = torch.empty((B, heads, S, D), dtype=torch.float32, device=p.q.device)
    descriptors = [hk._descriptor(x, hb._SUB) for x in (p.q, p.do, p.k, p.v)]
    n_kt = -(-S // hb._KEYS)
    walks = hb.longest_first_walks(p.offsets, B, H, S, p.block)
    for h0 in range(0, H, heads):
        part = acc[:, : min(heads, H - h0)]
        part.zero_()
        num_tiles = n_kt * B * part.shape[1]
        order = walks(h0, part.shape[1]) if longest_first else torch.arange(num_tiles, dtype=torch.int32,
                                                                           device=p.q.device)
        grid = min(num_tiles, programs_per_sm * hk._sm_count(p.q.device.index)) if programs_per_sm else num_tiles
        hb._sparse_attn_bwd_fused_kernel[(grid,)](
            *descriptors, hb._accumulator_descriptor(part), p.lse, delta, dk, dv, p.offsets, p.groups, order,
            S, H, h0, part.shape[1], -(-S // p.block), num_tiles, p.scale * hk._LOG2E, p.scale,
            GROUP=p.block, KV_BLOCK=p.block, SERVICE_REGS=hb._SERVICE_REGS, CONSUMER_REGS=hb._CONSUMER_REGS,
            num_warps=4, maxnreg=hb._MAXNREG)
        dq[:, h0:h0 + part.shape[1]].copy_(part)
    return dq, dk, dv


def measure(log, S: int, sparsity: float) -> None:
    """Checks every variant against the split backward, then times the good ones twice, interleaved."""
    p = Problem(S, sparsity, 128)
    cfg = tk.default_config(p.D, 128, 128, tma=True)
    key_major = (p.offsets, p.groups)

    def split():
        return tk._launch_bwd(p.do, p.q, p.k, p.v, p.out, p.lse, None, p.index.indices, p.index.counts,
                              lambda: key_major, 128, 128, p.scale, cfg)

    def with_delta(**options):
        return lambda: fused(p, tk._launch_bwd_delta(p.out, p.do, None), **options)

    def package():
        delta = tk._launch_bwd_delta(p.out, p.do, None)
        return hb.sparse_attention_bwd_hopper(p.do, p.q, p.k, p.v, p.lse, delta, p.offsets, p.groups, p.block,
                                              p.block, p.scale)

    variants = dict(split=split, as_numbered=with_delta(longest_first=False), longest_first=with_delta(),
                    package=package, one_launch=with_delta(heads_per_launch=p.H),
                    persistent_1=with_delta(programs_per_sm=1), persistent_2=with_delta(programs_per_sm=2),
                    persistent_1_as_numbered=with_delta(programs_per_sm=1, longest_first=False))
    want = split()
    good = {}
    for name, fn in variants.items():
        errors = [rel_err(a, b) for a, b in zip(fn(), want)]
        good[name] = max(errors) < TOL
        log(dict(kind="check", S=S, sp=sparsity, var=name, errs=errors, ok=good[name]))
    for rep in range(2):
        for name, fn in variants.items():
            if good[name]:
                log(dict(kind="time", S=S, sp=sparsity, var=name, rep=rep, ms=do_bench(fn, return_mode="median")))
    acc = torch.empty((1, p.H // 2, S, p.D), dtype=torch.float32, device="cuda")
    half_dq = torch.empty((1, p.H // 2, S, p.D), dtype=p.q.dtype, device="cuda")
    pieces = dict(delta_prepass=lambda: tk._launch_bwd_delta(p.out, p.do, None), zero_half=acc.zero_,
                  convert_half=lambda: half_dq.copy_(acc),
                  order_both_halves=lambda: [hb.longest_first_walks(p.offsets, 1, p.H, S, p.block)(h0, p.H // 2)
                                             for h0 in (0, p.H // 2)])
    for name, fn in pieces.items():
        log(dict(kind="piece", S=S, sp=sparsity, var=name, ms=do_bench(fn, return_mode="median")))


def main():
    out_dir = os.environ.get("OUT", "/tmp")
    log_file = open(os.path.join(out_dir, "fused17.jsonl"), "w")

    def log(record):
        print(json.dumps(record), flush=True)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()

    for S, sparsity in [(32768, 0.95), (32768, 0.9), (32768, 0.98), (65536, 0.95), (65536, 0.9), (65536, 0.98)]:
        measure(log, S, sparsity)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    main()
