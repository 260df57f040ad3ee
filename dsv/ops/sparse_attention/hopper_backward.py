"""Fused sparse-attention backward for Hopper GPUs (compute capability 9.x), written in Gluon.

The same gradients as the split Triton backward (``triton_kernels``: a query-major dq pass and a key-major
dk/dv pass, each recomputing P and dP, 7 matmuls per tile pair), in one key-major pass of 5: each program owns
a 128-key tile and walks the query sub-tiles (64 rows) of the groups that listed it, and dq is added into an
fp32 accumulator.

- A one-warp *producer* streams the tile's K and V once and each listed group's Q and dO sub-tiles through
  two-stage TMA rings.
- Two *consumer* warpgroups own 64 keys each: S^T = K Q^T and dP^T = V dO^T as asynchronous wgmma, P^T and
  dS^T through shared memory, dv += P^T dO, dk += dS^T Q. Each consumer also computes dq of the previous
  sub-tile for half of the head dim, dS (both consumers' halves, all 128 keys) times K, so the two may be one
  sub-tile apart instead of meeting at every sub-tile.
- A one-warp *reducer* adds each staged dq tile into the accumulator with a TMA bulk reduction
  (``cp.reduce.async.bulk.tensor``) and frees the staging slot once the reduction has read it: the
  consumers only store the tile, fence and signal (benchmarks/NOTES.md, rounds 12-15: with the reductions
  issued and waited for by the consumers themselves the pass only tied the split backward).

Measured on one H200 (NOTES, round 15; B=1, H=24, D=128, bf16, 128-token groups and blocks): 7.70-7.81 ms
against the split backward's 8.24-9.01 at 32k tokens and 90% sparsity (26 blocks a group), 31.3-31.6
against 32.3-33.3 at 64k/90%; rounds 16-17: 2-9% faster at 13 blocks, even at 10 and 3-13% slower at 5
blocks a group, so the launcher takes it from ``MIN_LISTED_BLOCKS`` blocks a group (the index's K_max). In
``dsv bench kernels`` (one launch, from 10 blocks) forward+backward went from 10.70 ms with the split backward
to 9.76 at 32k/90%, from 42.57 to 39.45 at 64k/90% and from 5.71 to 5.43 at 32k/95%
(benchmarks/results/2026-11-30-h200-kernels-one-launch-backward.md).

All heads run in one launch. dq is converted from the fp32 accumulator in place, into the first half of its
memory (``narrow_in_place``), so the backward needs about dq's own bf16 size more than the split backward
while it runs, and dq keeps the accumulator's memory until it is freed. The partial sums of dq arrive in an order
that varies from run to run, so dq is not bitwise reproducible (dk, dv are); under
``torch.use_deterministic_algorithms(True)`` the split backward runs.

``hopper_backward_unsupported`` says why inputs do not take it (the split Triton backward runs instead);
``DSV_HOPPER_BACKWARD=0`` in the environment turns it off.
"""

from __future__ import annotations

import os

import torch

from dsv.ops.sparse_attention import hopper_kernels as _hopper

ENABLED = os.environ.get("DSV_HOPPER_BACKWARD", "1") != "0"  # read once, at import
# From this many listed key blocks a group the fused backward runs. Measured on one H200 against the split
# backward (NOTES, rounds 15-17 and the one-launch A/B): 5 blocks a group 3-13% slower, 10 even (-3% to +1%),
# 13 2-9% faster, 26 mostly 5-9% faster (single timings up to 11% slower at 64k in round 15), 51 faster on
# average (single timings -7% to +6%). The rule reads the index's K_max (a shape: no device sync), so an index
# whose groups list very unequal counts is judged by its longest list.
MIN_LISTED_BLOCKS = 10
_MAXNREG = 168  # 12 warps (two consumer warpgroups, the producer and reducer padded to one) fill 64K registers
_CONSUMER_REGS = 240  # each consumer warpgroup's (the first, the default partition, gets what is left: 240)
_SERVICE_REGS = 24  # the producer's and the reducer's
_SUB = 64  # rows of a query sub-tile and keys of a consumer
_KEYS = 2 * _SUB  # keys of a program's tile

