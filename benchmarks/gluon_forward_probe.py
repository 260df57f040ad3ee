# ruff: noqa: E402, E501, E702, E741, B023
"""Sweep round 7: a Gluon (Hopper) sparse-attention forward against the Triton default, one H200.

    PYTHONPATH=. python benchmarks/gluon_forward_probe.py      (OUT=DIR for probe.jsonl)

Two loops written by hand with explicit TMA rings, mbarriers and asynchronous wgmma: ``sparse_fwd_kernel``
(scores of tile j and P.V of tile j-1 issued together, the softmax of tile j overlapping the P.V) and
``sparse_fwd_early_kernel`` (FlashAttention-3's intra-warpgroup order: the next tile's scores issued before
this tile's softmax). Checked against the fp32 reference first (ragged S, a group with no block), then
timed at 32k/64k. Results in benchmarks/NOTES.md (round 7); kept in history, not in the package.
# ruff: noqa: E402, E501, E702, E741, B023  (a probe kept in history, reverted in the next commit)
"""
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _tile_start(idx_row, t, n_load, SUB: gl.constexpr, KV_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr):
    tc = gl.minimum(t, n_load - 1)
    return gl.load(idx_row + tc // SUB) * KV_BLOCK + (tc % SUB) * BLOCK_N


@gluon.jit
def _issue(desc, smem, bars, t, start, n_load, bh, STAGES: gl.constexpr):
    pred = t < n_load
    bar = bars.index(t % STAGES)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [bh, start, 0], bar, smem.index(t % STAGES), pred=pred)


