"""Block-sparse attention over a critical-KV index, with backend dispatch."""

from __future__ import annotations

import torch

from dsv.ops.index import SparseIndex
from dsv.ops.sparse_attention.naive import (
    sparse_attention_reference,
    sparse_attention_reference_with_lse,
)

BACKENDS = ("auto", "reference")


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend that `sparse_attention(..., backend=backend)` runs for inputs like `q`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return "reference"


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Block-sparse attention: each query of group ``g`` attends to the key blocks of its index row.

    Args:
        q, k, v: ``[B, H, S, D]`` floating, same shape, dtype and device; ``S`` in grouped order.
        index: ``SparseIndex`` with ``[B, H, NG]`` rows for these inputs and ``seq_len == S``.
        scale: softmax scale, default ``D ** -0.5``.
        backend: ``"reference"`` (PyTorch) or ``"auto"``, which picks the reference until a kernel
            backend exists.

    Returns:
        ``out [B, H, S, D]`` in the input dtype, differentiable in ``q``, ``k``, ``v``.
    """
    resolve_backend(backend, q)
    return sparse_attention_reference(q, k, v, index, scale)


__all__ = [
    "BACKENDS",
    "resolve_backend",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_reference_with_lse",
]
