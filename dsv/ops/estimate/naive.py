"""PyTorch reference of critical-KV estimation: low-rank block scores and per-head top-k.

CPU path and test oracle of the fused estimation kernel. The ``[S, NKB]`` score matrix is produced one
chunk of query groups at a time, so peak extra memory is ``O(chunk * NKB)``, never ``S x S``.
"""

from __future__ import annotations

import math

import torch

from dsv.ops.index import (
    PAD,
    SparseIndex,
    check_bhsd,
    check_keep_blocks,
    compute_dtype,
    resolve_chunk_size,
    select_top_blocks,
)


def segment_means(x: torch.Tensor, segment: int) -> torch.Tensor:
    """Mean of each run of ``segment`` consecutive rows; a partial last run averages its valid rows.

    Args:
        x: ``[B, H, S, r]``.
        segment: rows per run.

    Returns:
        ``[B, H, ceil(S / segment), r]`` in ``x``'s dtype.
    """
    batch, heads, seq_len, rank = x.shape
    num_segments = math.ceil(seq_len / segment)
    padded = torch.nn.functional.pad(x, (0, 0, 0, num_segments * segment - seq_len))
    sums = padded.view(batch, heads, num_segments, segment, rank).sum(3)
    starts = torch.arange(num_segments, device=x.device) * segment
    lengths = (starts + segment).clamp(max=seq_len) - starts
    return sums / lengths.to(x.dtype).view(num_segments, 1)


