"""Fused critical-KV estimation in Triton: low-rank block scores and per-head top-k in one kernel.

Two launches:
- ``_segment_mean_t_kernel`` pools ``q_lr`` into group proxies and ``k_lr`` into block keys (fp32 means of
  ``G`` or ``kv_block`` rows; a partial tail averages its valid rows), stored transposed ``[B*H, r, N]``
  so the scoring loop reads one contiguous column per rank dimension.
- ``_score_topk_kernel``: one program owns ``BLOCK_G`` group rows of one head, computes their scores
  against every block key in registers and selects the top ``keep[h]`` by an exact threshold search on the
  scores' order-preserving integer images; ties at the threshold go to the lower block id, and the kept
  ids come out ascending from a prefix sum. The ``NG x NKB`` score matrix never reaches global memory:
  extra memory is the pooled tensors, ``O(S * r / G)``, plus the index itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv.ops.cuda_device import launches_on_input_device
from dsv.ops.estimate.naive import check_means
from dsv.ops.index import SparseIndex, check_bhsd, check_keep_blocks

MAX_TILE_ELEMENTS = 8192
"""Scores one program holds in registers (``BLOCK_G x BLOCK_K``): 32 per thread at 8 warps. Above 8192 key
blocks one group's row alone exceeds it (``BLOCK_G = 1``), up to ``MAX_KV_BLOCKS``."""

MAX_KV_BLOCKS = 16384
"""Largest NKB one program row can hold (BLOCK_G = 1); e.g. S = 1M tokens at kv_block = 64."""


@triton.jit
def _segment_mean_t_kernel(
    X, OUT, sxb, sxh, sxs, H, S, NSEG,
    R: tl.constexpr, R_PAD: tl.constexpr, SEG: tl.constexpr, SEG_PAD: tl.constexpr,
):
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_s = tl.arange(0, SEG_PAD)
    rows = pid_j * SEG + offs_s
    offs_r = tl.arange(0, R_PAD)
    row_mask = (offs_s < SEG) & (rows < S)
    x = tl.load(X + b * sxb + h * sxh + rows[:, None] * sxs + offs_r[None, :],
                mask=row_mask[:, None] & (offs_r[None, :] < R), other=0.0).to(tl.float32)
    n = tl.minimum(S - pid_j * SEG, SEG).to(tl.float32)
    mean = tl.sum(x, 0) / n
    tl.store(OUT + pid_bh.to(tl.int64) * R * NSEG + offs_r * NSEG + pid_j, mean, mask=offs_r < R)