BACKWARD_IMPORT_ERROR = _hopper.GLUON_IMPORT_ERROR
if BACKWARD_IMPORT_ERROR is None:
    try:
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

        _tma_load = _hopper._tma_load
        _tma_reduce_add = getattr(tma, "async_atomic_add", None)
        if _tma_reduce_add is None:  # triton 3.6 has the operation (bulk tensor reduction) but no wrapper for it
            from triton._C.libtriton import ir as _ir
            from triton.experimental.gluon.language._core import builtin

            @builtin
            def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
                coord = _semantic._convert_to_ir_values(coord, require_i64=False)
                _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                          src.handle)
    except (ImportError, AttributeError) as error:  # pragma: no cover - depends on the installed triton
        BACKWARD_IMPORT_ERROR = f"this triton lacks the Gluon Hopper operations the fused backward uses ({error})"


def hopper_backward_missing(q: torch.Tensor) -> str | None:
    """On an enabled Hopper GPU: what the fused backward lacks for inputs like ``q [B, H, S, D]`` (the dtype
    or head dim it does not cover, or triton's Gluon API), or None. Unlike the groupings, index lengths and
    the deterministic mode that ``hopper_backward_unsupported`` also leaves to the split backward, these leave
    speed on the table: a layer warns with the reason."""
    if not ENABLED or not q.is_cuda or not _hopper._is_hopper(q.device):
        return None
    if BACKWARD_IMPORT_ERROR is not None:
        return BACKWARD_IMPORT_ERROR
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype}; it takes bfloat16 or float16"
    if q.shape[-1] != 128:  # its shared-memory plan (213.6 KB) is that of head dim 128; others not measured
        return f"head dim {q.shape[-1]}; it takes 128"
    return None


def hopper_backward_unsupported(q: torch.Tensor, group_size: int, kv_block: int,
                                listed_blocks: int | None = None) -> str | None:
    """Why the fused Hopper backward does not run on inputs like ``q [B, H, S, D]`` with this grouping (the
    split Triton backward then runs), or None when it does. ``listed_blocks``: the index's ``K_max``."""
    if not ENABLED:
        return "turned off by DSV_HOPPER_BACKWARD=0"
    if not q.is_cuda or not _hopper._is_hopper(q.device):
        return "needs an NVIDIA Hopper GPU (compute capability 9.x)"
    missing = hopper_backward_missing(q)
    if missing is not None:
        return missing
    if torch.are_deterministic_algorithms_enabled():
        return ("torch.use_deterministic_algorithms is on: the fused backward adds dq's partial sums in an order "
                "that varies from run to run")
    if group_size % _SUB or kv_block % _KEYS:
        return (f"group_size {group_size} with kv_block {kv_block}: it takes groups of a multiple of {_SUB} tokens "
                f"and key blocks of a multiple of {_KEYS}")
    if listed_blocks is not None and listed_blocks < MIN_LISTED_BLOCKS:
        return (f"groups list {listed_blocks} key blocks; below {MIN_LISTED_BLOCKS} it was not measured faster than "
                "the split Triton backward (3-13% slower at 5)")
    return None


