"""Kernel sweep round 18, prepared: the Hopper forward at 64-token groups and key blocks with two-block tiles.

`dsv bench kernels --group-size 64 --kv-block 64` (results/2026-11-30-h200-kernels-recheck.md) put the
Hopper forward at the training layout 20-24% slower than at 128-token blocks. Its 64-token setting walks one
64-key tile per iteration (wgmma N = 64). Here each iteration loads two listed blocks of the same group's
list into one 128-key stage (two TMA loads on one barrier): wgmma N = 128, half the iterations and barriers,
no extra matmuls (shared walks over two lists would cost 1.4-1.5x: NOTES, "Left", item 1). The odd list's
last tile loads its block twice and masks the second half to -inf, so V stays finite (0 · V = 0).

What to measure: the stage counts against occupancy. 128-key stages are 32 KiB each, so K 2 + V 2 stages
(144 KiB with Q) fit one program per SM and K 2 + V 1 (112 KiB) or K 1 + V 1 (80 KiB) two.

usage (one H200): PYTHONPATH=. python3 benchmarks/paired_forward_probe.py [--compile-only]
--compile-only (any machine with triton >= 3.6): compiles every variant for sm_90 and prints shared memory and
spills. On a GPU: each variant against the current Hopper forward (out, LSE), then both timed.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from dsv.ops.sparse_attention import hopper_kernels as hk

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# (K stages, V stages, programs per SM (0: one per tile), maxnreg)
VARIANTS = {"k2v2": (2, 2, 0, 128), "k2v1": (2, 1, 0, 128), "k1v1": (1, 1, 0, 128)}


@gluon.jit
def _tile(tile, n_m, H, NG, group, IDX, CNT, K_MAX):
    pid_m = tile % n_m
    bh = tile // n_m
    q_row0 = pid_m * 64
    row = bh * NG + q_row0 // group
    count = gl.load(CNT + row)
    idx_row = IDX + row.to(gl.int64) * K_MAX
    return bh // H, bh % H, bh, q_row0, count, (count + 1) // 2, idx_row


@gluon.jit
def _pair_starts(idx_row, t, count, kv_block):
    first = gl.load(idx_row + 2 * t) * kv_block
    second = gl.load(idx_row + gl.minimum(2 * t + 1, count - 1)) * kv_block
    return first, second


@gluon.jit
def _masked(qk, idx_row, t, count, kv_block, S, even_n, offs_n, HALF: gl.constexpr):
    # Only the odd list's last tile (its second half repeats a block) and ragged sequences need a mask.
    if (even_n == 0) | (2 * t + 1 >= count):
        first, second = _pair_starts(idx_row, t, count, kv_block)
        upper = offs_n >= HALF
        cols = gl.where(upper, second + offs_n - HALF, first + offs_n)
        valid = (cols < S) & ((offs_n < HALF) | (2 * t + 1 < count))
        qk = gl.where(valid[None, :], qk, float("-inf"))
    return qk


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
              v_empty, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block):
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    kv_it = 0
    q_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, h, _, q_row0, count, n_iter, idx_row = _tile(tile, n_m, H, NG, group, IDX, CNT, K_MAX)
        if n_iter > 0:
            mbarrier.wait(q_empty.index(0), (q_it & 1) ^ 1)
            mbarrier.expect(q_ready.index(0), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, h, q_row0, 0], q_ready.index(0), q_smem.index(0))
            q_it += 1
        for t in range(n_iter):
            first, second = _pair_starts(idx_row, t, count, kv_block)
            pos = kv_it + t
            ks = pos % K_STAGES
            mbarrier.wait(k_empty.index(ks), ((pos // K_STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(ks), 2 * k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, h, first, 0], k_ready.index(ks), k_smem.index(ks).slice(0, HALF, dim=2))
            _tma_load(k_desc, [b, h, second, 0], k_ready.index(ks), k_smem.index(ks).slice(HALF, HALF, dim=2))
            vs = pos % V_STAGES
            mbarrier.wait(v_empty.index(vs), ((pos // V_STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(vs), 2 * v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, h, first, 0], v_ready.index(vs), v_smem.index(vs).slice(0, HALF, dim=2))
            _tma_load(v_desc, [b, h, second, 0], v_ready.index(vs), v_smem.index(vs).slice(HALF, HALF, dim=2))
        kv_it += n_iter


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, S, sob, soh, sos, qk_scale, even_n):
    SUB_M: gl.constexpr = q_smem.type.shape[3]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    HALF: gl.constexpr = BLOCK_N // 2
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    q2 = q_smem.index(0).reshape([SUB_M, HEAD_DIM])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    kv_it = 0
    q_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        b, h, bh, q_row0, count, n_iter, idx_row = _tile(tile, n_m, H, NG, group, IDX, CNT, K_MAX)
        acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, o_layout)
        m_i = gl.full([SUB_M], -1.0e30, gl.float32, row_s)
        l_i = gl.zeros([SUB_M], gl.float32, row_s)
        if n_iter > 0:
            mbarrier.wait(q_ready.index(0), q_it & 1)
            ks = kv_it % K_STAGES
            mbarrier.wait(k_ready.index(ks), (kv_it // K_STAGES) & 1)
            s_tok = warpgroup_mma(q2, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(ks), count=1)
            qk = _masked(qk, idx_row, 0, count, kv_block, S, even_n, offs_n, HALF)
            m_i = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
            p = gl.exp2(qk * qk_scale - m_i[:, None])
            l_i = gl.sum(p, 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_iter):
                pos = kv_it + j
                ks = pos % K_STAGES
                mbarrier.wait(k_ready.index(ks), (pos // K_STAGES) & 1)
                vs = (pos - 1) % V_STAGES
                mbarrier.wait(v_ready.index(vs), ((pos - 1) // V_STAGES) & 1)
                s_tok = warpgroup_mma(q2, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                      zero_s, use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                mbarrier.arrive(k_empty.index(ks), count=1)
                qk = _masked(qk, idx_row, j, count, kv_block, S, even_n, offs_n, HALF)
                m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
                p = gl.exp2(qk * qk_scale - m_new[:, None])
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, 1)
                m_i = m_new
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(v_empty.index(vs), count=1)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.arrive(q_empty.index(0), count=1)
            q_it += 1
            last = kv_it + n_iter - 1
            vs = last % V_STAGES
            mbarrier.wait(v_ready.index(vs), (last // V_STAGES) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_empty.index(vs), count=1)
        kv_it += n_iter
        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
        offs_m = q_row0 + gl.arange(0, SUB_M, layout=row_o)
        optr = (OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m[:, None].to(gl.int64) * sos
                + offs_d[None, :])
        gl.store(optr, out.to(OUT.dtype.element_ty), mask=offs_m[:, None] < S)
        lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, float("-inf"))
        offs_ms = q_row0 + gl.arange(0, SUB_M, layout=row_s)
        gl.store(LSE + bh.to(gl.int64) * S + offs_ms, lse, mask=offs_ms < S)


@gluon.jit
def paired_fwd_kernel(q_desc, k_desc, v_desc, OUT, LSE, IDX, CNT, sob, soh, sos, H, S, NG, K_MAX, num_tiles,
                      qk_scale, GROUP: gl.constexpr, KV_BLOCK: gl.constexpr, K_STAGES: gl.constexpr,
                      V_STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    even_n = (S % KV_BLOCK == 0).to(gl.int32)
    n_m = gl.cdiv(S, 64)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [1] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES, 1, 1, 2 * KV_BLOCK, k_desc.block_type.shape[3]],
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES, 1, 1, 2 * KV_BLOCK, v_desc.block_type.shape[3]],
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready.index(0), count=1)
    mbarrier.init(q_empty.index(0), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    producer = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                v_empty, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, GROUP, KV_BLOCK)
    consumer = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, GROUP, KV_BLOCK, S, sob, soh, sos, qk_scale, even_n)
    gl.warp_specialize([(_consumer, consumer), (_producer, producer)], [1], [PRODUCER_REGS])


def paired_forward(q, k, v, indices, counts, scale: float, variant: str):
    k_stages, v_stages, per_sm, maxnreg = VARIANTS[variant]
    B, H, S, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    num_tiles = -(-S // 64) * B * H
    grid = (min(num_tiles, per_sm * hk._sm_count(q.device.index)) if per_sm else num_tiles,)
    paired_fwd_kernel[grid](hk._descriptor(q, 64), hk._descriptor(k, 64), hk._descriptor(v, 64), out, lse, indices,
                            counts, *out.stride()[:3], H, S, indices.shape[2], indices.shape[3], num_tiles,
                            scale * hk._LOG2E, GROUP=64, KV_BLOCK=64, K_STAGES=k_stages, V_STAGES=v_stages,
                            PRODUCER_REGS=hk._PRODUCER_REGS, num_warps=4, maxnreg=maxnreg)
    return out, lse


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty(1, 2, 512, 128, dtype=torch.bfloat16)
    kernel = paired_fwd_kernel
    for name, (k_stages, v_stages, _, maxnreg) in VARIANTS.items():
        args = [hk._descriptor(x, 64)] * 3 + [x, torch.empty(1, dtype=torch.float32),
                                              torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.int32)]
        signature = {n: mangle_type(a) for n, a in zip(kernel.arg_names, args)}
        signature.update({n: "i32" for n in ("sob", "soh", "sos", "H", "S", "NG", "K_MAX", "num_tiles")})
        signature["qk_scale"] = "fp32"
        constants = dict(GROUP=64, KV_BLOCK=64, K_STAGES=k_stages, V_STAGES=v_stages,
                         PRODUCER_REGS=hk._PRODUCER_REGS, num_warps=4)
        signature.update({n: "constexpr" for n in constants})
        source = GluonASTSource(kernel, signature,
                                constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        usage = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", "/dev/null", "-"], input=compiled.asm["ptx"],
                               capture_output=True, text=True).stderr
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", usage)
        print(f"{name}: shared {compiled.metadata.shared} bytes, programs per SM by shared memory "
              f"{(227 * 1024) // compiled.metadata.shared}, spills (stores, loads) {spills}")


def gpu_run() -> None:
    import math

    from triton.testing import do_bench

    from dsv.ops.estimate.triton_kernels import estimate_index_triton

    torch.manual_seed(0)
    H, D, rank = 24, 128, 16
    scale = D ** -0.5
    columns = " | ".join(f"{v} ms (err out / lse)" for v in VARIANTS)
    print(f"| S | sparsity | blocks a group | current Hopper ms | {columns} |")
    # A ragged length and odd and even block counts first (masking), then the benchmark's shapes.
    for S, sparsity in ((32768 - 37, 0.9), (32768, 0.9), (32768, 0.95), (65536, 0.9), (65536, 0.95), (65536, 0.98)):
        q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q_lr, k_lr = (torch.randn(1, H, S, rank, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        n_blocks = math.ceil(S / 64)
        keep = torch.full((H,), max(1, math.ceil(round((1 - sparsity) * n_blocks, 6))), dtype=torch.int64)
        keep[::2] += 1  # odd and even lists in one index
        index = estimate_index_triton(q_lr, k_lr, keep, 64, 64)
        base = functools.partial(hk.sparse_attention_fwd_hopper, q, k, v, index.indices, index.counts, 64, 64, scale)
        ref_out, ref_lse = base()
        cells = [f"{do_bench(base, warmup=25, rep=200):.3f}"]
        for name in VARIANTS:
            run = functools.partial(paired_forward, q, k, v, index.indices, index.counts, scale, name)
            out, lse = run()
            err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            lse_err = (lse - ref_lse).abs().max().item()
            ok = math.isfinite(err) and err < 1e-2 and lse_err < 1e-3
            cells.append(f"{do_bench(run, warmup=25, rep=200):.3f} ({err:.1e} / {lse_err:.1e}){'' if ok else ' WRONG'}")
        print(f"| {S} | {sparsity} | {int(keep.min())}-{int(keep.max())} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true")
    if parser.parse_args().compile_only:
        compile_only()
    else:
        gpu_run()
    sys.exit(0)