@triton.jit
def _score_topk_kernel(
    PROXY_T, KEY_T, KEEP, IDX, CNT, H, NG, NKB, K_MAX,
    R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KMAX: tl.constexpr,
):
    pid_g = tl.program_id(0)
    pid_bh = tl.program_id(1)
    keep = tl.load(KEEP + pid_bh % H)
    offs_g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    g_mask = offs_g < NG
    k_mask = offs_k < NKB

    # fp32 FMA over the small rank r (exact fp32, as the reference's matmul), never tf32.
    scores = tl.zeros([BLOCK_G, BLOCK_K], tl.float32)
    p_base = PROXY_T + pid_bh.to(tl.int64) * R * NG
    k_base = KEY_T + pid_bh.to(tl.int64) * R * NKB
    for d in tl.static_range(R):
        p = tl.load(p_base + d * NG + offs_g, mask=g_mask, other=0.0)
        kc = tl.load(k_base + d * NKB + offs_k, mask=k_mask, other=0.0)
        scores += p[:, None] * kc[None, :]
    # -0.0 and +0.0 must tie (as in torch's sort), so fold the sign of zeros before taking bits.
    scores = tl.where(scores == 0.0, 0.0, scores)
    bits = scores.to(tl.int32, bitcast=True)
    # Order-preserving map float -> int32: negative floats have their magnitude bits flipped.
    keys = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    # A NaN score (a diverged predictor) ranks below every real score: its bits would otherwise map to the
    # top (the reference raises instead; this kernel cannot without a host sync). Padding ranks lower still.
    keys = tl.where(scores == scores, keys, -2147483647)
    keys = tl.where(k_mask[None, :], keys, -2147483648)  # padding columns sort below every real score

    # Largest t with #(keys >= t) >= keep: bisection over the int32 range, 32 halvings.
    lo = tl.full([BLOCK_G], -2147483648, tl.int64)
    hi = tl.full([BLOCK_G], 2147483647, tl.int64)
    for _ in range(32):
        mid = (lo + hi + 1) >> 1
        n_ge = tl.sum((keys >= mid.to(tl.int32)[:, None]).to(tl.int32), 1)
        ok = n_ge >= keep
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    thr = lo.to(tl.int32)[:, None]

    above = keys > thr
    n_above = tl.sum(above.to(tl.int32), 1)
    at = keys == thr
    # Of the blocks tied at the threshold, keep the lowest ids until `keep` blocks are chosen.
    tie_rank = tl.cumsum(at.to(tl.int32), 1)
    selected = above | (at & (tie_rank <= (keep - n_above)[:, None]))
    pos = tl.cumsum(selected.to(tl.int32), 1) - 1
    row_base = (pid_bh.to(tl.int64) * NG + offs_g) * K_MAX
    tl.store(IDX + row_base[:, None] + pos, offs_k[None, :] + tl.zeros([BLOCK_G, BLOCK_K], tl.int32),
             mask=selected & g_mask[:, None])
    offs_p = tl.arange(0, BLOCK_KMAX)
    pad = (offs_p[None, :] >= keep) & (offs_p[None, :] < K_MAX) & g_mask[:, None]
    tl.store(IDX + row_base[:, None] + offs_p[None, :], tl.full([BLOCK_G, BLOCK_KMAX], -1, tl.int32), mask=pad)
    tl.store(CNT + pid_bh.to(tl.int64) * NG + offs_g, tl.zeros([BLOCK_G], tl.int32) + keep, mask=g_mask)


def _segment_means_t(x: torch.Tensor, segment: int) -> torch.Tensor:
    """fp32 means of runs of ``segment`` rows of ``x [B, H, S, r]``, as ``[B*H, r, ceil(S/segment)]``."""
    B, H, S, R = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    n_seg = triton.cdiv(S, segment)
    out = torch.empty((B * H, R, n_seg), dtype=torch.float32, device=x.device)
    _segment_mean_t_kernel[(n_seg, B * H)](
        x, out, x.stride(0), x.stride(1), x.stride(2), H, S, n_seg,
        R=R, R_PAD=max(2, triton.next_power_of_2(R)), SEG=segment, SEG_PAD=triton.next_power_of_2(segment),
        num_warps=4,
    )
    return out


def _check_num_kv_blocks(num_kv_blocks: int) -> None:
    if num_kv_blocks > MAX_KV_BLOCKS:
        raise ValueError(f"the fused estimation holds a row of NKB={num_kv_blocks} scores in registers, at most "
                         f"{MAX_KV_BLOCKS}; use a larger kv_block or the reference estimation")