@gluon.jit
def sparse_fwd_kernel(q_desc, k_desc, v_desc, OUT, LSE, IDX, CNT,
                      sob, soh, sos, H, S, NG, K_MAX, qk_scale,
                      HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, KV_BLOCK: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
                      V_STAGES: gl.constexpr, EVEN_N: gl.constexpr, num_warps: gl.constexpr):
    SUB: gl.constexpr = KV_BLOCK // BLOCK_N
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    g = pid_m * BLOCK_M // GROUP
    row = bh * NG + g
    n_iter = gl.load(CNT + row) * SUB
    n_load = gl.maximum(n_iter, 1)
    idx_row = IDX + row.to(gl.int64) * K_MAX

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    # Every slot is free at the start: fill both rings.
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bh, pid_m * BLOCK_M, 0], q_bar, q_smem)
    for t in gl.static_range(K_STAGES):
        _issue(k_desc, k_smem, k_bars, t, _tile_start(idx_row, t, n_load, SUB, KV_BLOCK, BLOCK_N), n_load, bh,
               K_STAGES)
    for t in gl.static_range(V_STAGES):
        _issue(v_desc, v_smem, v_bars, t, _tile_start(idx_row, t, n_load, SUB, KV_BLOCK, BLOCK_N), n_load, bh,
               V_STAGES)
    # Block starts of the next tiles to issue, read one iteration before they are needed (hides the load).
    k_next = _tile_start(idx_row, K_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N)
    v_next = _tile_start(idx_row, V_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N)

    q2 = q_smem.reshape([BLOCK_M, HEAD_DIM])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # tile 0: scores only
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_tok = warpgroup_mma(q2, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    if not EVEN_N:
        cols = _tile_start(idx_row, 0, n_load, SUB, KV_BLOCK, BLOCK_N) + offs_n
        qk = gl.where(cols[None, :] < S, qk, float("-inf"))
    m_i = gl.maximum(gl.full([BLOCK_M], -1.0e30, gl.float32, row_s), gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - m_i[:, None])
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_iter):
        # K slot of tile j - 1 is free (its scores retired last iteration): refill it with tile j + K_STAGES - 1.
        _issue(k_desc, k_smem, k_bars, j + K_STAGES - 1, k_next, n_load, bh, K_STAGES)
        k_next = _tile_start(idx_row, j + K_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N)
        ks = j % K_STAGES
        mbarrier.wait(k_bars.index(ks), (j // K_STAGES) & 1)
        vs = (j - 1) % V_STAGES
        mbarrier.wait(v_bars.index(vs), ((j - 1) // V_STAGES) & 1)
        s_tok = warpgroup_mma(q2, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        if not EVEN_N:
            cols = _tile_start(idx_row, j, n_load, SUB, KV_BLOCK, BLOCK_N) + offs_n
            qk = gl.where(cols[None, :] < S, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # V slot of tile j - 1 is free now that its P.V retired.
        _issue(v_desc, v_smem, v_bars, j - 1 + V_STAGES, v_next, n_load, bh, V_STAGES)
        v_next = _tile_start(idx_row, j + V_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)

    last = n_load - 1
    mbarrier.wait(v_bars.index(last % V_STAGES), (last // V_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last % V_STAGES).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bars.index(i))
    for i in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bars.index(i))

    has = n_iter > 0
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    out = gl.where(has, out, 0.0)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    b = bh // H
    h = bh % H
    optr = OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m[:, None].to(gl.int64) * sos + offs_d[None, :]
    gl.store(optr, out.to(OUT.dtype.element_ty), mask=offs_m[:, None] < S)
    lse = gl.where(has, (m_i + gl.log2(l_i)) * 0.6931471805599453, float("-inf"))
    offs_ms = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + bh.to(gl.int64) * S + offs_ms, lse, mask=offs_ms < S)


@gluon.jit
def sparse_fwd_early_kernel(q_desc, k_desc, v_desc, OUT, LSE, IDX, CNT,
                            sob, soh, sos, H, S, NG, K_MAX, qk_scale,
                            HEAD_DIM: gl.constexpr, GROUP: gl.constexpr, KV_BLOCK: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr,
                            V_STAGES: gl.constexpr, EVEN_N: gl.constexpr, num_warps: gl.constexpr):
    # The next tile's scores are issued before this tile's softmax, so the tensor cores run QK(j+1) and
    # P(j-1)V(j-1) while the exponentials of tile j run.
    SUB: gl.constexpr = KV_BLOCK // BLOCK_N
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    g = pid_m * BLOCK_M // GROUP
    row = bh * NG + g
    n_iter = gl.load(CNT + row) * SUB
    n_load = gl.maximum(n_iter, 1)
    idx_row = IDX + row.to(gl.int64) * K_MAX

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bh, pid_m * BLOCK_M, 0], q_bar, q_smem)
    for t in gl.static_range(K_STAGES):
        _issue(k_desc, k_smem, k_bars, t, _tile_start(idx_row, t, n_load, SUB, KV_BLOCK, BLOCK_N), n_load, bh,
               K_STAGES)
    for t in gl.static_range(V_STAGES):
        _issue(v_desc, v_smem, v_bars, t, _tile_start(idx_row, t, n_load, SUB, KV_BLOCK, BLOCK_N), n_load, bh,
               V_STAGES)
    k_next = _tile_start(idx_row, K_STAGES + 1, n_load, SUB, KV_BLOCK, BLOCK_N)
    v_next = _tile_start(idx_row, V_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N)

    q2 = q_smem.reshape([BLOCK_M, HEAD_DIM])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_tok = warpgroup_mma(q2, k_smem.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    # K slot of tile 0 is free: refill it with tile K_STAGES.
    _issue(k_desc, k_smem, k_bars, K_STAGES, _tile_start(idx_row, K_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N),
           n_load, bh, K_STAGES)
    if not EVEN_N:
        cols = _tile_start(idx_row, 0, n_load, SUB, KV_BLOCK, BLOCK_N) + offs_n
        qk = gl.where(cols[None, :] < S, qk, float("-inf"))
    m_i = gl.maximum(gl.full([BLOCK_M], -1.0e30, gl.float32, row_s), gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - m_i[:, None])
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    t1 = gl.minimum(1, n_load - 1)
    mbarrier.wait(k_bars.index(t1 % K_STAGES), (t1 // K_STAGES) & 1)
    s_tok = warpgroup_mma(q2, k_smem.index(t1 % K_STAGES).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))

    for j in range(1, n_iter):
        # qk holds the scores of tile j; the K slot of tile j is free: refill it with tile j + K_STAGES.
        _issue(k_desc, k_smem, k_bars, j + K_STAGES, k_next, n_load, bh, K_STAGES)
        k_next = _tile_start(idx_row, j + K_STAGES + 1, n_load, SUB, KV_BLOCK, BLOCK_N)
        jn = gl.minimum(j + 1, n_load - 1)
        mbarrier.wait(k_bars.index(jn % K_STAGES), (jn // K_STAGES) & 1)
        vs = (j - 1) % V_STAGES
        mbarrier.wait(v_bars.index(vs), ((j - 1) // V_STAGES) & 1)
        s_tok = warpgroup_mma(q2, k_smem.index(jn % K_STAGES).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                              zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        if not EVEN_N:
            cols = _tile_start(idx_row, j, n_load, SUB, KV_BLOCK, BLOCK_N) + offs_n
            qk = gl.where(cols[None, :] < S, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        qk, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, acc))
        _issue(v_desc, v_smem, v_bars, j - 1 + V_STAGES, v_next, n_load, bh, V_STAGES)
        v_next = _tile_start(idx_row, j + V_STAGES, n_load, SUB, KV_BLOCK, BLOCK_N)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)

    last = n_load - 1
    mbarrier.wait(v_bars.index(last % V_STAGES), (last // V_STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last % V_STAGES).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(K_STAGES):
        mbarrier.invalidate(k_bars.index(i))
    for i in gl.static_range(V_STAGES):
        mbarrier.invalidate(v_bars.index(i))

    has = n_iter > 0
    l_o = gl.convert_layout(l_i, row_o)
    out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
    out = gl.where(has, out, 0.0)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    b = bh // H
    h = bh % H
    optr = OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m[:, None].to(gl.int64) * sos + offs_d[None, :]
    gl.store(optr, out.to(OUT.dtype.element_ty), mask=offs_m[:, None] < S)
    lse = gl.where(has, (m_i + gl.log2(l_i)) * 0.6931471805599453, float("-inf"))
    offs_ms = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    gl.store(LSE + bh.to(gl.int64) * S + offs_ms, lse, mask=offs_ms < S)


def descriptors(q, k, v, block_m, block_n):
    B, H, S, D = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    out = []
    for x, rows in ((q, block_m), (k, block_n), (v, block_n)):
        x3 = x.reshape(B * H, S, D)
        lay = gl.NVMMASharedLayout.get_default_for([1, rows, D], gdt)
        out.append(TensorDescriptor.from_tensor(x3, [1, rows, D], lay))
    return out


def sparse_fwd(q, k, v, indices, counts, group_size, kv_block, scale, block_n=128, num_warps=8, k_stages=2,
               v_stages=2, maxnreg=None, early=False):
    B, H, S, D = q.shape
    q, k, v = (x.contiguous() for x in (q, k, v))
    block_m = 128
    qd, kd, vd = descriptors(q, k, v, block_m, block_n)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(S, block_m), B * H)
    extra = {} if maxnreg is None else dict(maxnreg=maxnreg)
    kern = sparse_fwd_early_kernel if early else sparse_fwd_kernel
    kern[grid](qd, kd, vd, out, lse, indices, counts, *out.stride()[:3], H, S, indices.shape[2],
                            indices.shape[3], scale * 1.4426950408889634, HEAD_DIM=D, GROUP=group_size,
                            KV_BLOCK=kv_block, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=k_stages,
                            V_STAGES=v_stages, EVEN_N=S % kv_block == 0, num_warps=num_warps, **extra)
    return out, lse


from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
from kernel_sweep import TOL, Problem, rel_err

from dsv.ops.sparse_attention import sparse_attention_reference_with_lse
from dsv.ops.sparse_attention import triton_kernels as tk

OUT = os.environ.get("OUT", "/tmp")
log_f = open(os.path.join(OUT, "probe.jsonl"), "w")
def log(d):
    print(json.dumps(d), flush=True); log_f.write(json.dumps(d) + "\n"); log_f.flush()

VARS = [(128, 8, 2, 2), (128, 8, 3, 2), (64, 4, 2, 2), (64, 8, 3, 3), (64, 8, 2, 2, None, True), (64, 8, 3, 2, None, True), (128, 8, 2, 2, None, True)]
# correctness: small problems incl. ragged S and per-head keep
for S, sp in [(2048, 0.75), (2000, 0.5), (4096, 0.9)]:
    p = Problem(S, sp, 128, H=3)
    q, k, v = (x.float() for x in (p.q, p.k, p.v))
    ref_o, ref_l = sparse_attention_reference_with_lse(q, k, v, p.index)
    for var in VARS:
        try:
            o, l = sparse_fwd(p.q, p.k, p.v, p.index.indices, p.index.counts, 128, 128, p.scale, *var)
            torch.cuda.synchronize()
            eo, el = rel_err(o, ref_o), rel_err(l, ref_l)
            log(dict(kind="check", S=S, sp=sp, var=var, err_o=eo, err_lse=el, ok=bool(eo < TOL and el < TOL and torch.isfinite(o).all())))
        except Exception as e:
            log(dict(kind="check", S=S, sp=sp, var=var, error=str(e)[:500]))
# a group with no listed block: output 0, LSE -inf
p = Problem(2048, 0.75, 128, H=2)
p.index.counts[0, 1, 3] = 0
for var in VARS:
    o, l = sparse_fwd(p.q, p.k, p.v, p.index.indices, p.index.counts, 128, 128, p.scale, *var)
    rows = slice(3 * 128, 4 * 128)
    log(dict(kind="check_empty", var=var, ok=bool((o[0, 1, rows] == 0).all() and torch.isneginf(l[0, 1, rows]).all() and torch.isfinite(o).all())))
# timing
for S in (32768, 65536):
    for sp in (0.9, 0.95, 0.98):
        p = Problem(S, sp, 128)
        ms = do_bench(lambda: tk.sparse_attention_fwd_launch(p.q, p.k, p.v, p.index.indices, p.index.counts, 128, 128, p.scale), return_mode="median")
        fl = 4 * p.pairs * p.D
        log(dict(kind="time", S=S, sp=sp, var="triton_default", ms=ms, tflops=fl / ms / 1e9))
        ref = tk.sparse_attention_fwd_launch(p.q, p.k, p.v, p.index.indices, p.index.counts, 128, 128, p.scale)
        for var in VARS:
            try:
                o, l = sparse_fwd(p.q, p.k, p.v, p.index.indices, p.index.counts, 128, 128, p.scale, *var)
                agree = rel_err(o, ref[0])
                ms = do_bench(lambda var=var: sparse_fwd(p.q, p.k, p.v, p.index.indices, p.index.counts, 128, 128, p.scale, *var), return_mode="median")
                log(dict(kind="time", S=S, sp=sp, var=var, ms=ms, tflops=fl / ms / 1e9, agree_vs_triton=agree))
            except Exception as e:
                log(dict(kind="time", S=S, sp=sp, var=var, error=str(e)[:300]))