if BACKWARD_IMPORT_ERROR is None:

    @gluon.jit
    def _key_tile(tile, n_kt, H, h0, heads, NKB, OFFSETS, kv_block, q_sub, KEYS: gl.constexpr):
        # Tiles are numbered key tile fastest, then head (from h0, `heads` of them), then batch: the programs in
        # flight then share one head's Q and dO in L2 (NOTES, rounds 16-17: other orders were slower).
        pid_n = tile % n_kt
        bhc = tile // n_kt
        b = bhc // heads
        hc = bhc % heads
        h = h0 + hc
        bh = b * H + h
        k_row0 = pid_n * KEYS
        seg = bh * NKB + k_row0 // kv_block
        start = gl.load(OFFSETS + seg)
        n_iter = (gl.load(OFFSETS + seg + 1) - start) * q_sub
        return b, h, hc, bh, k_row0, start, n_iter

    @gluon.jit
    def _sub_tile_row(GROUPS, start, t, q_sub, group, BLOCK_M: gl.constexpr):
        # First query row of sub-tile t of a key tile's walk: the listed groups, each in q_sub sub-tiles.
        return gl.load(GROUPS + start + t // q_sub) * group + (t % q_sub) * BLOCK_M

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty,
                  q_ready, q_empty, d_ready, d_empty, OFFSETS, GROUPS, num_tiles, n_kt, H, h0, heads, NKB, group,
                  kv_block, q_sub):
        # Tile shapes come from the buffers' types: a constant passed into a partition arrives as a value.
        N_CONS: gl.constexpr = k_smem.type.shape[0]
        SUB_N: gl.constexpr = k_smem.type.shape[3]
        BLOCK_M: gl.constexpr = q_smem.type.shape[3]
        Q_STAGES: gl.constexpr = q_smem.type.shape[0]
        D_STAGES: gl.constexpr = do_smem.type.shape[0]
        it = 0
        t_it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, _, _, k_row0, start, n_iter = _key_tile(tile, n_kt, H, h0, heads, NKB, OFFSETS, kv_block, q_sub,
                                                          SUB_N * N_CONS)
            for c in gl.static_range(N_CONS):
                mbarrier.wait(kv_empty.index(c), (t_it & 1) ^ 1)  # a slot starts free: phase 1 passes at once
                mbarrier.expect(kv_ready.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                _tma_load(k_desc, [b, h, k_row0 + c * SUB_N, 0], kv_ready.index(c), k_smem.index(c))
                _tma_load(v_desc, [b, h, k_row0 + c * SUB_N, 0], kv_ready.index(c), v_smem.index(c))
            t_it += 1
            for t in range(n_iter):
                row = _sub_tile_row(GROUPS, start, t, q_sub, group, BLOCK_M)
                pos = it + t
                qs = pos % Q_STAGES
                mbarrier.wait(q_empty.index(qs), ((pos // Q_STAGES) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
                _tma_load(q_desc, [b, h, row, 0], q_ready.index(qs), q_smem.index(qs))
                ds = pos % D_STAGES
                mbarrier.wait(d_empty.index(ds), ((pos // D_STAGES) & 1) ^ 1)
                mbarrier.expect(d_ready.index(ds), do_desc.block_type.nbytes)
                _tma_load(do_desc, [b, h, row, 0], d_ready.index(ds), do_smem.index(ds))
            it += n_iter

    @gluon.jit
    def _dq_mma(ds_smem, k_smem, buf, zero_q, C: gl.constexpr):
        # dq[:, consumer C's columns] = dS (the sub-tile's queries x all keys of the tile) . K[:, those columns]
        N_CONS: gl.constexpr = k_smem.type.shape[0]
        SUB_N: gl.constexpr = k_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
        DQ_COLS: gl.constexpr = HEAD_DIM // N_CONS
        tok = warpgroup_mma(ds_smem.index(buf * N_CONS).permute((1, 0)),
                            k_smem.index(0).reshape([SUB_N, HEAD_DIM]).slice(C * DQ_COLS, DQ_COLS, 1),
                            zero_q, use_acc=False, is_async=True)
        for j in gl.static_range(1, N_CONS):
            tok = warpgroup_mma(ds_smem.index(buf * N_CONS + j).permute((1, 0)),
                                k_smem.index(j).reshape([SUB_N, HEAD_DIM]).slice(C * DQ_COLS, DQ_COLS, 1),
                                tok, is_async=True)
        return tok

    @gluon.jit
    def _dq_handoff(dq_smem, dq_full, dq_empty, dq, g, C: gl.constexpr):
        # Consumer C's dq tile of sub-tile g (counted over the program's walk) into its staging slot, for the
        # reducer; the slot is free once the reducer's reduction of sub-tile g - 1 has read it.
        mbarrier.wait(dq_empty.index(C), (g & 1) ^ 1)
        dq_smem.index(C).reshape([dq.type.shape[0], dq.type.shape[1]]).store(dq)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(C), count=1)

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready, kv_empty, q_ready, q_empty,
                  d_ready, d_empty, ds_full, ds_free, dq_full, dq_empty, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                  num_tiles, n_kt, H, h0, heads, NKB, group, kv_block, q_sub, S, qk_scale, sm_scale,
                  C: gl.constexpr):
        N_CONS: gl.constexpr = k_smem.type.shape[0]
        SUB_N: gl.constexpr = k_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
        BLOCK_M: gl.constexpr = q_smem.type.shape[3]
        Q_STAGES: gl.constexpr = q_smem.type.shape[0]
        D_STAGES: gl.constexpr = do_smem.type.shape[0]
        DQ_COLS: gl.constexpr = HEAD_DIM // N_CONS
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DQ_COLS, 16])
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        dtype: gl.constexpr = q_smem.dtype

        k2 = k_smem.index(C).reshape([SUB_N, HEAD_DIM])
        v2 = v_smem.index(C).reshape([SUB_N, HEAD_DIM])
        my_p = p_smem.index(C)
        offs_m = gl.arange(0, BLOCK_M, layout=col_s)
        offs_k = gl.arange(0, SUB_N, layout=gl.SliceLayout(1, s_layout))
        zero_s = gl.zeros([SUB_N, BLOCK_M], gl.float32, s_layout)
        zero_q = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, q_layout)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        it = 0
        t_it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            _, _, _, bh, k_row0, start, n_iter = _key_tile(tile, n_kt, H, h0, heads, NKB, OFFSETS, kv_block, q_sub,
                                                           SUB_N * N_CONS)
            vec_base = bh.to(gl.int64) * S
            keys = k_row0 + C * SUB_N + offs_k
            dk = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
            dv = warpgroup_mma_init(gl.zeros([SUB_N, HEAD_DIM], gl.float32, o_layout))
            mbarrier.wait(kv_ready.index(C), t_it & 1)
            for t in range(n_iter):
                pos = it + t
                qs = pos % Q_STAGES
                dss = pos % D_STAGES
                buf = pos % 2
                rows = _sub_tile_row(GROUPS, start, t, q_sub, group, BLOCK_M) + offs_m
                # Rows past S read as zero; an infinite LSE makes their P zero.
                lse2 = gl.load(LSE + vec_base + rows, mask=rows < S, other=float("inf")) * 1.4426950408889634
                mbarrier.wait(q_ready.index(qs), (pos // Q_STAGES) & 1)
                st_tok = warpgroup_mma(k2, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)), zero_s,
                                       use_acc=False, is_async=True)
                mbarrier.wait(d_ready.index(dss), (pos // D_STAGES) & 1)
                dpt_tok = warpgroup_mma(v2, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]).permute((1, 0)),
                                        zero_s, use_acc=False, is_async=True)
                st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
                # Keys past S (zeros from TMA) get P = 0, as in the split backward: unmasked, their P = exp(-lse)
                # times delta can overflow fp16 in dS, and inf times their zero K rows is NaN in dq.
                pt = gl.where(keys[:, None] < S, gl.exp2(st * qk_scale - lse2[None, :]), 0.0)
                delta = gl.load(DELTA + vec_base + rows, mask=rows < S, other=0.0)
                dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt_tok,))
                if t > 0:  # every matmul of the previous sub-tile has retired: its Q and dO may be replaced
                    mbarrier.arrive(q_empty.index((pos - 1) % Q_STAGES), count=1)
                    mbarrier.arrive(d_empty.index((pos - 1) % D_STAGES), count=1)
                # This dS^T slot was last read by both consumers' dq matmuls two sub-tiles ago.
                mbarrier.wait(ds_free.index(buf), ((pos // 2) & 1) ^ 1)
                my_ds = ds_smem.index(buf * N_CONS + C)
                my_ds.store((pt * (dpt - delta[None, :])).to(dtype))
                my_p.store(pt.to(dtype))
                fence_async_shared()
                mbarrier.arrive(ds_full.index(buf), count=1)
                # dq of the previous sub-tile, whose dS^T halves both consumers stored an iteration ago. Issued on
                # every iteration (at t == 0 a dummy whose result is dropped): an asynchronous accumulator in
                # flight must not pass through a branch, whose merge would copy registers the tensor cores are
                # still writing (that gave a wrong dk).
                pbuf = (pos + 1) % 2
                if t > 0:
                    mbarrier.wait(ds_full.index(pbuf), ((pos - 1) // 2) & 1)
                dq_tok = _dq_mma(ds_smem, k_smem, pbuf, zero_q, C)
                dk = warpgroup_mma(my_ds, q_smem.index(qs).reshape([BLOCK_M, HEAD_DIM]), dk, is_async=True)
                dv = warpgroup_mma(my_p, do_smem.index(dss).reshape([BLOCK_M, HEAD_DIM]), dv, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq_tok,))
                if t > 0:
                    mbarrier.arrive(ds_free.index(pbuf), count=1)
                    _dq_handoff(dq_smem, dq_full, dq_empty, dq * sm_scale, pos - 1, C)
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
            if n_iter > 0:
                last = it + n_iter - 1
                mbarrier.wait(ds_full.index(last % 2), (last // 2) & 1)
                dq_tok = _dq_mma(ds_smem, k_smem, last % 2, zero_q, C)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok,))
                mbarrier.arrive(ds_free.index(last % 2), count=1)
                _dq_handoff(dq_smem, dq_full, dq_empty, dq * sm_scale, last, C)
                mbarrier.arrive(q_empty.index(last % Q_STAGES), count=1)
                mbarrier.arrive(d_empty.index(last % D_STAGES), count=1)
            # Both consumers' dq matmuls read both K halves: each releases both.
            for j in gl.static_range(N_CONS):
                mbarrier.arrive(kv_empty.index(j), count=1)
            t_it += 1
            it += n_iter

            # A key tile no group listed writes zeros; keys past S are not written.
            dk = dk * sm_scale
            offs_n = k_row0 + C * SUB_N + gl.arange(0, SUB_N, layout=gl.SliceLayout(1, o_layout))
            out_off = vec_base * HEAD_DIM + offs_n[:, None].to(gl.int64) * HEAD_DIM + offs_d[None, :]
            gl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=offs_n[:, None] < S)
            gl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < S)

    @gluon.jit
    def _reducer(acc_desc, dq_smem, dq_full, dq_empty, OFFSETS, GROUPS, num_tiles, n_kt, H, h0, heads, NKB, group,
                 kv_block, q_sub):
        # Adds each consumer's staged dq tile into the accumulator, in the consumers' order of sub-tiles, and
        # frees the slot once the bulk reduction has read it (rows past S are clipped by the descriptor).
        N_CONS: gl.constexpr = dq_smem.type.shape[0]
        BLOCK_M: gl.constexpr = dq_smem.type.shape[3]
        DQ_COLS: gl.constexpr = dq_smem.type.shape[4]
        it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, _, hc, _, _, start, n_iter = _key_tile(tile, n_kt, H, h0, heads, NKB, OFFSETS, kv_block, q_sub,
                                                      BLOCK_M * N_CONS)
            for t in range(n_iter):
                g = it + t
                row0 = _sub_tile_row(GROUPS, start, t, q_sub, group, BLOCK_M)
                for c in gl.static_range(N_CONS):
                    mbarrier.wait(dq_full.index(c), g & 1)
                    _tma_reduce_add(acc_desc, [b, hc, row0, c * DQ_COLS], dq_smem.index(c))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_empty.index(c), count=1)
            it += n_iter

    # One entry per consumer: its index picks its keys at compile time, and a constant passed into a partition
    # would arrive as a runtime value.
    @gluon.jit
    def _consumer0(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready, kv_empty, q_ready, q_empty,
                   d_ready, d_empty, ds_full, ds_free, dq_full, dq_empty, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                   num_tiles, n_kt, H, h0, heads, NKB, group, kv_block, q_sub, S, qk_scale, sm_scale):
        _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready, kv_empty, q_ready, q_empty,
                  d_ready, d_empty, ds_full, ds_free, dq_full, dq_empty, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                  num_tiles, n_kt, H, h0, heads, NKB, group, kv_block, q_sub, S, qk_scale, sm_scale, 0)

    @gluon.jit
    def _consumer1(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready, kv_empty, q_ready, q_empty,
                   d_ready, d_empty, ds_full, ds_free, dq_full, dq_empty, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                   num_tiles, n_kt, H, h0, heads, NKB, group, kv_block, q_sub, S, qk_scale, sm_scale):
        _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready, kv_empty, q_ready, q_empty,
                  d_ready, d_empty, ds_full, ds_free, dq_full, dq_empty, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                  num_tiles, n_kt, H, h0, heads, NKB, group, kv_block, q_sub, S, qk_scale, sm_scale, 1)

    @gluon.jit
    def _sparse_attn_bwd_fused_kernel(q_desc, do_desc, k_desc, v_desc, acc_desc, LSE, DELTA, DK, DV, OFFSETS,
                                      GROUPS, S, H, h0, heads, NKB, num_tiles, qk_scale, sm_scale,
                                      GROUP: gl.constexpr, KV_BLOCK: gl.constexpr, SERVICE_REGS: gl.constexpr,
                                      CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        SUB_N: gl.constexpr = k_desc.block_type.shape[2]
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        N_CONS: gl.constexpr = 2
        STAGES: gl.constexpr = 2
        q_sub = GROUP // BLOCK_M
        group = q_sub * BLOCK_M  # as runtime values: the partitions take them as arguments
        kv_block = q_sub * 0 + KV_BLOCK
        n_kt = gl.cdiv(S, SUB_N * N_CONS)
        dtype: gl.constexpr = q_desc.dtype

        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [N_CONS] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [N_CONS] + v_desc.block_type.shape, v_desc.layout)
        ps_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([SUB_N, BLOCK_M], dtype)
        p_smem = gl.allocate_shared_memory(dtype, [N_CONS, SUB_N, BLOCK_M], ps_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [2 * N_CONS, SUB_N, BLOCK_M], ps_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [N_CONS] + acc_desc.block_type.shape, acc_desc.layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        d_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        d_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_full = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
        dq_empty = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N_CONS):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=N_CONS)
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=N_CONS)  # freed once both consumers are done with it
            mbarrier.init(d_ready.index(i), count=1)
            mbarrier.init(d_empty.index(i), count=N_CONS)
        for i in gl.static_range(2):
            mbarrier.init(ds_full.index(i), count=N_CONS)
            mbarrier.init(ds_free.index(i), count=N_CONS)

        producer = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, kv_empty,
                    q_ready, q_empty, d_ready, d_empty, OFFSETS, GROUPS, num_tiles, n_kt, H, h0, heads, NKB, group,
                    kv_block, q_sub)
        consumer = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, dq_smem, kv_ready, kv_empty, q_ready, q_empty,
                    d_ready, d_empty, ds_full, ds_free, dq_full, dq_empty, LSE, DELTA, DK, DV, OFFSETS, GROUPS,
                    num_tiles, n_kt, H, h0, heads, NKB, group, kv_block, q_sub, S, qk_scale, sm_scale)
        reducer = (acc_desc, dq_smem, dq_full, dq_empty, OFFSETS, GROUPS, num_tiles, n_kt, H, h0, heads, NKB, group,
                   kv_block, q_sub)
        gl.warp_specialize([(_consumer0, consumer), (_consumer1, consumer), (_producer, producer),
                            (_reducer, reducer)], [4, 1, 1], [CONSUMER_REGS, SERVICE_REGS, SERVICE_REGS])


