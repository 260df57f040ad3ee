"""Helpers shared by the kernel tests."""

import torch

from dsv.ops.index import PAD, SparseIndex


def with_ragged_counts(index: SparseIndex, seed: int = 0) -> SparseIndex:
    """`index` with each group keeping a random subset (at least one) of its listed blocks, still ascending:
    counts that differ from group to group within a head, as a window index has them at the grid's edges
    (top-k indices list as many blocks for every group of a head)."""
    g = torch.Generator().manual_seed(seed)
    indices, counts = index.indices.cpu(), index.counts.cpu().long()
    k_max = indices.shape[-1]
    position = torch.arange(k_max)
    kept_counts = torch.minimum((torch.rand(counts.shape, generator=g) * counts).long() + 1, counts)
    listed = position < counts[..., None]
    rank = torch.rand(indices.shape, generator=g).masked_fill(~listed, 2.0).argsort(-1).argsort(-1)
    kept = rank < kept_counts[..., None]
    # The kept entries first, in their (ascending) order, then padding.
    order = ((~kept).long() * k_max + position).argsort(-1)
    ragged = torch.gather(indices, -1, order).masked_fill(position >= kept_counts[..., None], PAD)
    return SparseIndex(ragged.to(index.indices.device), kept_counts.to(index.counts.device, index.counts.dtype),
                       index.group_size, index.kv_block, index.seq_len)
