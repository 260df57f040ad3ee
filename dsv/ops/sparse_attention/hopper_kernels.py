"""Warp-specialized sparse-attention forward for Hopper GPUs (compute capability 9.x), written in Gluon.

The same computation as the Triton forward (``triton_kernels._sparse_attn_fwd_kernel``: FlashAttention-2
online softmax over each query group's listed key blocks, base-2 exponentials, natural-log LSE), organised
as FlashAttention-3 organises a Hopper kernel:

- a one-warp *producer* partition streams the listed K and V tiles through TMA rings, with an mbarrier per
  slot for "loaded" and one for "free";
- one or two *consumer* warpgroups (64 query rows each, rows of one group, so they share every K/V tile)
  run the matmuls as asynchronous wgmma: the scores of tile j and P·V of tile j-1 are issued together, and
  the softmax of tile j runs while P·V is on the tensor cores. As separate partitions the two consumers are
  not tied by CTA-wide barriers (a Triton or plain Gluon kernel with two warpgroups runs them in lockstep:
  benchmarks/NOTES.md, rounds 3 and 7);
- with groups and key blocks that are multiples of 128 tokens the grid is persistent (one program per SM
  walks the tiles), so the producer loads the next tile's Q and K/V while the consumers finish this one.

Measured on one H200 (benchmarks/NOTES.md, round 9; B=1, H=24, D=128, bf16; 2-12% less time than the Triton
forward in the sweep, 4-9% in `dsv bench kernels`): 32k tokens, 128-token blocks,
2.33 / 1.25 / 0.58 ms at 90 / 95 / 98% sparsity against the Triton forward's 2.58 / 1.30 / 0.59; 64k
8.81 / 4.76 / 2.02 against 9.97 / 5.22 / 2.19; 64-token blocks at 32k 2.79 / 1.53 / 0.70 against
3.06 / 1.66 / 0.72. At head dim 64 the 128-token setting measured 5-9% faster than Triton, the 64-token one
15-18% slower (not taken). The backward passes written the same way were not faster than the Triton ones
(round 10); a fused backward with a reduction warp was (round 15): ``hopper_backward``.

``hopper_forward_unsupported`` says why these inputs cannot take this kernel (the Triton forward runs
instead); ``DSV_HOPPER_FORWARD=0`` in the environment turns it off.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton

try:  # Gluon is triton's explicit-layout dialect (triton >= 3.5); its API still moves between releases.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Renamed after triton 3.6 (async_copy_global_to_shared -> async_load).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # triton 3.5's warp_specialize took (default_args, default_partition, worker_args, ...) instead.
    if next(iter(inspect.signature(gl.warp_specialize).parameters)) != "functions_and_args":
        raise AttributeError("gl.warp_specialize has the pre-3.6 signature")
    GLUON_IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as error:  # pragma: no cover - depends on the installed triton
    GLUON_IMPORT_ERROR = f"triton {triton.__version__} lacks the Gluon Hopper API of triton >= 3.6 ({error})"

_LOG2E = 1.4426950408889634
ENABLED = os.environ.get("DSV_HOPPER_FORWARD", "1") != "0"  # read once, at import

# Launch settings by (group_size, kv_block) class, from the round-9 sweep on one H200:
# (consumer warpgroups, key tile, K stages, V stages, programs per SM or 0 for one per tile, maxnreg).
# Registers are allocated per warpgroup: the producer's (one warp, rounded up to a warpgroup) gets 24 a
# thread and the consumers share the rest of maxnreg × all warps: 2 × 240 of 3 × 168 for the wide setting
# (one program per SM fills the register file), 232 of 2 × 128 for the narrow one (two programs per SM).
_WIDE = (2, 128, 2, 2, 1, 168)  # group and kv_block multiples of 128
_NARROW = (1, 64, 2, 2, 0, 128)  # 64-token groups and key blocks
_PRODUCER_REGS = 24
_CONSUMER_REGS = 240  # the second consumer's (a worker partition); the first takes what is left, also 240


def _settings(group_size: int, kv_block: int):
    if group_size % 128 == 0 and kv_block % 128 == 0:
        return _WIDE
    if group_size == 64 and kv_block == 64:
        return _NARROW
    return None


@functools.lru_cache(maxsize=None)
def _is_hopper(device: torch.device) -> bool:
    # ROCm reports its own architectures as capabilities (MI300: 9.4); the kernel is NVIDIA's sm_90 only.
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9


# Groups listing fewer key blocks than this run the Triton forward: with a loop this short the persistent
# kernel's per-tile cost shows (one H200, 16k tokens at 98% sparsity, 3 blocks a group: 0.28 ms against the
# Triton forward's 0.20; 6 blocks a group at 32k: 0.66 against 0.69).
MIN_LISTED_BLOCKS = 4


def hopper_forward_unsupported(q: torch.Tensor, group_size: int, kv_block: int,
                               listed_blocks: int | None = None) -> str | None:
    """Why the warp-specialized forward does not run on inputs like ``q [B, H, S, D]`` with this grouping
    (the Triton forward then runs), or None when it does. ``listed_blocks``: the index's ``K_max`` (the most
    blocks any group lists), when known."""
    if not ENABLED:
        return "turned off by DSV_HOPPER_FORWARD=0"
    if not q.is_cuda or not _is_hopper(q.device):
        return "needs an NVIDIA Hopper GPU (compute capability 9.x)"
    return hopper_forward_missing(q, group_size, kv_block) or _left_to_triton(q, group_size, kv_block,
                                                                               listed_blocks)


def hopper_forward_missing(q: torch.Tensor, group_size: int, kv_block: int) -> str | None:
    """On an enabled Hopper GPU: what the kernel lacks for these inputs (the dtype or head dim it does not
    cover, or triton's Gluon API), or None. Unlike the groupings and index lengths that
    ``hopper_forward_unsupported`` leaves to Triton by measurement, these leave speed on the table: a layer
    warns with the reason."""
    if not ENABLED or not q.is_cuda or not _is_hopper(q.device):
        return None
    if GLUON_IMPORT_ERROR is not None:
        return GLUON_IMPORT_ERROR
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype}; it takes bfloat16 or float16"
    if q.shape[-1] not in (64, 128):
        return f"head dim {q.shape[-1]}; it takes 64 or 128"
    return None


def _left_to_triton(q: torch.Tensor, group_size: int, kv_block: int, listed_blocks: int | None) -> str | None:
    # Choices, not gaps: inputs the kernel could take where it was not measured faster than Triton.
    if _settings(group_size, kv_block) is None:
        return (f"group_size {group_size} with kv_block {kv_block}: it runs multiples of 128 for both, or 64 "
                "for both (other pairs were not measured faster than the Triton forward)")
    if _settings(group_size, kv_block) is _NARROW and q.shape[-1] != 128:
        return (f"64-token groups at head dim {q.shape[-1]}: measured 1.15-1.18x slower than the Triton forward "
                "on one H200 (faster at head dim 128)")
    if listed_blocks is not None and listed_blocks < MIN_LISTED_BLOCKS:
        return (f"groups list {listed_blocks} key blocks; below {MIN_LISTED_BLOCKS} the Triton forward is faster "
                "(a loop that short shows the persistent kernel's per-tile cost)")
    return None


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _tile(tile, n_m, H, NG, group, IDX, CNT, K_MAX, sub, BLOCK_M: gl.constexpr):
        # Tiles are numbered query tile fastest, then head, then batch: the order of a plain grid.
        pid_m = tile % n_m
        bh = tile // n_m
        q_row0 = pid_m * BLOCK_M
        row = bh * NG + q_row0 // group
        n_iter = gl.load(CNT + row) * sub
        idx_row = IDX + row.to(gl.int64) * K_MAX
        return bh // H, bh % H, bh, q_row0, n_iter, idx_row

    @gluon.jit
    def _block_start(idx_row, t, sub, kv_block, BLOCK_N: gl.constexpr):
        return gl.load(idx_row + t // sub) * kv_block + (t % sub) * BLOCK_N

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                  v_empty, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, sub):
        # The tile shapes are read from the buffers' types (constants passed into a partition arrive as values).
        N_CONS: gl.constexpr = q_smem.type.shape[0]
        SUB_M: gl.constexpr = q_smem.type.shape[3]
        BLOCK_N: gl.constexpr = k_smem.type.shape[3]
        K_STAGES: gl.constexpr = k_smem.type.shape[0]
        V_STAGES: gl.constexpr = v_smem.type.shape[0]
        kv_it = 0
        q_it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, _, q_row0, n_iter, idx_row = _tile(tile, n_m, H, NG, group, IDX, CNT, K_MAX, sub,
                                                     SUB_M * N_CONS)
            if n_iter > 0:
                for c in gl.static_range(N_CONS):
                    # A slot starts free: the first wait (phase 1) passes at once.
                    mbarrier.wait(q_empty.index(c), (q_it & 1) ^ 1)
                    mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
                    _tma_load(q_desc, [b, h, q_row0 + c * SUB_M, 0], q_ready.index(c), q_smem.index(c))
                q_it += 1
            for t in range(n_iter):
                start = _block_start(idx_row, t, sub, kv_block, BLOCK_N)
                pos = kv_it + t
                ks = pos % K_STAGES
                mbarrier.wait(k_empty.index(ks), ((pos // K_STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(ks), k_desc.block_type.nbytes)
                _tma_load(k_desc, [b, h, start, 0], k_ready.index(ks), k_smem.index(ks))
                vs = pos % V_STAGES
                mbarrier.wait(v_empty.index(vs), ((pos // V_STAGES) & 1) ^ 1)
                mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
                _tma_load(v_desc, [b, h, start, 0], v_ready.index(vs), v_smem.index(vs))
            kv_it += n_iter

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, sub,
                  S, sob, soh, sos, qk_scale, even_n, C: gl.constexpr):
        N_CONS: gl.constexpr = q_smem.type.shape[0]
        SUB_M: gl.constexpr = q_smem.type.shape[3]
        HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
        BLOCK_N: gl.constexpr = k_smem.type.shape[3]
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

        q2 = q_smem.index(C).reshape([SUB_M, HEAD_DIM])
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([SUB_M, BLOCK_N], gl.float32, s_layout)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        kv_it = 0
        q_it = 0
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            b, h, bh, q_row0, n_iter, idx_row = _tile(tile, n_m, H, NG, group, IDX, CNT, K_MAX, sub,
                                                      SUB_M * N_CONS)
            acc = gl.zeros([SUB_M, HEAD_DIM], gl.float32, o_layout)
            m_i = gl.full([SUB_M], -1.0e30, gl.float32, row_s)
            l_i = gl.zeros([SUB_M], gl.float32, row_s)
            if n_iter > 0:
                mbarrier.wait(q_ready.index(C), q_it & 1)
                ks = kv_it % K_STAGES
                mbarrier.wait(k_ready.index(ks), (kv_it // K_STAGES) & 1)
                s_tok = warpgroup_mma(q2, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                                      use_acc=False, is_async=True)
                qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
                mbarrier.arrive(k_empty.index(ks), count=1)
                if even_n == 0:
                    cols = _block_start(idx_row, 0, sub, kv_block, BLOCK_N) + offs_n
                    qk = gl.where(cols[None, :] < S, qk, float("-inf"))
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
                    # The scores of tile j and P.V of tile j - 1 go to the tensor cores together; the softmax
                    # of tile j then overlaps the P.V.
                    s_tok = warpgroup_mma(q2, k_smem.index(ks).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)),
                                          zero_s, use_acc=False, is_async=True)
                    acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                    qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
                    mbarrier.arrive(k_empty.index(ks), count=1)
                    if even_n == 0:
                        cols = _block_start(idx_row, j, sub, kv_block, BLOCK_N) + offs_n
                        qk = gl.where(cols[None, :] < S, qk, float("-inf"))
                    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
                    p = gl.exp2(qk * qk_scale - m_new[:, None])
                    alpha = gl.exp2(m_i - m_new)
                    l_i = l_i * alpha + gl.sum(p, 1)
                    m_i = m_new
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(v_empty.index(vs), count=1)
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    p_op = gl.convert_layout(p.to(dtype), p_layout)
                # Every Q.K^T of this tile has retired: the producer may load the next tile's Q.
                mbarrier.arrive(q_empty.index(C), count=1)
                q_it += 1

                last = kv_it + n_iter - 1
                vs = last % V_STAGES
                mbarrier.wait(v_ready.index(vs), (last // V_STAGES) & 1)
                acc = warpgroup_mma(p_op, v_smem.index(vs).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(v_empty.index(vs), count=1)
            kv_it += n_iter

            # A group with no listed block writes zeros and LSE = -inf, as the Triton forward does.
            l_o = gl.convert_layout(l_i, row_o)
            out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
            row0 = q_row0 + C * SUB_M
            offs_m = row0 + gl.arange(0, SUB_M, layout=row_o)
            optr = (OUT + b.to(gl.int64) * sob + h.to(gl.int64) * soh + offs_m[:, None].to(gl.int64) * sos
                    + offs_d[None, :])
            gl.store(optr, out.to(OUT.dtype.element_ty), mask=offs_m[:, None] < S)
            lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, float("-inf"))
            offs_ms = row0 + gl.arange(0, SUB_M, layout=row_s)
            gl.store(LSE + bh.to(gl.int64) * S + offs_ms, lse, mask=offs_ms < S)

    # One entry per consumer: the consumer's index selects its Q rows at compile time (`q_smem.index(C)`),
    # and a constant passed into a partition would arrive as a runtime value.
    @gluon.jit
    def _consumer0(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                   OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, sub,
                   S, sob, soh, sos, qk_scale, even_n):
        _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, sub,
                  S, sob, soh, sos, qk_scale, even_n, 0)

    @gluon.jit
    def _consumer1(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                   OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, sub,
                   S, sob, soh, sos, qk_scale, even_n):
        _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                  OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, group, kv_block, sub,
                  S, sob, soh, sos, qk_scale, even_n, 1)

    @gluon.jit
    def _sparse_attn_fwd_ws_kernel(q_desc, k_desc, v_desc, OUT, LSE, IDX, CNT,
                                   sob, soh, sos, H, S, NG, K_MAX, num_tiles, qk_scale,
                                   GROUP: gl.constexpr, KV_BLOCK: gl.constexpr, BLOCK_N: gl.constexpr,
                                   N_CONS: gl.constexpr, K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                                   PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                   num_warps: gl.constexpr):
        # Program p walks the tiles p, p + grid, ...: one tile per program is the plain grid; fewer programs
        # (persistent) let the producer run ahead into the next tile.
        BLOCK_M: gl.constexpr = 64 * N_CONS
        sub: gl.constexpr = KV_BLOCK // BLOCK_N
        even_n = (S % KV_BLOCK == 0).to(gl.int32)
        n_m = gl.cdiv(S, BLOCK_M)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [N_CONS] + q_desc.block_type.shape, q_desc.layout)
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
            mbarrier.init(k_empty.index(i), count=N_CONS)  # freed once every consumer has read it
        for i in gl.static_range(V_STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=N_CONS)

        producer = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                    v_empty, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, GROUP, KV_BLOCK, sub)
        consumer = (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
                    OUT, LSE, IDX, CNT, num_tiles, n_m, H, NG, K_MAX, GROUP, KV_BLOCK, sub,
                    S, sob, soh, sos, qk_scale, even_n)
        if N_CONS == 2:
            gl.warp_specialize([(_consumer0, consumer), (_consumer1, consumer), (_producer, producer)],
                               [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([(_consumer0, consumer), (_producer, producer)], [1], [PRODUCER_REGS])


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _descriptor(x: torch.Tensor, rows: int):
    """4-D TMA descriptor over ``x [B, H, S, D]`` with ``[1, 1, rows, D]`` boxes (rows past S read as zeros)."""
    elem = x.element_size()
    if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st == 0 or st * elem % 16 for st in x.stride()[:-1]):
        # TMA needs a 16-byte aligned base and positive 16-byte multiple strides; a fresh compact copy has
        # them (`contiguous()` would return a misaligned but contiguous view unchanged).
        x = x.clone(memory_format=torch.contiguous_format)
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, x.shape[-1]], dtype)
    return TensorDescriptor.from_tensor(x, [1, 1, rows, x.shape[-1]], layout)


def sparse_attention_fwd_hopper(q, k, v, indices, counts, group_size: int, kv_block: int, scale: float):
    """Forward on a Hopper GPU: ``out [B, H, S, D]`` (q's dtype) and ``lse [B, H, S]`` (fp32, natural log).

    Inputs as ``triton_kernels.sparse_attention_fwd_launch`` takes them, already checked there; the caller
    also checked ``hopper_forward_unsupported`` is None.
    """
    n_cons, block_n, k_stages, v_stages, per_sm, maxnreg = _settings(group_size, kv_block)
    B, H, S, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    num_tiles = -(-S // (64 * n_cons)) * B * H
    grid = (min(num_tiles, per_sm * _sm_count(q.device.index)) if per_sm else num_tiles,)
    _sparse_attn_fwd_ws_kernel[grid](
        _descriptor(q, 64), _descriptor(k, block_n), _descriptor(v, block_n), out, lse, indices, counts,
        *out.stride()[:3], H, S, indices.shape[2], indices.shape[3], num_tiles, scale * _LOG2E,
        GROUP=group_size, KV_BLOCK=kv_block, BLOCK_N=block_n, N_CONS=n_cons, K_STAGES=k_stages,
        V_STAGES=v_stages, PRODUCER_REGS=_PRODUCER_REGS, CONSUMER_REGS=_CONSUMER_REGS, num_warps=4,
        maxnreg=maxnreg)
    return out, lse