def _accumulator_descriptor(acc: torch.Tensor):
    """TMA descriptor over the fp32 accumulator ``[B, H, S, D]`` with ``[1, 1, 64, D/2]`` boxes (one
    consumer's half of a sub-tile's dq)."""
    box = [1, 1, _SUB, acc.shape[-1] // 2]
    return TensorDescriptor.from_tensor(acc, box, gl.NVMMASharedLayout.get_default_for(box, gl.float32))


def narrow_in_place(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``acc [B, H, S, D]`` (float32, contiguous) in ``dtype`` (2 bytes), written over the first half of acc's
    own memory: a contiguous tensor that shares it (acc is consumed).

    Head slab j of the result (``S * D`` values) lies over acc's slab j // 2, so the slabs are converted in
    rounds of doubling ranges [1, 2), [2, 4), [4, 8), ...: a round writes over slabs that earlier rounds have
    read and reads slabs that no round has written yet. Slab 0 lies over its own input and goes through a
    one-slab copy. Against a separate dq this saves dq's size while the accumulator lives, so all heads
    fit in one launch with the memory that half of them took in two (rounds 16-17: one launch 1-4% faster).
    The result keeps all of acc's memory while it lives (also as a leaf's ``.grad``, or when saved).
    """
    if acc.dtype != torch.float32 or not acc.is_contiguous() or acc.storage_offset() != 0:
        raise ValueError(f"acc must be a contiguous float32 tensor at the start of its memory, got {acc.dtype} "
                         f"with strides {acc.stride()} at offset {acc.storage_offset()}")
    if dtype.itemsize != 2:
        raise ValueError(f"dtype must take 2 bytes (bfloat16 or float16), got {dtype}")
    B, H, S, D = acc.shape
    slabs = acc.view(B * H, S * D)
    out = torch.empty(0, dtype=dtype, device=acc.device).set_(acc.untyped_storage(), 0, (B * H, S * D), (S * D, 1))
    first = slabs[0].to(dtype)
    lo = 1
    while lo < B * H:
        hi = min(2 * lo, B * H)
        out[lo:hi].copy_(slabs[lo:hi])
        lo = hi
    out[0].copy_(first)
    return out.view(B, H, S, D)


def sparse_attention_bwd_hopper(do, q, k, v, lse, delta, offsets, groups, group_size: int, kv_block: int,
                                scale: float):
    """Backward on a Hopper GPU: ``dq, dk, dv [B, H, S, D]`` (q's dtype).

    Inputs as ``triton_kernels`` passes them after its checks (``lse`` and ``delta = rowsum(out * do) - dlse``
    contiguous fp32 ``[B, H, S]``, the index's key-major view ``offsets, groups``); the caller also checked
    that ``hopper_backward_unsupported`` is None.
    """
    B, H, S, D = q.shape
    for name, x in (("lse", lse), ("delta", delta)):  # read as flat [B*H*S] arrays
        if x.shape != (B, H, S) or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [B, H, S] = {(B, H, S)}, got {x.dtype} "
                             f"{tuple(x.shape)} with strides {x.stride()}")
    dk = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dv = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    acc = torch.zeros((B, H, S, D), dtype=torch.float32, device=q.device)
    descriptors = [_hopper._descriptor(x, _SUB) for x in (q, do, k, v)]
    num_tiles = -(-S // _KEYS) * B * H
    _sparse_attn_bwd_fused_kernel[(num_tiles,)](
        *descriptors, _accumulator_descriptor(acc), lse, delta, dk, dv, offsets, groups,
        S, H, 0, H, -(-S // kv_block), num_tiles, scale * _hopper._LOG2E, scale,
        GROUP=group_size, KV_BLOCK=kv_block, SERVICE_REGS=_SERVICE_REGS, CONSUMER_REGS=_CONSUMER_REGS,
        num_warps=4, maxnreg=_MAXNREG)
    dq = narrow_in_place(acc, q.dtype)
    return dq, dk, dv
