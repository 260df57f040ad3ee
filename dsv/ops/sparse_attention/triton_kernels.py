"""Triton kernels for block-sparse attention over a DSV critical-KV index.

Layout (docs/architecture.md): ``q, k, v`` are ``[B, H, S, D]`` in grouped token order; query group ``g`` is
rows ``[g*G, (g+1)*G)`` and attends to the key blocks ``index.indices[b, h, g, :counts]`` (each
``kv_block`` rows). One program owns one query tile (forward, dq) or one key tile (dk/dv), so every output
element is written by exactly one program: no atomics, deterministic results. The exception is the optional
``atomic_dq`` backward (``SparseAttentionConfig``), which adds dq from the key tiles atomically.

- forward: FlashAttention-2 online softmax over the listed key blocks, base-2 exponentials, saves the
  natural-log LSE ``[B, H, S]`` (fp32). On Hopper GPUs the launcher runs the warp-specialized Gluon forward
  of ``hopper_kernels`` instead, where it applies (4-9% less forward time in the kernel benchmark).
- backward, dq: query-major, same walk as the forward; it also computes ``delta = rowsum(o * do) - dlse``
  and stores it for the dk/dv pass.
- backward, dk/dv: key-major; walks the transposed index (for each key block, the ascending list of groups
  that selected it), built on the GPU by a stable sort of the index once per index and cached on it
  (``SparseIndex.key_major``; a compiled graph builds it with traced ops). A split backward (7 matmuls per
  tile pair) measured faster than accumulating dq with fp32 element atomics from this pass (5 matmuls):
  benchmarks/NOTES.md. ``atomic_dq`` keeps that path, with TMA bulk reductions on Hopper, for measurement:
  it was slower than the split backward there too (NOTES, round 4). On Hopper GPUs the launcher runs the
  fused warp-specialized Gluon backward of ``hopper_backward`` instead (5 matmuls, dq added by a reduction
  warp), where it applies: indices listing at least ``hopper_backward.MIN_LISTED_BLOCKS`` blocks a group,
  where it measured as fast or faster than the split backward (7-10% at 32k tokens and 90% sparsity, 3-6% at
  64k and 95%; NOTES, rounds 15-17).

The gathered tiles of each loop (K/V, or Q/dO) load through TMA descriptors on Hopper where that measured
faster, through pointers elsewhere (``default_config``).

Tile sizes are decoupled from the index granularity: ``BLOCK_M`` divides ``group_size`` and ``BLOCK_N``
divides ``kv_block``; a listed block is walked in ``kv_block // BLOCK_N`` sub-tiles.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode
from triton.tools.tensor_descriptor import TensorDescriptor

from dsv.ops.cuda_device import launches_on_input_device
from dsv.ops.index import key_major_csr
from dsv.ops.sparse_attention.hopper_backward import hopper_backward_unsupported, sparse_attention_bwd_hopper
from dsv.ops.sparse_attention.hopper_kernels import hopper_forward_unsupported, sparse_attention_fwd_hopper

_LOG2E = 1.4426950408889634  # the kernels work in base 2 (exp2) and store the LSE in natural log


# ----------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    # Masks only where the shape needs them: unmasked loads vectorise to 16-byte accesses.
    if EVEN_ROWS:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return x


@triton.jit
def _store_tile(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    if EVEN_ROWS:
        if EVEN_D:
            tl.store(ptrs, x)
        else:
            tl.store(ptrs, x, mask=offs_d[None, :] < HEAD_DIM)
    else:
        if EVEN_D:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)
        else:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _load_rows(desc, ptrs, bi, hi, row0, rows, n_rows, offs_d, BLOCK: tl.constexpr, D_PAD: tl.constexpr,
               HEAD_DIM: tl.constexpr, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr):
    # Rows [row0, row0 + BLOCK) of one (batch, head): through the tensor-memory accelerator from a 4-D
    # descriptor (rows past S and columns past D come back as zeros), or through pointers.
    if USE_TMA:
        x = desc.load([bi, hi, row0, 0]).reshape([BLOCK, D_PAD])
    else:
        x = _load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM, EVEN_ROWS, EVEN_D)
    return x


@triton.jit
def _delta_rows(o, do, DLSE, DELTA, vec, offs_m, S, EVEN_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    # delta = rowsum(out * dO) - dLSE per query row, stored for the key-major pass and returned.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if EVEN_M:
        if HAS_DLSE:
            delta -= tl.load(DLSE + vec)
        tl.store(DELTA + vec, delta)
    else:
        if HAS_DLSE:
            delta -= tl.load(DLSE + vec, mask=offs_m < S, other=0.0)
        tl.store(DELTA + vec, delta, mask=offs_m < S)
    return delta


@triton.jit
def _add_rows(desc, ptrs, x, bi, hi, row0, rows, n_rows, offs_d, BLOCK: tl.constexpr, D_PAD: tl.constexpr,
              HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    # Atomically add fp32 rows [row0, row0 + BLOCK) of one (batch, head): one bulk reduction through the
    # tensor-memory accelerator (rows past S and columns past D are dropped), or element atomics.
    if USE_TMA:
        desc.atomic_add([bi, hi, row0, 0], x.reshape([1, 1, BLOCK, D_PAD]))
    else:
        tl.atomic_add(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")


@triton.jit
def _sparse_attn_bwd_delta_kernel(
    OUT, DO, DLSE, DELTA, sob, soh, sos, sdob, sdoh, sdos, H, S,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    o = _load_tile(OUT + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :],
                   offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    do = _load_tile(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :],
                    offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    _delta_rows(o, do, DLSE, DELTA, pid_bh.to(tl.int64) * S + offs_m, offs_m, S, EVEN_M, HAS_DLSE)


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, K_DESC, V_DESC, OUT, LSE, IDX, CNT,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
    H, S, NG, K_MAX, qk_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = pid_bh // H
    hi = pid_bh % H
    b = bi.to(tl.int64)
    h = hi.to(tl.int64)
    g = pid_m * BLOCK_M // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)

    q = _load_tile(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                   offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    row = pid_bh * NG + g
    n_iter = tl.load(CNT + row) * (KV_BLOCK // BLOCK_N)
    idx_row = IDX + row.to(tl.int64) * K_MAX
    k_base = K + b * skb + h * skh + offs_d[None, :]
    v_base = V + b * svb + h * svh + offs_d[None, :]

    # Finite start for the running max: a sub-tile lying wholly past S (ragged tail) then gives
    # exp2(-inf - m) = 0 instead of exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for it in range(0, n_iter):
        blk = tl.load(idx_row + it // (KV_BLOCK // BLOCK_N))
        start_n = blk * KV_BLOCK + (it % (KV_BLOCK // BLOCK_N)) * BLOCK_N
        cols = start_n + offs_n
        k = _load_rows(K_DESC, k_base + cols[:, None] * sks, bi, hi, start_n, cols, S, offs_d,
                       BLOCK_N, D_PAD, HEAD_DIM, EVEN_N, EVEN_D, USE_TMA)
        v = _load_rows(V_DESC, v_base + cols[:, None] * svs, bi, hi, start_n, cols, S, offs_d,
                       BLOCK_N, D_PAD, HEAD_DIM, EVEN_N, EVEN_D, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if not EVEN_N:
            qk = tl.where(cols[None, :] < S, qk, float("-inf"))
        # Scale applied inside the max and the exponent (scale > 0) so it fuses into one FMA per score.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # A row with no listed block (count 0, outside the contract) yields 0 and LSE = -inf rather than NaN.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    _store_tile(OUT + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], out.to(OUT.dtype.element_ty),
                offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # ln(2): natural-log LSE, as the reference
    if EVEN_M:
        tl.store(LSE + pid_bh.to(tl.int64) * S + offs_m, lse)
    else:
        tl.store(LSE + pid_bh.to(tl.int64) * S + offs_m, lse, mask=offs_m < S)


@triton.jit
def _sparse_attn_bwd_dq_kernel(
    Q, K, V, K_DESC, V_DESC, OUT, DO, LSE, DLSE, DELTA, DQ, IDX, CNT,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, sdob, sdoh, sdos, sdqb, sdqh, sdqs,
    H, S, NG, K_MAX, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, HAS_DLSE: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = pid_bh // H
    hi = pid_bh % H
    b = bi.to(tl.int64)
    h = hi.to(tl.int64)
    g = pid_m * BLOCK_M // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)

    q = _load_tile(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :],
                   offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    do = _load_tile(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :],
                    offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    o = _load_tile(OUT + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :],
                   offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    # delta is computed here, once per query row, and stored for the dk/dv pass (which runs after this one):
    # this saves a separate pre-processing launch over the output and dO.
    vec = pid_bh.to(tl.int64) * S + offs_m
    delta = _delta_rows(o, do, DLSE, DELTA, vec, offs_m, S, EVEN_M, HAS_DLSE)
    if EVEN_M:
        lse2 = tl.load(LSE + vec) * 1.4426950408889634
    else:
        # Rows past S have q = do = 0 and delta = 0, so any finite LSE gives them ds = 0.
        lse2 = tl.load(LSE + vec, mask=offs_m < S, other=0.0) * 1.4426950408889634

    row = pid_bh * NG + g
    n_iter = tl.load(CNT + row) * (KV_BLOCK // BLOCK_N)
    idx_row = IDX + row.to(tl.int64) * K_MAX
    k_base = K + b * skb + h * skh + offs_d[None, :]
    v_base = V + b * svb + h * svh + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for it in range(0, n_iter):
        blk = tl.load(idx_row + it // (KV_BLOCK // BLOCK_N))
        start_n = blk * KV_BLOCK + (it % (KV_BLOCK // BLOCK_N)) * BLOCK_N
        cols = start_n + offs_n
        k = _load_rows(K_DESC, k_base + cols[:, None] * sks, bi, hi, start_n, cols, S, offs_d,
                       BLOCK_N, D_PAD, HEAD_DIM, EVEN_N, EVEN_D, USE_TMA)
        v = _load_rows(V_DESC, v_base + cols[:, None] * svs, bi, hi, start_n, cols, S, offs_d,
                       BLOCK_N, D_PAD, HEAD_DIM, EVEN_N, EVEN_D, USE_TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if not EVEN_N:
            p = tl.where(cols[None, :] < S, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq *= sm_scale
    _store_tile(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                offs_m, S, offs_d, HEAD_DIM, EVEN_M, EVEN_D)


@triton.jit
def _sparse_attn_bwd_dkdv_kernel(
    Q, K, V, DO, Q_DESC, DO_DESC, LSE, DELTA, DK, DV, DQ_ACC, DQ_DESC, OFFSETS, GROUPS,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos,
    H, S, NKB, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    bi = pid_bh // H
    hi = pid_bh % H
    b = bi.to(tl.int64)
    h = hi.to(tl.int64)
    j = pid_n * BLOCK_N // KV_BLOCK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)

    k = _load_tile(K + b * skb + h * skh + offs_n[:, None] * sks + offs_d[None, :],
                   offs_n, S, offs_d, HEAD_DIM, EVEN_N, EVEN_D)
    v = _load_tile(V + b * svb + h * svh + offs_n[:, None] * svs + offs_d[None, :],
                   offs_n, S, offs_d, HEAD_DIM, EVEN_N, EVEN_D)
    seg = pid_bh * NKB + j
    start = tl.load(OFFSETS + seg)
    n_iter = (tl.load(OFFSETS + seg + 1) - start) * (GROUP // BLOCK_M)
    q_base = Q + b * sqb + h * sqh + offs_d[None, :]
    do_base = DO + b * sdob + h * sdoh + offs_d[None, :]
    vec_base = pid_bh.to(tl.int64) * S
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    for it in range(0, n_iter):
        g = tl.load(GROUPS + start + it // (GROUP // BLOCK_M))
        start_m = g * GROUP + (it % (GROUP // BLOCK_M)) * BLOCK_M
        rows = start_m + offs_m
        q = _load_rows(Q_DESC, q_base + rows[:, None] * sqs, bi, hi, start_m, rows, S, offs_d,
                       BLOCK_M, D_PAD, HEAD_DIM, EVEN_M, EVEN_D, USE_TMA)
        do = _load_rows(DO_DESC, do_base + rows[:, None] * sdos, bi, hi, start_m, rows, S, offs_d,
                        BLOCK_M, D_PAD, HEAD_DIM, EVEN_M, EVEN_D, USE_TMA)
        if EVEN_M:
            lse2 = tl.load(LSE + vec_base + rows) * 1.4426950408889634
            delta = tl.load(DELTA + vec_base + rows)
        else:
            # LSE = +inf past S makes p = 0 there, so padded query rows add nothing to dk or dv.
            lse2 = tl.load(LSE + vec_base + rows, mask=rows < S, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + vec_base + rows, mask=rows < S, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q, input_precision=DOT_PRECISION)
        if ATOMIC_DQ:
            # These rows' dq from this key tile, added into an fp32 buffer: the dq pass (which recomputes
            # QKᵀ and dO·Vᵀ) is then skipped, 14 matmul units per kept pair instead of 18.
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * sm_scale
            _add_rows(DQ_DESC, DQ_ACC + (vec_base + rows[:, None]) * HEAD_DIM + offs_d[None, :], dq, bi, hi,
                      start_m, rows, S, offs_d, BLOCK_M, D_PAD, HEAD_DIM, USE_TMA)
    dk *= sm_scale
    # dk/dv are allocated contiguous by the launcher.
    out_off = pid_bh.to(tl.int64) * S * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    _store_tile(DK + out_off, dk.to(DK.dtype.element_ty), offs_n, S, offs_d, HEAD_DIM, EVEN_N, EVEN_D)
    _store_tile(DV + out_off, dv.to(DV.dtype.element_ty), offs_n, S, offs_d, HEAD_DIM, EVEN_N, EVEN_D)


# ----------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    # Not triton.cdiv / triton.next_power_of_2: in host code those constexpr functions cost ~1.6 us a call
    # (argument unwrapping, an import), ~15 us over a forward+backward's dozen calls.
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch settings of one kernel; ``block_m`` must divide group_size, ``block_n`` kv_block.

    ``tma``: the loop's gathered tiles (K/V in forward and dq, Q/dO in dk/dv) come through TMA descriptors
    (Hopper and newer) instead of pointer loads.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Settings of the three kernels.

    ``atomic_dq``: the dk/dv pass also computes dq and adds it into an fp32 buffer (TMA bulk reductions
    where ``bwd_dkdv.tma``, else element atomics), and the dq pass is skipped. Fewer matmuls, but dq's
    summation order then varies from run to run (not bitwise reproducible).
    """

    fwd: KernelConfig
    bwd_dq: KernelConfig
    bwd_dkdv: KernelConfig
    atomic_dq: bool = False


