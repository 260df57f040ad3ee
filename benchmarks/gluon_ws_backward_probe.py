# ruff: noqa: E402, E501, E731, E741, B023
"""Sweep round 11 (prepared, not run): warp-specialized Gluon (Hopper) backward passes (dq; dk/dv) against the Triton defaults, one H200.

    PYTHONPATH=. python benchmarks/gluon_ws_backward_probe.py      (OUT=DIR for probe.jsonl)

The structure of round 9's forward: a one-warp producer streams tiles through TMA rings, one or two consumer
warpgroups of 64 rows (dq: query rows; dk/dv: keys) compute on them, optionally over a persistent grid.
dq pass: S = Q.K^T and dP = dO.V^T issued together, dS = P (dP - delta), dq += dS.K; delta = rowsum(O dO)
computed and stored on the way. dk/dv pass, key-major over the transposed index: S^T = K.Q^T and
dP^T = V.dO^T, dv += P^T.dO, dk += dS^T.Q. Checked against float32 autograd first (ragged S), then timed.
Round 11: dk/dv variants that cut the consumers' registers (VARIANT 1: LSE/delta loaded per sub-tile,
no prefetch, dS computed as late as possible; VARIANT 2: the same with P^T and dS^T through shared memory
for SS wgmma). Kept in history, not in the package.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------
# dq pass: query-major, like the forward
# ------------------------------------------------------------------------------------------------

@gluon.jit
def _dq_tile(tile, n_m, NG, group, IDX, CNT, K_MAX, sub, BLOCK_M: gl.constexpr):
    pid_m = tile % n_m
    bh = tile // n_m
    q_row0 = pid_m * BLOCK_M
    row = bh * NG + q_row0 // group
    n_iter = gl.load(CNT + row) * sub
    idx_row = IDX + row.to(gl.int64) * K_MAX
    return bh, q_row0, n_iter, idx_row


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                 k_empty, v_ready, v_empty, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub):
    N_CONS: gl.constexpr = q_smem.type.shape[0]
    SUB_M: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[2]
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    kv_it = 0
    q_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, q_row0, n_iter, idx_row = _dq_tile(tile, n_m, NG, group, IDX, CNT, K_MAX, sub, SUB_M * N_CONS)
        # Q and dO are loaded for every tile (the consumers compute delta from dO even without keys).
        for c in gl.static_range(N_CONS):
            mbarrier.wait(q_empty.index(c), (q_it & 1) ^ 1)
            # The consumers read dO through registers (generic proxy) before releasing it.
            fence_async_shared()
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [bh, q_row0 + c * SUB_M, 0], q_ready.index(c), q_smem.index(c))
            tma.async_copy_global_to_shared(do_desc, [bh, q_row0 + c * SUB_M, 0], q_ready.index(c),
                                            do_smem.index(c))
        q_it += 1
        for t in range(n_iter):
            start = gl.load(idx_row + t // sub) * kv_block + (t % sub) * BLOCK_N
            pos = kv_it + t
            ks = pos % K_STAGES
            mbarrier.wait(k_empty.index(ks), ((pos // K_STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bh, start, 0], k_ready.index(ks), k_smem.index(ks))
            vs = pos % V_STAGES
            mbarrier.wait(v_empty.index(vs), ((pos // V_STAGES) & 1) ^ 1)
            mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [bh, start, 0], v_ready.index(vs), v_smem.index(vs))
        kv_it += n_iter


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                 OUT, LSE, DLSE, DELTA, DQ, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub,
                 H, S, sob, soh, sos, sqb, sqh, sqs, qk_scale, sm_scale, even_n, has_dlse, C: gl.constexpr):
    N_CONS: gl.constexpr = q_smem.type.shape[0]
    SUB_M: gl.constexpr = q_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[3]
    BLOCK_N: gl.constexpr = k_smem.type.shape[2]
    K_STAGES: gl.constexpr = k_smem.type.shape[0]
    V_STAGES: gl.constexpr = v_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_smem.dtype

    q2 = q_smem.index(C).reshape([SUB_M, HEAD_DIM])
    do2 = do_smem.index(C).reshape([SUB_M, HEAD_DIM])
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout)
    offs_d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs_d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld_layout))
    kv_it = 0
    q_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, q_row0, n_iter, idx_row = _dq_tile(tile, n_m, NG, group, IDX, CNT, K_MAX, sub, SUB_M * N_CONS)
        row0 = q_row0 + C * SUB_M
        b = bh // H
        h = bh % H
        # delta = rowsum(out * dO) - dLSE, stored for the dk/dv pass.
        offs_m_ld = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, ld_layout))
        o_ptr = (OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m_ld[:, None].to(gl.int64) * sos
                 + offs_d_ld[None, :])
        o = gl.load(o_ptr, mask=offs_m_ld[:, None] < S, other=0.0)
        mbarrier.wait(q_ready.index(C), q_it & 1)
        do = do2.load(ld_layout)
        delta = gl.convert_layout(gl.sum(o.to(gl.float32) * do.to(gl.float32), 1), row_s)
        offs_m = row0 + gl.arange(0, SUB_M, layout=row_s)
        vec = bh.to(gl.int64) * S + offs_m
        if has_dlse != 0:
            delta -= gl.load(DLSE + vec, mask=offs_m < S, other=0.0)
        gl.store(DELTA + vec, delta, mask=offs_m < S)
        # Rows past S have q = dO = 0 and delta = 0, so any finite LSE gives them dS = 0.
        lse2 = gl.load(LSE + vec, mask=offs_m < S, other=0.0) * 1.4426950408889634

        dq = warpgroup_mma_init(gl.zeros([SUB_M, HEAD_DIM], gl.float32, o_layout))
        for j in range(n_iter):
            pos = kv_it + j
            ks = pos % K_STAGES
            vs = pos % V_STAGES
            mbarrier.wait(k_ready.index(ks), (pos // K_STAGES) & 1)
            s_tok = warpgroup_mma(q2, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(vs), (pos // V_STAGES) & 1)
            dp_tok = warpgroup_mma(do2, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
            # In order: the previous tile's dS.K has retired too, so its K slot is free.
            qk, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, dp_tok))
            if j > 0:
                mbarrier.arrive(k_empty.index((pos - 1) % K_STAGES), count=1)
            mbarrier.arrive(v_empty.index(vs), count=1)
            p = gl.exp2(qk * qk_scale - lse2[:, None])
            if even_n == 0:
                cols = gl.load(idx_row + j // sub) * kv_block + (j % sub) * BLOCK_N + offs_n
                p = gl.where(cols[None, :] < S, p, 0.0)
            ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), ds_layout)
            dq = warpgroup_mma(ds, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        if n_iter > 0:
            mbarrier.arrive(k_empty.index((kv_it + n_iter - 1) % K_STAGES), count=1)
        # This tile's Q and dO are no longer read: the producer may load the next tile's.
        mbarrier.arrive(q_empty.index(C), count=1)
        q_it += 1
        kv_it += n_iter

        dq = dq * sm_scale
        offs_m_o = row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, o_layout))
        dq_ptr = (DQ + b.to(gl.int64) * sqb + h.to(gl.int64) * sqh + offs_m_o[:, None].to(gl.int64) * sqs
                  + offs_d_o[None, :])
        gl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=offs_m_o[:, None] < S)


@gluon.jit
def _dq_consumer0(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  OUT, LSE, DLSE, DELTA, DQ, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub,
                  H, S, sob, soh, sos, sqb, sqh, sqs, qk_scale, sm_scale, even_n, has_dlse):
    _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                 OUT, LSE, DLSE, DELTA, DQ, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub,
                 H, S, sob, soh, sos, sqb, sqh, sqs, qk_scale, sm_scale, even_n, has_dlse, 0)


@gluon.jit
def _dq_consumer1(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  OUT, LSE, DLSE, DELTA, DQ, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub,
                  H, S, sob, soh, sos, sqb, sqh, sqs, qk_scale, sm_scale, even_n, has_dlse):
    _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                 OUT, LSE, DLSE, DELTA, DQ, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub,
                 H, S, sob, soh, sos, sqb, sqh, sqs, qk_scale, sm_scale, even_n, has_dlse, 1)


@gluon.jit
def sparse_bwd_dq_ws_kernel(q_desc, do_desc, k_desc, v_desc, OUT, LSE, DLSE, DELTA, DQ, IDX, CNT,
                            sob, soh, sos, sqb, sqh, sqs, H, S, NG, K_MAX, num_tiles, qk_scale, sm_scale, has_dlse,
                            GROUP: gl.constexpr, KV_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr,
                            N_CONS: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                            PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    SUB_M: gl.constexpr = 64
    BLOCK_M: gl.constexpr = SUB_M * N_CONS
    sub = KV_BLOCK // BLOCK_N
    kv_block = sub * BLOCK_N
    group = sub * 0 + GROUP
    even_n = (S % KV_BLOCK == 0).to(gl.int32)
    n_m = gl.cdiv(S, BLOCK_M)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [N_CONS] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [N_CONS] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [K_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [V_STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_CONS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=N_CONS)
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=N_CONS)

    prod = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
            k_empty, v_ready, v_empty, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub)
    cons = (q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
            OUT, LSE, DLSE, DELTA, DQ, IDX, CNT, num_tiles, n_m, NG, K_MAX, group, kv_block, sub,
            H, S, sob, soh, sos, sqb, sqh, sqs, qk_scale, sm_scale, even_n, has_dlse)
    if N_CONS == 2:
        gl.warp_specialize([(_dq_consumer0, cons), (_dq_consumer1, cons), (_dq_producer, prod)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_dq_consumer0, cons), (_dq_producer, prod)], [1], [PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------
# dk/dv pass: key-major over the transposed index (offsets, groups)
# ------------------------------------------------------------------------------------------------

@gluon.jit
def _kv_tile(tile, n_kt, NKB, OFFSETS, kv_block, q_sub, KEYS: gl.constexpr):
    pid_n = tile % n_kt
    bh = tile // n_kt
    k_row0 = pid_n * KEYS
    seg = bh * NKB + k_row0 // kv_block
    start = gl.load(OFFSETS + seg)
    n_iter = (gl.load(OFFSETS + seg + 1) - start) * q_sub
    return bh, k_row0, start, n_iter


@gluon.jit
def _kv_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty,
                 q_ready, q_empty, d_ready, d_empty, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub):
    N_CONS: gl.constexpr = k_smem.type.shape[0]
    SUB_N: gl.constexpr = k_smem.type.shape[2]
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    Q_STAGES: gl.constexpr = q_smem.type.shape[0]
    D_STAGES: gl.constexpr = do_smem.type.shape[0]
    it = 0
    t_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, k_row0, start, n_iter = _kv_tile(tile, n_kt, NKB, OFFSETS, kv_block, q_sub, SUB_N * N_CONS)
        for c in gl.static_range(N_CONS):
            mbarrier.wait(kv_empty.index(c), (t_it & 1) ^ 1)
            mbarrier.expect(kv_ready.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [bh, k_row0 + c * SUB_N, 0], kv_ready.index(c), k_smem.index(c))
            tma.async_copy_global_to_shared(v_desc, [bh, k_row0 + c * SUB_N, 0], kv_ready.index(c), v_smem.index(c))
        t_it += 1
        for t in range(n_iter):
            row = gl.load(GROUPS + start + t // q_sub) * group + (t % q_sub) * BLOCK_M
            pos = it + t
            qs = pos % Q_STAGES
            mbarrier.wait(q_empty.index(qs), ((pos // Q_STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [bh, row, 0], q_ready.index(qs), q_smem.index(qs))
            ds = pos % D_STAGES
            mbarrier.wait(d_empty.index(ds), ((pos // D_STAGES) & 1) ^ 1)
            mbarrier.expect(d_ready.index(ds), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [bh, row, 0], d_ready.index(ds), do_smem.index(ds))
        it += n_iter


@gluon.jit
def _kv_consumer(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, C: gl.constexpr):
    # SUB_N keys of the tile against every listed query sub-tile: S^T = K.Q^T, P^T from the saved LSE,
    # dv += P^T.dO, dP^T = V.dO^T, dS^T = P^T (dP^T - delta), dk += dS^T.Q.
    N_CONS: gl.constexpr = k_smem.type.shape[0]
    SUB_N: gl.constexpr = k_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[3]
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    Q_STAGES: gl.constexpr = q_smem.type.shape[0]
    D_STAGES: gl.constexpr = do_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    k2 = k_smem.index(C).reshape([SUB_N, HEAD_DIM])
    v2 = v_smem.index(C).reshape([SUB_N, HEAD_DIM])
    offs_m = gl.arange(0, BLOCK_M, layout=col_s)
    zero_s = gl.zeros([SUB_N, BLOCK_M], gl.float32, s_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    it = 0
    t_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, k_row0, start, n_iter = _kv_tile(tile, n_kt, NKB, OFFSETS, kv_block, q_sub, SUB_N * N_CONS)
        vec_base = bh.to(gl.int64) * S
        dk = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
        dv = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
        mbarrier.wait(kv_ready.index(C), t_it & 1)
        rows = gl.load(GROUPS + start, mask=n_iter > 0, other=0) * group + offs_m
        lse2 = gl.load(LSE + vec_base + rows, mask=rows < S, other=float("inf")) * 1.4426950408889634
        delta = gl.load(DELTA + vec_base + rows, mask=rows < S, other=0.0)
        for t in range(n_iter):
            pos = it + t
            qs = pos % Q_STAGES
            dss = pos % D_STAGES
            mbarrier.wait(q_ready.index(qs), (pos // Q_STAGES) & 1)
            st_tok = warpgroup_mma(k2, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
            mbarrier.wait(d_ready.index(dss), (pos // D_STAGES) & 1)
            dpt_tok = warpgroup_mma(v2, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                    use_acc=False, is_async=True)
            # Prefetch the next sub-tile's LSE and delta while the matmuls run (the last one re-reads this one).
            tn = gl.minimum(t + 1, n_iter - 1)
            rows_n = gl.load(GROUPS + start + tn // q_sub) * group + (tn % q_sub) * BLOCK_M + offs_m
            lse2_n = gl.load(LSE + vec_base + rows_n, mask=rows_n < S, other=float("inf")) * 1.4426950408889634
            delta_n = gl.load(DELTA + vec_base + rows_n, mask=rows_n < S, other=0.0)
            # In order: the previous sub-tile's dv and dk matmuls have retired too, so its Q and dO slots are free.
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st_tok, dpt_tok))
            if t > 0:
                mbarrier.arrive(q_empty.index((pos - 1) % Q_STAGES), count=1)
                mbarrier.arrive(d_empty.index((pos - 1) % D_STAGES), count=1)
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            dst = pt * (dpt - delta[None, :])
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dst_op = gl.convert_layout(dst.to(dtype), a_layout)
            dv = warpgroup_mma(pt_op, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
            lse2 = lse2_n
            delta = delta_n
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        if n_iter > 0:
            last = it + n_iter - 1
            mbarrier.arrive(q_empty.index(last % Q_STAGES), count=1)
            mbarrier.arrive(d_empty.index(last % D_STAGES), count=1)
        mbarrier.arrive(kv_empty.index(C), count=1)
        t_it += 1
        it += n_iter

        dk = dk * sm_scale
        offs_n = k_row0 + C * SUB_N + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, o_layout))
        # dk/dv are allocated contiguous by the launcher.
        out_off = vec_base * HEAD_DIM + offs_n[:, None].to(gl.int64) * HEAD_DIM + offs_d[None, :]
        gl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < S)
        gl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < S)


@gluon.jit
def _kv_consumer_lean(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, C: gl.constexpr):
    # SUB_N keys of the tile against every listed query sub-tile: S^T = K.Q^T, P^T from the saved LSE,
    # dv += P^T.dO, dP^T = V.dO^T, dS^T = P^T (dP^T - delta), dk += dS^T.Q.
    N_CONS: gl.constexpr = k_smem.type.shape[0]
    SUB_N: gl.constexpr = k_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[3]
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    Q_STAGES: gl.constexpr = q_smem.type.shape[0]
    D_STAGES: gl.constexpr = do_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    k2 = k_smem.index(C).reshape([SUB_N, HEAD_DIM])
    v2 = v_smem.index(C).reshape([SUB_N, HEAD_DIM])
    offs_m = gl.arange(0, BLOCK_M, layout=col_s)
    zero_s = gl.zeros([SUB_N, BLOCK_M], gl.float32, s_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    it = 0
    t_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, k_row0, start, n_iter = _kv_tile(tile, n_kt, NKB, OFFSETS, kv_block, q_sub, SUB_N * N_CONS)
        vec_base = bh.to(gl.int64) * S
        dk = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
        dv = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
        mbarrier.wait(kv_ready.index(C), t_it & 1)
        for t in range(n_iter):
            pos = it + t
            qs = pos % Q_STAGES
            dss = pos % D_STAGES
            rows = gl.load(GROUPS + start + t // q_sub) * group + (t % q_sub) * BLOCK_M + offs_m
            lse2 = gl.load(LSE + vec_base + rows, mask=rows < S, other=float("inf")) * 1.4426950408889634
            mbarrier.wait(q_ready.index(qs), (pos // Q_STAGES) & 1)
            st_tok = warpgroup_mma(k2, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
            mbarrier.wait(d_ready.index(dss), (pos // D_STAGES) & 1)
            dpt_tok = warpgroup_mma(v2, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                    use_acc=False, is_async=True)
            # In order: the previous sub-tile's dv and dk matmuls have retired too, so its Q and dO slots are free.
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            delta = gl.load(DELTA + vec_base + rows, mask=rows < S, other=0.0)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt_tok,))
            if t > 0:
                mbarrier.arrive(q_empty.index((pos - 1) % Q_STAGES), count=1)
                mbarrier.arrive(d_empty.index((pos - 1) % D_STAGES), count=1)
            dst_op = gl.convert_layout((pt * (dpt - delta[None, :])).to(dtype), a_layout)
            pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt_op, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        if n_iter > 0:
            last = it + n_iter - 1
            mbarrier.arrive(q_empty.index(last % Q_STAGES), count=1)
            mbarrier.arrive(d_empty.index(last % D_STAGES), count=1)
        mbarrier.arrive(kv_empty.index(C), count=1)
        t_it += 1
        it += n_iter

        dk = dk * sm_scale
        offs_n = k_row0 + C * SUB_N + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, o_layout))
        # dk/dv are allocated contiguous by the launcher.
        out_off = vec_base * HEAD_DIM + offs_n[:, None].to(gl.int64) * HEAD_DIM + offs_d[None, :]
        gl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < S)
        gl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < S)


@gluon.jit
def _kv_consumer_smem(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, C: gl.constexpr):
    # SUB_N keys of the tile against every listed query sub-tile: S^T = K.Q^T, P^T from the saved LSE,
    # dv += P^T.dO, dP^T = V.dO^T, dS^T = P^T (dP^T - delta), dk += dS^T.Q.
    N_CONS: gl.constexpr = k_smem.type.shape[0]
    SUB_N: gl.constexpr = k_smem.type.shape[2]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[3]
    BLOCK_M: gl.constexpr = q_smem.type.shape[2]
    Q_STAGES: gl.constexpr = q_smem.type.shape[0]
    D_STAGES: gl.constexpr = do_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = q_smem.dtype

    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_N, BLOCK_M], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [SUB_N, BLOCK_M], p_smem_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [SUB_N, BLOCK_M], p_smem_layout)
    k2 = k_smem.index(C).reshape([SUB_N, HEAD_DIM])
    v2 = v_smem.index(C).reshape([SUB_N, HEAD_DIM])
    offs_m = gl.arange(0, BLOCK_M, layout=col_s)
    zero_s = gl.zeros([SUB_N, BLOCK_M], gl.float32, s_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    it = 0
    t_it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, k_row0, start, n_iter = _kv_tile(tile, n_kt, NKB, OFFSETS, kv_block, q_sub, SUB_N * N_CONS)
        vec_base = bh.to(gl.int64) * S
        dk = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
        dv = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
        mbarrier.wait(kv_ready.index(C), t_it & 1)
        for t in range(n_iter):
            pos = it + t
            qs = pos % Q_STAGES
            dss = pos % D_STAGES
            rows = gl.load(GROUPS + start + t // q_sub) * group + (t % q_sub) * BLOCK_M + offs_m
            lse2 = gl.load(LSE + vec_base + rows, mask=rows < S, other=float("inf")) * 1.4426950408889634
            mbarrier.wait(q_ready.index(qs), (pos // Q_STAGES) & 1)
            st_tok = warpgroup_mma(k2, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)
            mbarrier.wait(d_ready.index(dss), (pos // D_STAGES) & 1)
            dpt_tok = warpgroup_mma(v2, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                    use_acc=False, is_async=True)
            # In order: the previous sub-tile's dv and dk matmuls have retired too, so its Q and dO slots are free.
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
            pt = gl.exp2(st * qk_scale - lse2[None, :])
            delta = gl.load(DELTA + vec_base + rows, mask=rows < S, other=0.0)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt_tok,))
            if t > 0:
                mbarrier.arrive(q_empty.index((pos - 1) % Q_STAGES), count=1)
                mbarrier.arrive(d_empty.index((pos - 1) % D_STAGES), count=1)
            # The previous sub-tile's dv/dk matmuls (which read p_smem/ds_smem) retired at the wait above.
            ds_smem.store((pt * (dpt - delta[None, :])).to(dtype))
            p_smem.store(pt.to(dtype))
            fence_async_shared()
            dv = warpgroup_mma(p_smem, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
            dk = warpgroup_mma(ds_smem, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
        if n_iter > 0:
            last = it + n_iter - 1
            mbarrier.arrive(q_empty.index(last % Q_STAGES), count=1)
            mbarrier.arrive(d_empty.index(last % D_STAGES), count=1)
        mbarrier.arrive(kv_empty.index(C), count=1)
        t_it += 1
        it += n_iter

        dk = dk * sm_scale
        offs_n = k_row0 + C * SUB_N + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, o_layout))
        # dk/dv are allocated contiguous by the launcher.
        out_off = vec_base * HEAD_DIM + offs_n[:, None].to(gl.int64) * HEAD_DIM + offs_d[None, :]
        gl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < S)
        gl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < S)


@gluon.jit
def _kv_lean0(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                  LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                  S, qk_scale, sm_scale):
    _kv_consumer_lean(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, 0)


@gluon.jit
def _kv_lean1(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                  LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                  S, qk_scale, sm_scale):
    _kv_consumer_lean(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, 1)


@gluon.jit
def _kv_smem0(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                  LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                  S, qk_scale, sm_scale):
    _kv_consumer_smem(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, 0)


@gluon.jit
def _kv_smem1(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                  LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                  S, qk_scale, sm_scale):
    _kv_consumer_smem(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, 1)


@gluon.jit
def _kv_consumer0(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                  LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                  S, qk_scale, sm_scale):
    _kv_consumer(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, 0)


@gluon.jit
def _kv_consumer1(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                  LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                  S, qk_scale, sm_scale):
    _kv_consumer(q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
                 LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
                 S, qk_scale, sm_scale, 1)


@gluon.jit
def sparse_bwd_dkdv_ws_kernel(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                              S, NKB, num_tiles, qk_scale, sm_scale,
                              GROUP: gl.constexpr, KV_BLOCK: gl.constexpr, BLOCK_M: gl.constexpr,
                              N_CONS: gl.constexpr, Q_STAGES: gl.constexpr, D_STAGES: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, VARIANT: gl.constexpr,
                              num_warps: gl.constexpr):
    # N_CONS consumer warpgroups of 64 keys each (one key block's keys: KV_BLOCK % (64 * N_CONS) == 0)
    # share the Q/dO sub-tiles of the groups that list the block, streamed by a one-warp producer.
    SUB_N: gl.constexpr = 64
    KEYS: gl.constexpr = SUB_N * N_CONS
    q_sub = GROUP // BLOCK_M
    group = q_sub * BLOCK_M
    kv_block = q_sub * 0 + KV_BLOCK
    n_kt = gl.cdiv(S, KEYS)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [Q_STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [D_STAGES] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [N_CONS] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [N_CONS] + v_desc.block_type.shape, v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_STAGES, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [D_STAGES, 1], mbarrier.MBarrierLayout())
    d_empty = gl.allocate_shared_memory(gl.int64, [D_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N_CONS):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    for i in gl.static_range(Q_STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=N_CONS)
    for i in gl.static_range(D_STAGES):
        mbarrier.init(d_ready.index(i), count=1)
        mbarrier.init(d_empty.index(i), count=N_CONS)

    prod = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty,
            q_ready, q_empty, d_ready, d_empty, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub)
    cons = (q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty, q_ready, q_empty, d_ready, d_empty,
            LSE, DELTA, DK, DV, OFFSETS, GROUPS, num_tiles, n_kt, NKB, group, kv_block, q_sub,
            S, qk_scale, sm_scale)
    if VARIANT == 1:
        gl.warp_specialize([(_kv_lean0, cons), (_kv_lean1, cons), (_kv_producer, prod)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif VARIANT == 2:
        gl.warp_specialize([(_kv_smem0, cons), (_kv_smem1, cons), (_kv_producer, prod)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif N_CONS == 2:
        gl.warp_specialize([(_kv_consumer0, cons), (_kv_consumer1, cons), (_kv_producer, prod)],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_kv_consumer0, cons), (_kv_producer, prod)], [1], [PRODUCER_REGS])


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------

def _desc(x, rows):
    B, H, S, D = x.shape
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for([1, rows, D], gdt)
    return TensorDescriptor.from_tensor(x.reshape(B * H, S, D), [1, rows, D], lay)


_SMS = {}


def _grid(num_tiles, persistent, device):
    if not persistent:
        return (num_tiles,)
    dev = device.index
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return (min(num_tiles, persistent * _SMS[dev]),)


def bwd_dq_ws(q, k, v, out, do, lse, dlse, indices, counts, group_size, kv_block, scale, block_n=64, n_cons=2,
              k_stages=2, v_stages=2, maxnreg=168, producer_regs=24, consumer_regs=240, persistent=0):
    B, H, S, D = q.shape
    q, k, v, out, do = (x.contiguous() for x in (q, k, v, out, do))
    assert group_size % (64 * n_cons) == 0 and kv_block % block_n == 0
    dq = torch.empty_like(q)
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    num_tiles = triton.cdiv(S, 64 * n_cons) * B * H
    sparse_bwd_dq_ws_kernel[_grid(num_tiles, persistent, q.device)](
        _desc(q, 64), _desc(do, 64), _desc(k, block_n), _desc(v, block_n), out, lse,
        dlse if dlse is not None else lse, delta, dq, indices, counts, *out.stride()[:3], *dq.stride()[:3],
        H, S, indices.shape[2], indices.shape[3], num_tiles, scale * LOG2E, scale, int(dlse is not None),
        GROUP=group_size, KV_BLOCK=kv_block, BLOCK_N=block_n, N_CONS=n_cons, K_STAGES=k_stages,
        V_STAGES=v_stages, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, num_warps=4,
        maxnreg=maxnreg)
    return dq, delta


def bwd_dkdv_ws(q, k, v, do, lse, delta, offsets, groups, group_size, kv_block, scale, block_m=64, n_cons=2,
                q_stages=2, d_stages=2, maxnreg=168, producer_regs=24, consumer_regs=240, persistent=0, variant=0):
    B, H, S, D = q.shape
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    assert kv_block % (64 * n_cons) == 0 and group_size % block_m == 0
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    num_tiles = triton.cdiv(S, 64 * n_cons) * B * H
    nkb = triton.cdiv(S, kv_block)
    sparse_bwd_dkdv_ws_kernel[_grid(num_tiles, persistent, q.device)](
        _desc(q, block_m), _desc(do, block_m), _desc(k, 64), _desc(v, 64), lse, delta, dk, dv, offsets, groups,
        S, nkb, num_tiles, scale * LOG2E, scale,
        GROUP=group_size, KV_BLOCK=kv_block, BLOCK_M=block_m, N_CONS=n_cons, Q_STAGES=q_stages,
        D_STAGES=d_stages, PRODUCER_REGS=producer_regs, CONSUMER_REGS=consumer_regs, VARIANT=variant, num_warps=4,
        maxnreg=maxnreg)
    return dk, dv


import json
import os
import sys

from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
from kernel_sweep import TOL, Problem, rel_err

from dsv.ops.sparse_attention import triton_kernels as tk

OUT = os.environ.get("OUT", "/tmp")
log_f = open(os.path.join(OUT, "probe.jsonl"), "w")


def log(d):
    print(json.dumps(d), flush=True)
    log_f.write(json.dumps(d) + "\n")
    log_f.flush()


# dq: (block_n, n_cons, k_stages, v_stages, maxnreg, producer_regs, consumer_regs, persistent)
DQ_VARS = [(128, 2, 2, 2, 168, 24, 240, 1)]
# dk/dv: (block_m, n_cons, q_stages, do_stages, maxnreg, producer_regs, consumer_regs, persistent, variant)
KV_VARS = [(64, 2, 2, 2, 168, 24, 240, 0, 1), (64, 2, 2, 2, 168, 24, 240, 1, 1), (64, 2, 3, 3, 168, 24, 240, 1, 1),
           (64, 2, 2, 2, 168, 24, 240, 0, 2), (64, 2, 3, 3, 168, 24, 240, 1, 2), (32, 1, 3, 3, 128, 24, 232, 2, 0)]


def fits(var, block):
    return block % (64 * var[1]) == 0


print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
good_dq, good_kv = [], []
checks = [(2048, 0.75, 128, 2), (2000, 0.5, 128, 3), (2000, 0.6, 64, 2)]
probs = [(Problem(S, sp, blk, H=H), blk) for S, sp, blk, H in checks]
refs = [p.reference() for p, _ in probs]
# A group with no key block and a key block no group lists (zero dq rows / zero dk, dv rows).
probs[0][0].index.counts[0, 1, 3] = 0
for var in DQ_VARS:
    ok = True
    for (p, blk), ref in zip(probs, refs):
        if not fits(var, blk):
            continue
        try:
            dq, delta = bwd_dq_ws(p.q, p.k, p.v, p.out, p.do, p.lse, None, p.index.indices, p.index.counts, blk, blk,
                                  p.scale, *var)
            torch.cuda.synchronize()
            _, want_delta = tk._launch_bwd_dq(p.q, p.k, p.v, p.out, p.do, p.lse, None, p.index.indices,
                                              p.index.counts, blk, blk, p.scale, tk.default_config(p.D, blk, blk, tma=True).bwd_dq)
            want_dq = tk._launch_bwd_dq(p.q, p.k, p.v, p.out, p.do, p.lse, None, p.index.indices,
                                        p.index.counts, blk, blk, p.scale, tk.default_config(p.D, blk, blk, tma=True).bwd_dq)[0]
            e = rel_err(dq, want_dq if p is probs[0][0] else ref["dq"][0])
            ed = rel_err(delta, want_delta)
            here = bool(e < TOL and ed < 1e-5 and torch.isfinite(dq).all())
            log(dict(kind="check_dq", S=p.S, block=blk, var=var, err=e, err_delta=ed, ok=here))
        except Exception as ex:
            here = False
            log(dict(kind="check_dq", S=p.S, block=blk, var=var, error=str(ex)[:800]))
        ok = ok and here
    if ok:
        good_dq.append(var)
for var in KV_VARS:
    ok = True
    for (p, blk), ref in zip(probs, refs):
        if not fits(var, blk):
            continue
        try:
            _, delta = tk._launch_bwd_dq(p.q, p.k, p.v, p.out, p.do, p.lse, None, p.index.indices,
                                         p.index.counts, blk, blk, p.scale, tk.default_config(p.D, blk, blk, tma=True).bwd_dq)
            from dsv.ops.index import key_major_csr
            offsets, groups = key_major_csr(p.index.indices, triton.cdiv(p.S, blk)) if p is probs[0][0] else (p.offsets, p.groups)
            dk, dv = bwd_dkdv_ws(p.q, p.k, p.v, p.do, p.lse, delta, offsets, groups, blk, blk, p.scale, *var)
            torch.cuda.synchronize()
            if p is probs[0][0]:
                want = tk._launch_bwd_dkdv(p.q, p.k, p.v, p.do, p.lse, delta, offsets, groups, blk, blk, p.scale,
                                           tk.default_config(p.D, blk, blk, tma=True).bwd_dkdv)
            else:
                want = ref["dkdv"]
            ek, ev = rel_err(dk, want[0]), rel_err(dv, want[1])
            here = bool(ek < TOL and ev < TOL and torch.isfinite(dk).all() and torch.isfinite(dv).all())
            log(dict(kind="check_dkdv", S=p.S, block=blk, var=var, err_dk=ek, err_dv=ev, ok=here))
        except Exception as ex:
            here = False
            log(dict(kind="check_dkdv", S=p.S, block=blk, var=var, error=str(ex)[:800]))
        ok = ok and here
    if ok:
        good_kv.append(var)
log(dict(kind="good", dq=good_dq, dkdv=good_kv))

for block, shapes in ((128, [(32768, 0.9), (32768, 0.95), (32768, 0.98), (65536, 0.9), (65536, 0.95), (65536, 0.98)]),
                      (64, [(32768, 0.9), (32768, 0.95), (32768, 0.98)])):
    for S, sp in shapes:
        p = Problem(S, sp, block)
        default = tk.default_config(p.D, block, block, tma=True)
        for kernel, vars_, units in (("dq", good_dq, 6), ("dkdv", good_kv, 8)):
            fl = units * p.pairs * p.D
            cfg = default.bwd_dq if kernel == "dq" else default.bwd_dkdv
            ms = do_bench(lambda: p.run(kernel, cfg), return_mode="median")
            log(dict(kind="time", kernel=kernel, S=S, sp=sp, block=block, var="triton_default", ms=ms, tflops=fl / ms / 1e9))
            want = p.run(kernel, cfg)
            for var in vars_:
                if not fits(var, block):
                    continue
                if kernel == "dq":
                    fn = lambda var=var: bwd_dq_ws(p.q, p.k, p.v, p.out, p.do, p.lse, None, p.index.indices, p.index.counts, block, block, p.scale, *var)
                else:
                    fn = lambda var=var: bwd_dkdv_ws(p.q, p.k, p.v, p.do, p.lse, p.delta, p.offsets, p.groups, block, block, p.scale, *var)
                try:
                    got = fn()
                    agree = max(rel_err(a, b) for a, b in zip(got, want))
                    ms = do_bench(fn, return_mode="median")
                    log(dict(kind="time", kernel=kernel, S=S, sp=sp, block=block, var=var, ms=ms, tflops=fl / ms / 1e9, agree_vs_triton=agree))
                except Exception as ex:
                    log(dict(kind="time", kernel=kernel, S=S, sp=sp, block=block, var=var, error=str(ex)[:300]))
