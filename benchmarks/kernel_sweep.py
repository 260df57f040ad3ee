"""Launch-setting sweep of the sparse-attention kernels on one GPU: check every variant, then time it.

    PYTHONPATH=. python benchmarks/kernel_sweep.py --out DIR [--quick | --host-overhead]

Measures the card's two ceilings (device-to-device copy, bf16 8192^3 matmul), then for each kernel
(forward, backward dq, backward dk/dv) and each candidate ``KernelConfig``: compares the variant's outputs
with the fp32 PyTorch reference on a small shape, then times it (median of do_bench) on the benchmark shape,
B=1, H=24, D=128, bf16, S=32k, 90% and 98% sparsity, for 128- and 64-token blocks. A variant that fails
to compile or to match is logged and skipped. Writes DIR/sweep.jsonl and prints a table; the winners go
into ``default_config`` and benchmarks/NOTES.md. ``--host-overhead`` instead measures the host (CPU) time
of each launcher on a shape with negligible GPU work.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from dsv.ops.estimate.naive import estimate_index
from dsv.ops.estimate.triton_kernels import estimate_index_triton
from dsv.ops.index import key_major_csr
from dsv.ops.sparse_attention import sparse_attention_reference_with_lse
from dsv.ops.sparse_attention import triton_kernels as tk
from dsv.ops.sparse_attention.triton_kernels import KernelConfig as KC

# Candidates per (group_size = kv_block) granularity: (block_m, block_n, num_warps, num_stages[, tma]).
# Round 4 (rounds 1-3 are in benchmarks/NOTES.md): the v3 defaults first, then TMA neighbours not tried yet,
# above all dk/dv with 128-key tiles over two warpgroups (FlashAttention-2's key-major shape).
VARIANTS = {
    128: {
        "fwd": [KC(128, 64, 4, 2, True), KC(128, 64, 4, 3, True), KC(128, 32, 4, 2, True), KC(128, 32, 4, 3, True)],
        "dq": [KC(128, 128, 8, 2), KC(128, 128, 8, 2, True), KC(128, 64, 4, 3, True), KC(64, 128, 4, 2, True)],
        "dkdv": [KC(64, 64, 4, 3, True), KC(32, 128, 8, 2, True), KC(32, 128, 8, 3, True), KC(32, 128, 8, 4, True),
                 KC(64, 128, 8, 3, True), KC(64, 64, 4, 4, True), KC(32, 64, 4, 3, True)],
        # The whole backward without the dq pass: dk/dv tiles, dq added by TMA bulk reductions (with TMA)
        # or element atomics; against the default split backward ("bwd_default" below).
        "bwd_atomic": [KC(64, 64, 4, 3, True), KC(64, 64, 4, 2, True), KC(64, 128, 8, 2, True),
                       KC(32, 128, 8, 3, True), KC(64, 64, 4, 3)],
    },
    64: {
        "fwd": [KC(64, 32, 4, 3), KC(64, 64, 4, 3), KC(64, 32, 4, 2), KC(64, 32, 4, 3, True), KC(64, 64, 4, 3, True)],
        "dq": [KC(64, 64, 4, 2), KC(64, 64, 4, 3), KC(64, 64, 4, 2, True), KC(64, 32, 4, 2, True)],
        "dkdv": [KC(64, 64, 4, 2), KC(64, 64, 4, 3), KC(64, 64, 4, 2, True), KC(64, 64, 4, 3, True)],
    },
}

# bf16 kernels against the fp32 reference: two units of bf16 eps (tests/ops/test_triton_kernels.py).
TOL = 2 * torch.finfo(torch.bfloat16).eps


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def copy_tbps() -> float:
    src = torch.randint(0, 255, (2**31,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e9


def matmul_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / do_bench(lambda: a @ b, return_mode="median") / 1e9


def ceilings(log):
    log(dict(kind="ceiling", copy_TBps=copy_tbps(), bf16_matmul_TFLOPs=matmul_tflops()))


class Problem:
    """Inputs, index and intermediate results of one (S, sparsity, block) shape."""

    def __init__(self, S, sparsity, block, H=24, D=128, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.S, self.block, self.H, self.D = S, block, H, D
        self.q, self.k, self.v, self.do = (torch.randn(1, H, S, D, device="cuda", generator=g)
                                           .to(torch.bfloat16) for _ in range(4))
        q_lr, k_lr = (torch.randn(1, H, S, 16, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        n_blocks = triton.cdiv(S, block)
        self.keep = torch.full((H,), max(1, round((1 - sparsity) * n_blocks)), dtype=torch.int64)
        self.q_lr, self.k_lr = q_lr, k_lr
        self.index = estimate_index_triton(q_lr, k_lr, self.keep, block, block)
        self.pairs = float(self.index.counts.sum()) * block * block
        self.scale = D**-0.5
        self.out, self.lse = tk.sparse_attention_fwd_launch(self.q, self.k, self.v, self.index.indices,
                                                            self.index.counts, block, block, self.scale)
        default = tk.default_config(D, block, block, tma=True)
        self.offsets, self.groups = key_major_csr(self.index.indices, n_blocks)
        self.dq, self.delta = tk._launch_bwd_dq(self.q, self.k, self.v, self.out, self.do, self.lse, None,
                                                self.index.indices, self.index.counts, block, block, self.scale,
                                                default.bwd_dq)

    def run(self, kernel, cfg):
        idx = self.index
        if kernel == "fwd":
            return tk.sparse_attention_fwd_launch(self.q, self.k, self.v, idx.indices, idx.counts, self.block,
                                                  self.block, self.scale, cfg)
        if kernel == "dq":
            return tk._launch_bwd_dq(self.q, self.k, self.v, self.out, self.do, self.lse, None, idx.indices,
                                     idx.counts, self.block, self.block, self.scale, cfg)
        if kernel == "dkdv":
            return tk._launch_bwd_dkdv(self.q, self.k, self.v, self.do, self.lse, self.delta, self.offsets,
                                       self.groups, self.block, self.block, self.scale, cfg)
        if kernel == "bwd_atomic":
            default = tk.default_config(self.D, self.block, self.block, tma=True)
            cfg = tk.SparseAttentionConfig(default.fwd, default.bwd_dq, cfg, atomic_dq=True)
        return tk.sparse_attention_bwd_launch(self.do, self.q, self.k, self.v, self.out, self.lse, None,
                                              idx.indices, idx.counts, self.block, self.block, self.scale, cfg)

    def reference(self):
        """fp32 reference outputs of each kernel: (out, lse), (dq,), (dk, dv)."""
        q, k, v = (x.float().requires_grad_() for x in (self.q, self.k, self.v))
        out, lse = sparse_attention_reference_with_lse(q, k, v, self.index)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), self.do.float())
        return {"fwd": (out, lse), "dq": (dq,), "dkdv": (dk, dv), "bwd": (dq, dk, dv), "bwd_atomic": (dq, dk, dv)}

    # Executed matmul FLOPs per kernel: fwd QK^T, PV; dq QK^T, dO V^T, dS K; dk/dv QK^T, P^T dO, V dO^T, dS^T Q;
    # the atomic backward is dk/dv plus dS K.
    def flops(self, kernel):
        return {"fwd": 4, "dq": 6, "dkdv": 8, "bwd": 14, "bwd_atomic": 10}[kernel] * self.pairs * self.D


def sweep(log, S, sparsity, block, kernels=("fwd", "dq", "dkdv", "bwd_atomic"), check=True):
    if check:
        small = Problem(2048, 0.75, block, H=2)
        want = small.reference()
    big = Problem(S, sparsity, block)
    for kernel in kernels:
        for cfg in VARIANTS[block].get(kernel, []):
            row = dict(kind="variant", kernel=kernel, S=S, sparsity=sparsity, block=block,
                       cfg=list(cfg.__dict__.values()))
            try:
                if check:
                    got = small.run(kernel, cfg)
                    got = got if isinstance(got, tuple) else (got,)
                    errs = [rel_err(a, b) for a, b in zip(got, want[kernel])]
                    row["err"] = max(errs)
                    if not all(torch.isfinite(a).all() for a in got[: len(want[kernel])]) or row["err"] > TOL:
                        row["status"] = "WRONG"
                        log(row)
                        continue
                ms = do_bench(lambda kernel=kernel, cfg=cfg: big.run(kernel, cfg), return_mode="median")
                # Unchecked rows (check=False) say so: a variant wrong in a checked sweep is timed here too.
                row.update(status="ok" if check else "timed, unchecked", ms=ms, tflops=big.flops(kernel) / ms / 1e9)
            except Exception as exc:  # a variant that cannot compile (e.g. out of shared memory) is skipped
                row.update(status=f"error: {type(exc).__name__}: {str(exc)[:160]}")
            log(row)
    default = tk.default_config(big.D, block, block, tma=True)
    ms = do_bench(lambda: big.run("bwd", default), return_mode="median")
    log(dict(kind="bwd_default", S=S, sparsity=sparsity, block=block, ms=ms, tflops=big.flops("bwd") / ms / 1e9))
    ms = do_bench(lambda: key_major_csr(big.index.indices, triton.cdiv(S, block)), return_mode="median")
    log(dict(kind="key_major_csr", S=S, sparsity=sparsity, block=block, ms=ms))
    ms = do_bench(lambda: estimate_index_triton(big.q_lr, big.k_lr, big.keep, block, block), return_mode="median")
    ms_ref = do_bench(lambda: estimate_index(big.q_lr, big.k_lr, big.keep, block, block), return_mode="median")
    log(dict(kind="estimate", S=S, sparsity=sparsity, block=block, ms=ms, ref_ms=ms_ref))


def host_overhead(log, out_dir: Path):
    """Host (CPU) time per call, on a shape whose GPU work is negligible (S=1024, H=1), so the launch path's
    own cost shows; plus a cProfile of full autograd steps (written to DIR/host_profile.txt)."""
    import cProfile
    import io
    import pstats

    from dsv.ops.sparse_attention.triton_kernels import sparse_attention_triton

    p = Problem(1024, 0.9, 128, H=1)
    q, k, v = (x.clone().requires_grad_() for x in (p.q, p.k, p.v))

    def wall_ms(fn, n=300):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e3

    def step():
        out = sparse_attention_triton(q, k, v, p.index)
        torch.autograd.grad(out, (q, k, v), p.do)

    for tma in (False, True):
        cfg = tk.default_config(p.D, 128, 128, tma=tma)
        # cfg=cfg binds this iteration's config explicitly (B023); wall_ms calls each lambda at once: no change.
        log(dict(kind="host_ms", what=f"fwd launcher, tma={tma}",
                 ms=wall_ms(lambda cfg=cfg: p.run("fwd", cfg.fwd))))
        log(dict(kind="host_ms", what=f"dkdv launcher, tma={tma}",
                 ms=wall_ms(lambda cfg=cfg: p.run("dkdv", cfg.bwd_dkdv))))
        log(dict(kind="host_ms", what=f"bwd launcher, tma={tma}", ms=wall_ms(lambda cfg=cfg: p.run("bwd", cfg))))
    dq_cfg = tk.default_config(p.D, 128, 128).bwd_dq
    log(dict(kind="host_ms", what="dq launcher", ms=wall_ms(lambda: p.run("dq", dq_cfg))))
    log(dict(kind="host_ms", what="key_major_csr", ms=wall_ms(lambda: key_major_csr(p.index.indices, 8))))
    log(dict(kind="host_ms", what="estimate_index_triton",
             ms=wall_ms(lambda: estimate_index_triton(p.q_lr, p.k_lr, p.keep, 128, 128))))
    with torch.no_grad():
        log(dict(kind="host_ms", what="sparse_attention_triton fwd (no grad)",
                 ms=wall_ms(lambda: sparse_attention_triton(p.q, p.k, p.v, p.index))))
    log(dict(kind="host_ms", what="fwd+bwd autograd step", ms=wall_ms(step)))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        step()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    (out_dir / "host_profile.txt").write_text(text.getvalue())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="only the 128-block sweep at 90%%")
    parser.add_argument("--host-overhead", action="store_true", help="only the host-overhead probe")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sink = (args.out / "sweep.jsonl").open("w")
    t0 = time.time()

    def log(row):
        row["t"] = round(time.time() - t0, 1)
        sink.write(json.dumps(row) + "\n")
        sink.flush()
        print(json.dumps(row), flush=True)

    log(dict(kind="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__))
    if args.host_overhead:
        host_overhead(log, args.out)
        return
    ceilings(log)
    sweep(log, 32768, 0.90, 128)
    if not args.quick:
        sweep(log, 32768, 0.90, 64)
        sweep(log, 32768, 0.98, 128, check=False)
    print(f"sweep done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