@functools.lru_cache(maxsize=None)
def default_config(head_dim: int, group_size: int, kv_block: int, tma: bool = False) -> SparseAttentionConfig:
    """Launch settings for the three kernels, chosen by the H200 sweeps (benchmarks/NOTES.md).

    ``tma``: use TMA loads where they measured faster (forward and dk/dv; the dq pass too for blocks under 128
    tokens); the launchers pass True on Hopper-class GPUs (compute capability >= 9) when ``D * itemsize`` is a
    multiple of 16 bytes.

    Memoised (every launch asks for it, and building the dataclasses costs host time); the configs are
    frozen, so callers share them safely (``dataclasses.replace`` makes a variant).
    """
    d_pad = max(16, _next_power_of_2(head_dim))
    if d_pad > 128:  # halve the tiles: fp32 accumulators of 256-wide rows
        return SparseAttentionConfig(KernelConfig(min(group_size, 64), min(kv_block, 32), 4, 2, tma),
                                     KernelConfig(min(group_size, 64), min(kv_block, 32), 4, 2),
                                     KernelConfig(min(group_size, 32), min(kv_block, 64), 4, 2, tma))
    if group_size >= 128 and kv_block >= 128:
        return SparseAttentionConfig(KernelConfig(128, 64, 4, 2, tma), KernelConfig(128, 128, 8, 2),
                                     KernelConfig(64, 64, 4, 3, tma))
    m, n = min(group_size, 64), min(kv_block, 64)
    return SparseAttentionConfig(KernelConfig(m, n, 4, 3, tma), KernelConfig(m, n, 4, 2, tma),
                                 KernelConfig(m, n, 4, 2, tma))


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _tma_supported(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_tma(x.device) and x.shape[-1] * x.element_size() % 16 == 0


def _check_inputs(q, k, v, indices, counts, group_size, kv_block):
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be [B, H, S, D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == indices.device == counts.device):
        raise ValueError("q, k, v and the index must be on one device")
    B, H, S, D = q.shape
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported by the Triton kernels (tiles would not fit)")
    for name, val in (("group_size", group_size), ("kv_block", kv_block)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"sparse_attention_triton needs {name} to be a power of two >= 16, got {val}; "
                             "use sparse_attention_reference for finer (e.g. token-level) indices")
    NG = _cdiv(S, group_size)
    if indices.dim() != 4 or tuple(indices.shape[:3]) != (B, H, NG) or tuple(counts.shape) != (B, H, NG):
        raise ValueError(f"index must be indices [B, H, NG, K_max], counts [B, H, NG] with NG={NG}; got "
                         f"{tuple(indices.shape)}, {tuple(counts.shape)}")
    if indices.dtype != torch.int32 or counts.dtype != torch.int32:
        raise ValueError(f"indices and counts must be int32, got {indices.dtype}, {counts.dtype}")


def _descriptor(x: torch.Tensor, block_rows: int, d_pad: int, cfg: KernelConfig):
    """4-D TMA descriptor over ``x [B, H, S, D]`` with ``[1, 1, block_rows, d_pad]`` boxes, or ``x`` itself
    when the config loads through pointers (the kernel then ignores the argument)."""
    if not cfg.tma:
        return x
    elem = x.element_size()
    if x.data_ptr() % 16 or any(st == 0 or st * elem % 16 for st in x.stride()[:-1]):
        # TMA needs a 16-byte aligned base and positive 16-byte multiple strides; a fresh compact copy has
        # them (`contiguous()` would return a misaligned but contiguous view unchanged).
        x = x.clone(memory_format=torch.contiguous_format)
    if x.shape[-1] * elem % 16:
        raise ValueError(f"TMA loads need D * itemsize to be a multiple of 16 bytes, got D={x.shape[-1]} of "
                         f"{x.dtype}; use a config with tma=False")
    return TensorDescriptor.from_tensor(x, [1, 1, block_rows, d_pad])


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch/head/sequence strides but need unit stride along D, and compute a row's
    # offset within one (batch, head) in int32: a sequence stride that reaches 2**31 over S rows (e.g. v as a
    # view of a fused qkv projection, stride 3*H*D, at a few 100k tokens) is copied to the compact layout.
    if x.stride(-1) == 1 and x.stride(2) * x.shape[2] < 2**31:
        return x
    return x.contiguous()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs are the accuracy path (tests, references): keep them IEEE instead of Triton's tf32 default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _shape_flags(S, D, rows_m, rows_n):
    """``(D_PAD, EVEN_M, EVEN_N, EVEN_D)``. ``EVEN_M`` / ``EVEN_N``: every row a kernel touches along M / N lies
    inside S, i.e. S is a multiple of ``rows_m`` / ``rows_n``: the tile size along a kernel's own dimension
    (the grid covers S in tiles), but the index granularity along the one its loop walks (it visits every
    sub-tile of each listed key block or query group, and the last block or group may end past S even where
    S is a multiple of the tile)."""
    d_pad = max(16, _next_power_of_2(D))
    return d_pad, S % rows_m == 0, S % rows_n == 0, d_pad == D


def _check_tiles(cfg: KernelConfig, group_size: int, kv_block: int, what: str):
    if group_size % cfg.block_m or kv_block % cfg.block_n:
        raise ValueError(f"{what} tiles ({cfg.block_m}, {cfg.block_n}) must divide "
                         f"(group_size, kv_block) = ({group_size}, {kv_block})")


@launches_on_input_device
def sparse_attention_fwd_launch(q, k, v, indices, counts, group_size: int, kv_block: int, scale: float,
                                cfg: Optional[KernelConfig] = None):
    """Forward launcher: returns ``out [B, H, S, D]`` (q's dtype) and ``lse [B, H, S]`` (fp32, natural log).

    Without a ``cfg``, inputs the warp-specialized Hopper forward takes run there (``hopper_kernels``:
    ``hopper_forward_unsupported`` says why not); a ``cfg`` always runs the Triton forward with it.
    """
    _check_inputs(q, k, v, indices, counts, group_size, kv_block)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    indices, counts = indices.contiguous(), counts.contiguous()
    if cfg is None and hopper_forward_unsupported(q, group_size, kv_block, indices.shape[3]) is None:
        return sparse_attention_fwd_hopper(q, k, v, indices, counts, group_size, kv_block, scale)
    B, H, S, D = q.shape
    cfg = cfg or default_config(D, group_size, kv_block, _tma_supported(q)).fwd
    _check_tiles(cfg, group_size, kv_block, "forward")
    d_pad, even_m, even_n, even_d = _shape_flags(S, D, cfg.block_m, kv_block)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    grid = (_cdiv(S, cfg.block_m), B * H)
    _sparse_attn_fwd_kernel[grid](
        q, k, v, _descriptor(k, cfg.block_n, d_pad, cfg), _descriptor(v, cfg.block_n, d_pad, cfg), out, lse,
        indices, counts,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        H, S, indices.shape[2], indices.shape[3], scale * _LOG2E,
        HEAD_DIM=D, D_PAD=d_pad, GROUP=group_size, KV_BLOCK=kv_block,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, EVEN_M=even_m, EVEN_N=even_n, EVEN_D=even_d, USE_TMA=cfg.tma,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def _launch_bwd_dq(q, k, v, out, do, lse, dlse, indices, counts, group_size, kv_block, scale, cfg: KernelConfig):
    """dq kernel; also returns ``delta = rowsum(out * do) - dlse`` [B, H, S] fp32 for the dk/dv kernel."""
    B, H, S, D = q.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    has_dlse = dlse is not None
    dlse_arg = dlse.contiguous() if has_dlse else lse  # never read when HAS_DLSE is False
    d_pad, even_m, even_n, even_d = _shape_flags(S, D, cfg.block_m, kv_block)
    _sparse_attn_bwd_dq_kernel[(_cdiv(S, cfg.block_m), B * H)](
        q, k, v, _descriptor(k, cfg.block_n, d_pad, cfg), _descriptor(v, cfg.block_n, d_pad, cfg),
        out, do, lse, dlse_arg, delta, dq, indices, counts,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        H, S, indices.shape[2], indices.shape[3], scale * _LOG2E, scale,
        HEAD_DIM=D, D_PAD=d_pad, GROUP=group_size, KV_BLOCK=kv_block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        EVEN_M=even_m, EVEN_N=even_n, EVEN_D=even_d, HAS_DLSE=has_dlse, USE_TMA=cfg.tma,
        DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return dq, delta


def _launch_bwd_delta(out, do, dlse):
    """``delta = rowsum(out * do) - dlse`` [B, H, S] fp32, for a backward without the dq pass."""
    B, H, S, D = out.shape
    delta = torch.empty((B, H, S), dtype=torch.float32, device=out.device)
    block_m = 64
    d_pad, even_m, _, even_d = _shape_flags(S, D, block_m, block_m)
    _sparse_attn_bwd_delta_kernel[(_cdiv(S, block_m), B * H)](
        out, do, dlse.contiguous() if dlse is not None else delta, delta,
        *out.stride()[:3], *do.stride()[:3], H, S,
        HEAD_DIM=D, D_PAD=d_pad, BLOCK_M=block_m, EVEN_M=even_m, EVEN_D=even_d, HAS_DLSE=dlse is not None,
        num_warps=4,
    )
    return delta


def _launch_bwd_dkdv(q, k, v, do, lse, delta, offsets, groups, group_size, kv_block, scale, cfg: KernelConfig,
                     dq_acc: Optional[torch.Tensor] = None):
    """dk/dv kernel over the key-major index ``(offsets, groups)`` of ``key_major_csr``; with ``dq_acc``
    (fp32 ``[B, H, S, D]``, zeroed, contiguous) it also adds dq into that buffer."""
    B, H, S, D = q.shape
    atomic_dq = dq_acc is not None
    if atomic_dq and (dq_acc.shape != q.shape or dq_acc.dtype != torch.float32 or not dq_acc.is_contiguous()):
        # The kernel adds into it with contiguous strides (a copy made for TMA would lose the sums).
        raise ValueError(f"dq_acc must be a contiguous float32 tensor of q's shape {tuple(q.shape)}, got "
                         f"{dq_acc.dtype} {tuple(dq_acc.shape)} (contiguous: {dq_acc.is_contiguous()})")
    dk = torch.empty((B, H, S, D), dtype=q.dtype, device=q.device)
    dv = torch.empty((B, H, S, D), dtype=q.dtype, device=q.device)
    d_pad, even_m, even_n, even_d = _shape_flags(S, D, group_size, cfg.block_n)
    dq_buffer = dq_acc if atomic_dq else dk  # never touched without ATOMIC_DQ
    _sparse_attn_bwd_dkdv_kernel[(_cdiv(S, cfg.block_n), B * H)](
        q, k, v, do, _descriptor(q, cfg.block_m, d_pad, cfg), _descriptor(do, cfg.block_m, d_pad, cfg),
        lse, delta, dk, dv, dq_buffer, _descriptor(dq_buffer, cfg.block_m, d_pad, cfg) if atomic_dq else dq_buffer,
        offsets, groups,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
        H, S, _cdiv(S, kv_block), scale * _LOG2E, scale,
        HEAD_DIM=D, D_PAD=d_pad, GROUP=group_size, KV_BLOCK=kv_block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        EVEN_M=even_m, EVEN_N=even_n, EVEN_D=even_d, USE_TMA=cfg.tma,
        DOT_PRECISION=_dot_precision(q.dtype), ATOMIC_DQ=atomic_dq, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return dk, dv


def sparse_attention_bwd_launch(do, q, k, v, out, lse, dlse, indices, counts, group_size: int, kv_block: int,
                                scale: float, cfg: Optional[SparseAttentionConfig] = None,
                                key_major: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
    """Backward launcher: returns ``dq, dk, dv [B, H, S, D]`` (q's dtype). ``dlse`` may be None.

    ``key_major``: the index's ``(offsets, groups)`` (``SparseIndex.key_major``); built here when None.
    Without a ``cfg``, inputs the fused Hopper backward takes run there (``hopper_backward``:
    ``hopper_backward_unsupported`` says why not); a ``cfg`` always runs the Triton passes with it.
    """
    _check_inputs(q, k, v, indices, counts, group_size, kv_block)
    _check_backward_inputs(do, out, lse, dlse, q)
    num_kv_blocks = _cdiv(q.shape[2], kv_block)
    offsets, groups = (None, None) if key_major is None else key_major
    if key_major is not None:
        _check_key_major(offsets, groups, indices, num_kv_blocks)
    key_major_source = _given_or_built(offsets, groups, indices, num_kv_blocks)
    return _launch_bwd(do, q, k, v, out, lse, dlse, indices, counts, key_major_source, group_size, kv_block, scale,
                       cfg)


def _check_backward_inputs(do, out, lse, dlse, q):
    # The kernels walk these over q's shape: a smaller tensor would be read past its end.
    for name, x in (("do", do), ("out", out)):
        if x.shape != q.shape or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must be [B, H, S, D] = {tuple(q.shape)} {q.dtype} on {q.device} like q, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is not None and (x.shape != q.shape[:3] or x.dtype != torch.float32 or x.device != q.device):
            raise ValueError(f"{name} must be float32 [B, H, S] = {tuple(q.shape[:3])} on {q.device}, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")


def _check_key_major(offsets, groups, indices, num_kv_blocks):
    B, H, NG, K_MAX = indices.shape
    if (offsets.dtype != torch.int32 or groups.dtype != torch.int32 or offsets.shape != (B * H * num_kv_blocks + 1,)
            or groups.shape != (B * H * NG * K_MAX,)):
        raise ValueError(f"key_major must be int32 offsets [B*H*NKB + 1] = [{B * H * num_kv_blocks + 1}] and groups "
                         f"[B*H*NG*K_max] = [{B * H * NG * K_MAX}] (key_major_csr of the index), got "
                         f"{offsets.dtype} {tuple(offsets.shape)}, {groups.dtype} {tuple(groups.shape)}")
    if offsets.device != indices.device or groups.device != indices.device:
        raise ValueError(f"key_major is on {offsets.device}/{groups.device}, the index on {indices.device}")


KeyMajorSource = Callable[[], tuple[torch.Tensor, torch.Tensor]]
"""Returns an index's key-major view ``(offsets, groups)`` (``key_major_csr``) when the backward needs it."""


def _given_or_built(offsets, groups, indices, num_kv_blocks: int) -> KeyMajorSource:
    """``offsets, groups`` as given, or a build of them from ``indices`` when both are None."""
    if (offsets is None) != (groups is None):
        raise ValueError("offsets and groups (the key-major index) must be given together or both be None")
    if offsets is None:
        return functools.partial(key_major_csr, indices, num_kv_blocks)
    return lambda: (offsets.contiguous(), groups.contiguous())  # the kernel indexes them as flat arrays


@launches_on_input_device
def _launch_bwd(do, q, k, v, out, lse, dlse, indices, counts, key_major: KeyMajorSource, group_size, kv_block, scale,
                cfg: Optional[SparseAttentionConfig] = None):
    """``sparse_attention_bwd_launch`` without its argument checks: for the backward of a forward that made
    them. ``key_major()`` returns the key-major index ``(offsets, groups)``; it is called after the first
    launch, so that where it builds the index, those ~20 small launches cost host time while the GPU runs
    (short sequences are host-bound)."""
    q, k, v, out, do = (_last_dim_contiguous(x) for x in (q, k, v, out, do))
    indices, counts, lse = indices.contiguous(), counts.contiguous(), lse.contiguous()
    if cfg is None and hopper_backward_unsupported(q, group_size, kv_block, indices.shape[3]) is None:
        delta = _launch_bwd_delta(out, do, dlse)
        offsets, groups = key_major()
        return sparse_attention_bwd_hopper(do, q, k, v, lse, delta, offsets, groups, group_size, kv_block, scale)
    cfg = cfg or default_config(q.shape[-1], group_size, kv_block, _tma_supported(q))
    _check_tiles(cfg.bwd_dq, group_size, kv_block, "dq")
    _check_tiles(cfg.bwd_dkdv, group_size, kv_block, "dk/dv")
    if cfg.atomic_dq:
        delta = _launch_bwd_delta(out, do, dlse)
        offsets, groups = key_major()
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = _launch_bwd_dkdv(q, k, v, do, lse, delta, offsets, groups, group_size, kv_block, scale,
                                  cfg.bwd_dkdv, dq_acc)
        return dq_acc.to(q.dtype), dk, dv
    # The dq pass runs first: it writes delta, which the dk/dv pass reads.
    dq, delta = _launch_bwd_dq(q, k, v, out, do, lse, dlse, indices, counts, group_size, kv_block, scale,
                               cfg.bwd_dq)
    offsets, groups = key_major()
    dk, dv = _launch_bwd_dkdv(q, k, v, do, lse, delta, offsets, groups, group_size, kv_block, scale, cfg.bwd_dkdv)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# autograd: custom ops (torch.compile, activation checkpointing) and their eager twin
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("dsv::sparse_attention_fwd", mutates_args=())
def _sparse_attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                             counts: torch.Tensor, offsets: Optional[torch.Tensor], groups: Optional[torch.Tensor],
                             group_size: int, kv_block: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # offsets, groups (the key-major index, None when no backward can follow) are inputs only to be saved for
    # the backward.
    return sparse_attention_fwd_launch(q, k, v, indices, counts, group_size, kv_block, scale)


@_sparse_attention_fwd_op.register_fake
def _(q, k, v, indices, counts, offsets, groups, group_size, kv_block, scale):
    B, H, S, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op("dsv::sparse_attention_bwd", mutates_args=())
def _sparse_attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                             indices: torch.Tensor, counts: torch.Tensor, offsets: Optional[torch.Tensor],
                             groups: Optional[torch.Tensor], group_size: int, kv_block: int,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The inputs are those the forward op checked (or its outputs), so the launcher's checks are skipped.
    key_major_source = _given_or_built(offsets, groups, indices, _cdiv(q.shape[2], kv_block))
    return _launch_bwd(do, q, k, v, out, lse, dlse, indices, counts, key_major_source, group_size, kv_block, scale)


@_sparse_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, dlse, indices, counts, offsets, groups, group_size, kv_block, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, indices, counts, offsets, groups, group_size, kv_block, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, indices, counts, offsets, groups)
    ctx.group_size, ctx.kv_block, ctx.scale = group_size, kv_block, scale
    # An unused LSE then arrives as None rather than as a zero tensor to fill and read.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, indices, counts, offsets, groups = ctx.saved_tensors
    if dout is None:  # only the LSE was used downstream
        dout = torch.zeros_like(out)
    dq, dk, dv = _sparse_attention_bwd_op(dout, q, k, v, out, lse, dlse, indices, counts, offsets, groups,
                                          ctx.group_size, ctx.kv_block, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


_sparse_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _SparseAttentionEager(torch.autograd.Function):
    """Eager calls' twin of the custom ops: the same launchers, without the dispatcher's Python layers
    (custom_op's autograd and backend wrappers). Those cost ~45 us more host time per forward+backward (both
    ways timed with the Triton launches stubbed out, on a CPU), and short sequences are host-bound.
    torch.compile traces the custom ops instead, which it sees as single nodes."""

    @staticmethod
    def forward(ctx, q, k, v, index, group_size, kv_block, scale):
        # The ctx-taking form: with a separate setup_context, apply() binds the arguments through
        # inspect.signature, which costs more host time than the whole forward's Python.
        out, lse = sparse_attention_fwd_launch(q, k, v, index.indices, index.counts, group_size, kv_block, scale)
        # The index tensors are saved like the rest, so that a checkpoint recompute hands the backward its
        # own index (and checkpointing checks that it matches the first pass's shapes).
        ctx.save_for_backward(q, k, v, out, lse, index.indices, index.counts)
        # The index object too, for its cached key-major view; the backward asks for the view, so a forward
        # whose backward never runs (the first pass of a checkpointed layer) builds none. Weakly: a strong
        # reference would keep the index alive from the first pass to the backward, which checkpointing
        # exists to avoid (the recompute brings its own); a caller that keeps its index object alive until
        # the backward still lends its cached view.
        ctx.index_ref, ctx.group_size, ctx.kv_block, ctx.scale = weakref.ref(index), group_size, kv_block, scale
        # An unused LSE then arrives as None rather than as a zero tensor to fill and read.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the kernels have no double backward: raise rather than return a wrong one
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, indices, counts = ctx.saved_tensors
        if dout is None:  # only the LSE was used downstream
            dout = torch.zeros_like(out)
        index = ctx.index_ref()
        # The cached view belongs to the saved index only if the tensors are the same; a recompute that
        # selected other blocks, or an index no longer alive, gets a view built from what was saved.
        if index is not None and _same_tensor(indices, index.indices):
            key_major = index.key_major
        else:
            key_major = _given_or_built(None, None, indices, -(-k.shape[2] // ctx.kv_block))
        dq, dk, dv = _launch_bwd(dout, q, k, v, out, lse, dlse, indices, counts, key_major,
                                 ctx.group_size, ctx.kv_block, ctx.scale)
        return dq, dk, dv, None, None, None, None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same memory, shape and strides (saved tensors may come back as new tensor objects)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def _eager_path_applies(q: torch.Tensor) -> bool:
    """Whether a call may take `_SparseAttentionEager`: plain tensors with data, outside torch.compile and
    dispatch modes. Elsewhere the custom ops run: their fake implementations serve meta and fake tensors,
    and dispatch modes (selective checkpointing policies, FakeTensorMode) see `dsv::sparse_attention_fwd`."""
    return (not torch.compiler.is_compiling() and type(q) is torch.Tensor and q.device.type != "meta"
            and _get_current_dispatch_mode() is None)


# ----------------------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------------------


def _unpack_index(q: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    if index.seq_len != q.shape[2]:
        raise ValueError(f"index was built for seq_len {index.seq_len}, q has S={q.shape[2]}")
    return index.indices, index.counts, int(index.group_size), int(index.kv_block)


def sparse_attention_triton_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index,
                                     scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention with Triton kernels; also returns the log-sum-exp (differentiable).

    Args:
        q, k, v: ``[B, H, S, D]``, fp16/bf16 (fp32 runs in IEEE precision, for checks), in grouped token order.
            Any batch/head/sequence strides; D must be <= 256.
        index: a ``SparseIndex`` with ``group_size`` and ``kv_block`` powers of two >= 16. The backward
            uses its key-major view, built on first use and cached on the index (``SparseIndex.key_major``):
            backward passes over one index build it once.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``out [B, H, S, D]`` (q's dtype) and ``lse [B, H, S]`` (fp32, natural log).
    """
    indices, counts, group_size, kv_block = _unpack_index(q, index)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if _eager_path_applies(q):
        return _SparseAttentionEager.apply(q, k, v, index, group_size, kv_block, scale)
    # A compiled graph builds the key-major index with traced ops, compiled with the rest, when a backward
    # can follow: filling the index's cache while tracing would be a side effect on an object the graph need
    # not own.
    backward_possible = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    offsets, groups = key_major_csr(indices, index.num_kv_blocks) if backward_possible else (None, None)
    return _sparse_attention_fwd_op(q, k, v, indices, counts, offsets, groups, group_size, kv_block, scale)


def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index,
                            scale: Optional[float] = None) -> torch.Tensor:
    """Block-sparse attention with Triton kernels: ``out [B, H, S, D]``.

    Every query of group ``g`` attends to the keys of the blocks ``index.indices[b, h, g, :counts]``.
    q, k, v: ``[B, H, S, D]`` (see ``sparse_attention_triton_with_lse``). Differentiable in q, k, v;
    registered as the custom ops ``dsv::sparse_attention_fwd/bwd``, so torch.compile traces it without a
    graph break (eager calls take an ``autograd.Function`` over the same launchers, with less host time),
    and activation checkpointing recomputes it.
    """
    return sparse_attention_triton_with_lse(q, k, v, index, scale)[0]
