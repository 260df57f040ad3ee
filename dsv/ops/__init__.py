"""Functional ops: tensors in, tensors out, each with a PyTorch reference (the CPU path and test oracle)."""

from dsv.ops.estimate import estimate_index, estimate_index_from_means, estimate_rows_from_means
from dsv.ops.grouping import check_sequence_matches_grid, cube_permutation
from dsv.ops.index import PAD, SparseIndex
from dsv.ops.measure import (
    critical_counts,
    head_sparsity,
    index_recall,
    keep_blocks_from_sparsity,
    oracle_index,
    sample_key_positions,
    sample_query_rows,
    window_index,
)
from dsv.ops.sparse_attention import (
    sparse_attention,
    sparse_attention_reference,
    sparse_attention_reference_with_lse,
)

__all__ = [
    "PAD",
    "SparseIndex",
    "check_sequence_matches_grid",
    "critical_counts",
    "cube_permutation",
    "estimate_index",
    "estimate_index_from_means",
    "estimate_rows_from_means",
    "head_sparsity",
    "index_recall",
    "keep_blocks_from_sparsity",
    "oracle_index",
    "sample_key_positions",
    "sample_query_rows",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_reference_with_lse",
    "window_index",
]
