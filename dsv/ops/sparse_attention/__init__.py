"""Block-sparse attention over a critical-KV index, with backend dispatch."""

from __future__ import annotations

import importlib.util
import warnings

import torch

from dsv.ops.index import SparseIndex, resolve_scale, values_readable
from dsv.ops.sparse_attention.naive import (
    sparse_attention_reference,
    sparse_attention_reference_with_lse,
)

BACKENDS = ("auto", "reference", "triton")
# Looked up once, at import: torch.compile does not trace importlib, and the backend is chosen each forward.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_unsupported(q: torch.Tensor, group_size: int, kv_block: int) -> str | None:
    """Why the Triton kernels cannot run on inputs like `q` with this grouping, or None when they can."""
    if not q.is_cuda:
        return f"inputs are on {q.device}; the Triton kernels need a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype}; the fast kernels take bfloat16 or float16 (train with bf16 autocast)"
    if q.shape[-1] > 256:
        return f"head dim {q.shape[-1]} > 256"
    for name, value in (("group size (cube volume)", group_size), ("kv_block", kv_block)):
        if value < 16 or value & (value - 1):
            return f"{name} {value} is not a power of two >= 16"
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install 'dsv[triton]')"
    return None


def hopper_forward_unsupported(q: torch.Tensor, group_size: int, kv_block: int,
                               listed_blocks: int | None = None) -> str | None:
    """Why the Triton backend's forward does not take its warp-specialized Hopper kernel for inputs like `q`
    (the plain Triton forward runs instead), or None when it does. `listed_blocks`: the index's K_max, when
    known (groups listing few blocks stay on Triton). Importing the kernel needs triton."""
    if not q.is_cuda or torch.version.hip is not None or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs an NVIDIA Hopper GPU (compute capability 9.x)"
    if not TRITON_INSTALLED:
        return "triton is not installed"
    from dsv.ops.sparse_attention.hopper_kernels import hopper_forward_unsupported as reason

    return reason(q, group_size, kv_block, listed_blocks)


def hopper_backward_unsupported(q: torch.Tensor, group_size: int, kv_block: int,
                                listed_blocks: int | None = None) -> str | None:
    """Why the Triton backend's backward does not take its fused Hopper kernel for inputs like `q` (the split
    Triton backward runs instead), or None when it does. `listed_blocks`: the index's K_max, when known (the
    fused kernel runs from `hopper_backward.MIN_LISTED_BLOCKS` blocks a group). Importing it needs triton."""
    if not q.is_cuda or torch.version.hip is not None or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs an NVIDIA Hopper GPU (compute capability 9.x)"
    if not TRITON_INSTALLED:
        return "triton is not installed"
    from dsv.ops.sparse_attention.hopper_backward import hopper_backward_unsupported as reason

    return reason(q, group_size, kv_block, listed_blocks)


def hopper_backward_missing(q: torch.Tensor) -> str | None:
    """On an NVIDIA Hopper GPU with the fused backward enabled: what it lacks for inputs like `q` (dtype, head
    dim, triton's Gluon API), or None; the cases it leaves to the split backward by choice give None."""
    if not q.is_cuda or torch.version.hip is not None or torch.cuda.get_device_capability(q.device)[0] != 9:
        return None
    if not TRITON_INSTALLED:
        return "triton is not installed"
    from dsv.ops.sparse_attention.hopper_backward import hopper_backward_missing as missing

    return missing(q)


def hopper_forward_missing(q: torch.Tensor, group_size: int, kv_block: int) -> str | None:
    """On an NVIDIA Hopper GPU with the kernel enabled: what it lacks for inputs like `q` (dtype, head dim,
    triton's Gluon API), or None; the cases it leaves to Triton by measurement give None."""
    if not q.is_cuda or torch.version.hip is not None or torch.cuda.get_device_capability(q.device)[0] != 9:
        return None
    if not TRITON_INSTALLED:
        return "triton is not installed"
    from dsv.ops.sparse_attention.hopper_kernels import hopper_forward_missing as missing

    return missing(q, group_size, kv_block)


def resolve_backend(backend: str, q: torch.Tensor, group_size: int, kv_block: int) -> tuple[str, str | None]:
    """`(backend that runs, why Triton does not)` for `sparse_attention(..., backend=backend)`.

    "auto" takes Triton wherever it can run; "triton" raises with the reason where it cannot.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    reason = triton_unsupported(q, group_size, kv_block) if backend != "reference" else "reference requested"
    if backend == "triton" and reason is not None:
        raise ValueError(f"backend='triton' cannot run: {reason}")
    return ("triton" if reason is None else "reference"), reason


_WARNED_FALLBACKS: set[tuple[str, str]] = set()
"""(op, reason) pairs that `warn_reference_fallback` has warned of, once each."""


def warn_reference_fallback(op: str, device: torch.device, reason: str, stacklevel: int) -> None:
    """Warn once per op and reason that `op` with backend "auto" runs its PyTorch reference on a GPU, where it is
    many times slower than the kernels and "auto" would not say so. Eager calls only (Dynamo cannot trace it).
    `stacklevel` as `warnings.warn`'s in the caller."""
    if torch.compiler.is_compiling() or (op, reason) in _WARNED_FALLBACKS:
        return
    _WARNED_FALLBACKS.add((op, reason))
    warnings.warn(f"{op}: the PyTorch reference runs on {device}, not the Triton kernels: {reason}",
                  stacklevel=stacklevel + 1)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    scale: float | None = None,
    backend: str = "auto",
    check_index: bool = True,
) -> torch.Tensor:
    """Block-sparse attention: each query of group ``g`` attends to the key blocks of its index row.

    Args:
        q, k, v: ``[B, H, S, D]`` floating, same shape, dtype and device; ``S`` in grouped order.
        index: ``SparseIndex`` with ``[B, H, NG]`` rows for these inputs and ``seq_len == S``.
        scale: softmax scale, default ``D ** -0.5``; a finite number > 0.
        backend: ``"auto"`` (Triton kernels where they can run, else the PyTorch reference),
            ``"triton"`` or ``"reference"``; `resolve_backend` tells which runs and why.
        check_index: validate the index (`SparseIndex.validate`, a host sync) before the Triton kernels, once
            per index object: they read the listed blocks as given, so a duplicate would count twice and an
            out-of-range id read outside ``k``/``v``. DSV's own layers pass False for the indices they make;
            it is skipped where values cannot be read (tracing, fake tensors, CUDA-graph capture). The
            reference validates every call.

    Returns:
        ``out [B, H, S, D]`` in the input dtype, differentiable in ``q``, ``k``, ``v``.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):  # before the backend choice reads q's device
            raise ValueError(f"{name} must be a torch.Tensor [B, H, S, D], got {type(tensor).__name__}")
    if not isinstance(index, SparseIndex):
        raise ValueError(f"index must be a SparseIndex, got {type(index).__name__}")
    scale = None if scale is None else resolve_scale(scale, q.shape[-1])
    chosen, reason = resolve_backend(backend, q, index.group_size, index.kv_block)
    if backend == "auto" and chosen == "reference" and q.is_cuda:
        warn_reference_fallback("sparse_attention", q.device, reason, stacklevel=2)
    if chosen == "triton" and check_index and values_readable(q):
        index.validate_once()
    if chosen == "triton":
        from dsv.ops.sparse_attention.triton_kernels import sparse_attention_triton

        return sparse_attention_triton(q, k, v, index, scale)
    return sparse_attention_reference(q, k, v, index, scale)


__all__ = [
    "BACKENDS",
    "resolve_backend",
    "triton_unsupported",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_reference_with_lse",
]