def _select_from_means_t(proxies_t: torch.Tensor, keys_t: torch.Tensor, keep_blocks: torch.Tensor, B: int,
                         H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k launch over transposed fp32 means ``proxies_t [B*H, r, NG]``, ``keys_t [B*H, r, NKB]``:
    ``(indices [B, H, NG, K_max], counts [B, H, NG])``."""
    R, NG, NKB = proxies_t.shape[1], proxies_t.shape[2], keys_t.shape[2]
    # Checked and reduced where keep_blocks lives: a CPU tensor gives K_max without a device sync.
    keep = check_keep_blocks(keep_blocks, H, NKB, torch.as_tensor(keep_blocks).device).to(torch.int32)
    k_max = int(keep.max())
    if proxies_t.is_cuda and not keep.is_cuda:
        keep = keep.pin_memory().to(proxies_t.device, non_blocking=True)  # a pageable copy would sync the stream
    keep32 = keep.to(proxies_t.device)
    indices = torch.empty((B, H, NG, k_max), dtype=torch.int32, device=proxies_t.device)
    counts = torch.empty((B, H, NG), dtype=torch.int32, device=proxies_t.device)
    block_k = max(16, triton.next_power_of_2(NKB))
    block_g = max(1, min(16, MAX_TILE_ELEMENTS // block_k))
    _score_topk_kernel[(triton.cdiv(NG, block_g), B * H)](
        proxies_t, keys_t, keep32, indices, counts, H, NG, NKB, k_max,
        R=R, BLOCK_G=block_g, BLOCK_K=block_k, BLOCK_KMAX=triton.next_power_of_2(k_max),
        num_warps=8 if block_g * block_k >= 4096 else 4,
    )
    return indices, counts


@launches_on_input_device
def estimate_index_triton(q_lr: torch.Tensor, k_lr: torch.Tensor, keep_blocks: torch.Tensor,
                          group_size: int, kv_block: int) -> SparseIndex:
    """Fused estimation of the critical-KV index; same result as ``estimate_index``.

    Args:
        q_lr, k_lr: ``[B, H, S, r]`` low-rank queries and keys (any float dtype; pooled and scored in fp32).
        keep_blocks: integer ``[H]`` blocks kept per head, >= 1 (clipped to ``NKB``).
        group_size, kv_block: query tokens per group, key tokens per block.

    Returns:
        ``SparseIndex`` with ``indices [B, H, NG, max(keep)]`` ascending, ``-1`` padded, ties to the lower
        block id, on the inputs' device. Needs ``NKB = ceil(S / kv_block) <= MAX_KV_BLOCKS``.
    """
    B, H, S, R = check_bhsd({"q_lr": q_lr, "k_lr": k_lr})
    for name, value in (("group_size", group_size), ("kv_block", kv_block)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _check_num_kv_blocks(triton.cdiv(S, kv_block))
    indices, counts = _select_from_means_t(_segment_means_t(q_lr, group_size), _segment_means_t(k_lr, kv_block),
                                           keep_blocks, B, H)
    return SparseIndex(indices, counts, group_size, kv_block, S)


def estimate_index_from_means_triton(proxies: torch.Tensor, block_keys: torch.Tensor, keep_blocks: torch.Tensor,
                                     group_size: int, kv_block: int, seq_len: int) -> SparseIndex:
    """The top-k launch of ``estimate_index_triton`` on already pooled rows; same result as
    ``estimate_index_from_means`` (``proxies [B, H, NG, r]``, ``block_keys [B, H, NKB, r]``, scored in fp32)."""
    check_means(proxies, block_keys, group_size, kv_block, seq_len)
    indices, counts = estimate_rows_from_means_triton(proxies, block_keys, keep_blocks, group_size, kv_block,
                                                      seq_len, 0)
    return SparseIndex(indices, counts, group_size, kv_block, seq_len)


@launches_on_input_device
def estimate_rows_from_means_triton(proxies: torch.Tensor, block_keys: torch.Tensor, keep_blocks: torch.Tensor,
                                    group_size: int, kv_block: int, seq_len: int,
                                    first_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``estimate_rows_from_means`` with the fused top-k: the rows of the query groups ``first_group ..
    first_group + n - 1`` (``proxies [B, H, n, r]``) alone."""
    B, H, _, NKB = check_means(proxies, block_keys, group_size, kv_block, seq_len, first_group)
    _check_num_kv_blocks(NKB)

    def transposed(x: torch.Tensor) -> torch.Tensor:  # [B, H, N, r] -> [B*H, r, N] fp32, as the pooling writes
        return x.to(torch.float32).flatten(0, 1).transpose(1, 2).contiguous()

    return _select_from_means_t(transposed(proxies), transposed(block_keys), keep_blocks, B, H)
