"""Critical-KV estimation: which key blocks each query group keeps, with backend dispatch."""

from __future__ import annotations

import torch

from dsv.ops.estimate.naive import estimate_index as estimate_index_reference
from dsv.ops.estimate.naive import estimate_index_from_means as estimate_index_from_means_reference
from dsv.ops.estimate.naive import estimate_rows_from_means as estimate_rows_from_means_reference
from dsv.ops.index import SparseIndex, check_positive_int
from dsv.ops.sparse_attention import TRITON_INSTALLED, warn_reference_fallback

BACKENDS = ("auto", "reference", "triton")


def triton_estimation_unsupported(q_lr: torch.Tensor, kv_block: int, seq_len: int | None = None) -> str | None:
    """Why the fused Triton estimation cannot run on these inputs (`seq_len` defaults to `q_lr`'s rows), or
    None when it can."""
    if not q_lr.is_cuda:
        return f"inputs are on {q_lr.device}; the Triton kernels need a CUDA device"
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install 'dsv[triton]')"
    if q_lr.dtype == torch.float64:
        return "float64 inputs; the kernels score in float32, which can tie blocks the reference tells apart"
    from dsv.ops.estimate.triton_kernels import MAX_KV_BLOCKS

    if -(-(q_lr.shape[2] if seq_len is None else seq_len) // kv_block) > MAX_KV_BLOCKS:
        return f"more than {MAX_KV_BLOCKS} key blocks per row; use a larger kv_block"
    return None


def estimate_index(
    q_lr: torch.Tensor,
    k_lr: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    backend: str = "auto",
) -> SparseIndex:
    """Select each query group's key blocks from low-rank scores (see `naive.estimate_index` for the rule).

    `backend`: "auto" = the fused Triton kernel where it can run (CUDA), else the PyTorch reference;
    "triton" raises with the reason when it cannot run. Pass `keep_blocks` on the CPU: the kernel then
    needs no device synchronisation.
    """
    if _use_triton(backend, q_lr, "q_lr", kv_block, q_lr.shape[2] if isinstance(q_lr, torch.Tensor) else None):
        from dsv.ops.estimate.triton_kernels import estimate_index_triton

        return estimate_index_triton(q_lr, k_lr, keep_blocks, group_size, kv_block)
    return estimate_index_reference(q_lr, k_lr, keep_blocks, group_size, kv_block)


def estimate_index_from_means(
    proxies: torch.Tensor,
    block_keys: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    seq_len: int,
    backend: str = "auto",
) -> SparseIndex:
    """`estimate_index` from already pooled rows: `proxies [B, H, NG, r]` (each query group's mean low-rank
    query), `block_keys [B, H, NKB, r]` (each key block's mean low-rank key) of a `seq_len`-token sequence.
    A caller whose low-rank rows are linear in a smaller input pools that input instead (see
    `LowRankPredictor.pooled_project`). `backend` as in `estimate_index`."""
    if _use_triton(backend, proxies, "proxies", kv_block, seq_len):
        from dsv.ops.estimate.triton_kernels import estimate_index_from_means_triton

        return estimate_index_from_means_triton(proxies, block_keys, keep_blocks, group_size, kv_block, seq_len)
    return estimate_index_from_means_reference(proxies, block_keys, keep_blocks, group_size, kv_block, seq_len)


def estimate_rows_from_means(
    proxies: torch.Tensor,
    block_keys: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    seq_len: int,
    first_group: int,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `estimate_index_from_means` for the query groups `first_group .. first_group + n - 1` alone
    (`proxies [B, H, n, r]`): `(indices [B, H, n, K_max], counts [B, H, n])`. A group's keys depend on its own
    proxy only, so each rank of sequence-parallel attention selects for its own groups. `backend` as in
    `estimate_index`."""
    if _use_triton(backend, proxies, "proxies", kv_block, seq_len):
        from dsv.ops.estimate.triton_kernels import estimate_rows_from_means_triton

        return estimate_rows_from_means_triton(proxies, block_keys, keep_blocks, group_size, kv_block, seq_len,
                                               first_group)
    return estimate_rows_from_means_reference(proxies, block_keys, keep_blocks, group_size, kv_block, seq_len,
                                              first_group)


def _use_triton(backend: str, x: torch.Tensor, name: str, kv_block: int, seq_len: int | None) -> bool:
    """Whether the Triton kernel runs; with "auto" on a GPU, a warning (once per reason) where it does not. The
    arguments it reads are checked first: the reference checks the rest."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [B, H, rows, r], got {type(x).__name__}")
    check_positive_int(kv_block, "kv_block")
    check_positive_int(seq_len, "seq_len")
    reason = triton_estimation_unsupported(x, kv_block, seq_len) if backend != "reference" else "reference requested"
    if backend == "triton" and reason is not None:
        raise ValueError(f"backend='triton' cannot run: {reason}")
    if backend == "auto" and reason is not None and x.is_cuda:
        warn_reference_fallback("critical-KV estimation", x.device, reason, stacklevel=3)
    return reason is None


__all__ = [
    "BACKENDS",
    "estimate_index",
    "estimate_index_from_means",
    "estimate_index_from_means_reference",
    "estimate_index_reference",
    "estimate_rows_from_means",
    "estimate_rows_from_means_reference",
    "triton_estimation_unsupported",
]