def check_means(proxies: torch.Tensor, block_keys: torch.Tensor, group_size: int, kv_block: int,
                seq_len: int, first_group: int | None = None) -> tuple[int, int, int, int]:
    """Check the pooled inputs of ``estimate_index_from_means`` (``first_group=None``: ``proxies`` holds every
    query group) or of ``estimate_rows_from_means`` (it holds the groups from ``first_group`` on); returns
    ``(B, H, rows of proxies, NKB)``."""
    for name, value in (("group_size", group_size), ("kv_block", kv_block), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, tensor in (("proxies", proxies), ("block_keys", block_keys)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor [B, H, N, r], got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
    num_groups, num_kv_blocks = math.ceil(seq_len / group_size), math.ceil(seq_len / kv_block)
    expected = {"proxies": (num_groups, "NG = ceil(seq_len / group_size)"),
                "block_keys": (num_kv_blocks, "NKB = ceil(seq_len / kv_block)")}
    for name, tensor in (("proxies", proxies), ("block_keys", block_keys)):
        rows, what = expected[name]
        if name == "proxies" and first_group is not None:
            if (not isinstance(first_group, int) or isinstance(first_group, bool) or first_group < 0
                    or tensor.shape[2] < 1 or first_group + tensor.shape[2] > rows):
                raise ValueError(f"proxies must hold query groups first_group .. first_group + n - 1 of the "
                                 f"{what} = {rows} groups, got first_group={first_group!r} and "
                                 f"{tuple(tensor.shape)}")
        elif tensor.shape[2] != rows:
            raise ValueError(f"{name} must have {what} = {rows} rows for seq_len={seq_len}, got {tuple(tensor.shape)}")
    if (proxies.shape[:2], proxies.shape[3]) != (block_keys.shape[:2], block_keys.shape[3]):
        raise ValueError(f"proxies {tuple(proxies.shape)} and block_keys {tuple(block_keys.shape)} must share B, H "
                         "and r")
    if proxies.dtype != block_keys.dtype or proxies.device != block_keys.device:
        raise ValueError(f"proxies ({proxies.dtype}, {proxies.device}) and block_keys ({block_keys.dtype}, "
                         f"{block_keys.device}) must share dtype and device")
    return proxies.shape[0], proxies.shape[1], proxies.shape[2], num_kv_blocks


def estimate_index_from_means(
    proxies: torch.Tensor,
    block_keys: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    seq_len: int,
    chunk_groups: int | None = None,
) -> SparseIndex:
    """The selection of ``estimate_index`` from already pooled rows.

    Args:
        proxies: ``[B, H, NG, r]`` each query group's mean low-rank query.
        block_keys: ``[B, H, NKB, r]`` each key block's mean low-rank key.
        keep_blocks, group_size, kv_block, chunk_groups: as ``estimate_index``.
        seq_len: ``S``; ``NG = ceil(S / group_size)``, ``NKB = ceil(S / kv_block)``.

    Returns:
        ``SparseIndex`` with ``indices [B, H, NG, max(keep)]`` on the inputs' device.
    """
    check_means(proxies, block_keys, group_size, kv_block, seq_len)
    indices, counts = estimate_rows_from_means(proxies, block_keys, keep_blocks, group_size, kv_block, seq_len, 0,
                                               chunk_groups)
    return SparseIndex(indices, counts, group_size, kv_block, seq_len)


def estimate_rows_from_means(
    proxies: torch.Tensor,
    block_keys: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    seq_len: int,
    first_group: int,
    chunk_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``estimate_index_from_means`` for the query groups ``first_group .. first_group + n - 1``
    alone: a group's selection depends on its own proxy only, so a rank of sequence-parallel attention
    selects for its own groups.

    Args:
        proxies: ``[B, H, n, r]`` those groups' mean low-rank queries.
        block_keys, keep_blocks, group_size, kv_block, seq_len, chunk_groups: as ``estimate_index_from_means``.

    Returns:
        ``(indices [B, H, n, max(keep)], counts [B, H, n])``, the ``SparseIndex`` layout.
    """
    batch, heads, num_groups, num_kv_blocks = check_means(proxies, block_keys, group_size, kv_block, seq_len,
                                                          first_group)
    keep = check_keep_blocks(keep_blocks, heads, num_kv_blocks, proxies.device)
    # Per score element: the score itself plus the sort's values and int64 ids.
    bytes_per_group = batch * heads * num_kv_blocks * (2 * 4 + 8)
    chunk = resolve_chunk_size(chunk_groups, num_groups, bytes_per_group, "chunk_groups")
    dtype = compute_dtype(proxies.dtype)
    proxies, block_keys = proxies.to(dtype), block_keys.to(dtype)
    indices = torch.full(
        (batch, heads, num_groups, int(keep.max())), PAD, dtype=torch.int32, device=proxies.device
    )
    # In the compute dtype whatever the caller's autocast, as the fused kernel scores in fp32.
    with torch.autocast(proxies.device.type, enabled=False):
        for start in range(0, num_groups, chunk):
            scores = proxies[:, :, start : start + chunk] @ block_keys.transpose(-1, -2)
            indices[:, :, start : start + chunk], _ = select_top_blocks(scores, keep)
    counts = keep.to(torch.int32).view(1, heads, 1).expand(batch, heads, num_groups).contiguous()
    return indices, counts


def estimate_index(
    q_lr: torch.Tensor,
    k_lr: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    chunk_groups: int | None = None,
) -> SparseIndex:
    """Select each query group's key blocks from low-rank query/key projections.

    The group proxy is the mean of the group's ``q_lr`` rows, the block key the mean of the block's
    ``k_lr`` rows (partial tails average their valid rows); ``score = proxy . block_key`` and each head
    keeps its ``keep_blocks[h]`` best blocks, ties to the lower block id (``SparseIndex.from_topk``).

    Args:
        q_lr, k_lr: ``[B, H, S, r]`` low-rank queries and keys, floating, same dtype and device.
        keep_blocks: integer ``[H]`` blocks kept per head, >= 1 (clipped to ``NKB``).
        group_size: query tokens per group ``G``.
        kv_block: key tokens per block.
        chunk_groups: query groups scored at once; ``None`` sizes chunks to ``DEFAULT_CHUNK_BYTES``.

    Returns:
        ``SparseIndex`` with ``indices [B, H, NG, max(keep)]`` on the inputs' device.
    """
    seq_len = check_bhsd({"q_lr": q_lr, "k_lr": k_lr})[2]
    for name, value in (("group_size", group_size), ("kv_block", kv_block)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    dtype = compute_dtype(q_lr.dtype)
    proxies = segment_means(q_lr.to(dtype), group_size)
    block_keys = segment_means(k_lr.to(dtype), kv_block)
    return estimate_index_from_means(proxies, block_keys, keep_blocks, group_size, kv_block, seq_len, chunk_groups)
