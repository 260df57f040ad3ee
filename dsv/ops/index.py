"""The critical-KV index: which key blocks each query group attends to.

Query group ``g`` is tokens ``[g * group_size, min((g + 1) * group_size, S))`` of the grouped order; key
block ``j`` is tokens ``[j * kv_block, min((j + 1) * kv_block, S))``. Each row of the index lists the
key-block ids a group keeps: distinct, ascending, padded with ``PAD`` after ``counts`` valid entries.

Besides the index itself this module holds the argument checks and chunk sizing that every op which
produces or consumes an index shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PAD = -1
"""Fill value of ``SparseIndex.indices`` after a row's valid entries."""

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""Budget for the temporaries of one chunk of a chunked op when the caller does not pick a chunk."""


@dataclass(frozen=True)
class SparseIndex:
    """Per (batch, head, query group) list of kept key blocks.

    Attributes:
        indices: int32 ``[B, H, NG, K_max]`` key-block ids; per row distinct, ascending, ``PAD`` after
            the first ``counts`` entries.
        counts: int32 ``[B, H, NG]`` valid entries per row, ``1 <= counts <= K_max``.
        group_size: query tokens per group ``G``; ``NG = ceil(seq_len / G)``.
        kv_block: key tokens per block; ``NKB = ceil(seq_len / kv_block)``.
        seq_len: sequence length ``S``.

    The tensors are not modified in place once the index is built: ``key_major`` caches a view of them.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    group_size: int
    kv_block: int
    seq_len: int
    # Filled by `key_major` on first use; `dataclasses.replace` makes a new index, with an empty cache.
    _key_major: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    # Set by `validate_once`; like the cache above, not carried over by `dataclasses.replace`.
    _validated: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def num_groups(self) -> int:
        return math.ceil(self.seq_len / self.group_size)

    @property
    def num_kv_blocks(self) -> int:
        return math.ceil(self.seq_len / self.kv_block)

    @property
    def max_blocks(self) -> int:
        """``K_max``, the row width of ``indices``."""
        return self.indices.shape[-1]

    def validate(self) -> None:
        """Check every invariant of the index; raise ValueError naming the offending field."""
        self._check_fields()
        if self.indices.dim() != 4 or self.indices.shape[-1] < 1:
            raise ValueError(
                f"SparseIndex.indices must be [B, H, NG, K_max] with K_max >= 1, "
                f"got shape {tuple(self.indices.shape)}"
            )
        if self.indices.shape[2] != self.num_groups:
            raise ValueError(
                f"SparseIndex.indices has {self.indices.shape[2]} groups, but seq_len={self.seq_len} "
                f"and group_size={self.group_size} give NG={self.num_groups}"
            )
        if self.counts.shape != self.indices.shape[:3]:
            raise ValueError(
                f"SparseIndex.counts must have shape [B, H, NG]={tuple(self.indices.shape[:3])}, "
                f"got {tuple(self.counts.shape)}"
            )
        if self.counts.device != self.indices.device:
            raise ValueError(
                f"SparseIndex.counts is on {self.counts.device} but indices is on {self.indices.device}"
            )
        if bool(((self.counts < 1) | (self.counts > self.max_blocks)).any()):
            raise ValueError(f"SparseIndex.counts must lie in [1, K_max={self.max_blocks}]")
        valid = self.valid_mask()
        in_range = (self.indices >= 0) & (self.indices < self.num_kv_blocks)
        if bool((valid & ~in_range).any()):
            raise ValueError(f"SparseIndex.indices valid entries must lie in [0, NKB={self.num_kv_blocks})")
        if bool((~valid & (self.indices != PAD)).any()):
            raise ValueError(f"SparseIndex.indices must hold PAD={PAD} after each row's counts entries")
        ascending = self.indices[..., 1:] > self.indices[..., :-1]
        if bool((valid[..., 1:] & ~ascending).any()):
            raise ValueError("SparseIndex.indices valid entries must be strictly ascending in every row")

    def _check_fields(self) -> None:
        """The checks that read no tensor values: positive int sizes, int32 tensors."""
        for name in ("group_size", "kv_block", "seq_len"):
            check_positive_int(getattr(self, name), f"SparseIndex.{name}")
        for name in ("indices", "counts"):
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32:
                found = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"SparseIndex.{name} must be an int32 tensor, got {found}")

    def validate_once(self) -> None:
        """`validate` on the first call for this object, nothing after (its tensors are not modified)."""
        if not self._validated:
            self.validate()
            object.__setattr__(self, "_validated", True)

    def key_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(offsets, groups)``: the index by key block (``key_major_csr``), built on first use, then cached.

        The dk/dv pass of every backward walks it. Backward passes over one index object build it once
        instead of once each, which saves its ~20 small launches wherever an index is reused (a benchmark
        loop, a fixed mask). Training builds a new index every forward, so there it is built once per
        backward, as before.
        """
        if self._key_major is None:
            # The one field set after construction: frozen guards the index itself, not this derived view.
            object.__setattr__(self, "_key_major", key_major_csr(self.indices, self.num_kv_blocks))
        return self._key_major

    def valid_mask(self) -> torch.Tensor:
        """Bool ``[B, H, NG, K_max]``: True where ``indices`` holds a key-block id, not padding."""
        positions = torch.arange(self.max_blocks, device=self.indices.device)
        return positions < self.counts.unsqueeze(-1)

    def kept_fraction(self) -> torch.Tensor:
        """Float32 ``[B, H]``: fraction of the ``S`` keys each group keeps, averaged over groups.

        Counts tokens, so a kept partial last key block weighs only its valid tokens.
        """
        block_starts = torch.arange(self.num_kv_blocks, device=self.indices.device) * self.kv_block
        block_lengths = (block_starts + self.kv_block).clamp(max=self.seq_len) - block_starts
        kept_tokens = torch.where(
            self.valid_mask(), block_lengths[self.indices.clamp(min=0).long()], 0
        ).sum(-1)
        return (kept_tokens.float() / self.seq_len).mean(-1)

    def check_matches(self, batch: int, heads: int, seq_len: int, device: torch.device, name: str) -> None:
        """Raise ValueError naming ``name`` unless the index fits attention inputs of these sizes."""
        self._check_fields()  # before the sizes below use them (a group_size of 0 divided by zero)
        expected = (batch, heads, math.ceil(seq_len / self.group_size))
        if tuple(self.indices.shape[:3]) != expected:
            raise ValueError(
                f"{name}.indices has [B, H, NG]={tuple(self.indices.shape[:3])}, expected {expected} "
                f"from inputs of B={batch}, H={heads}, S={seq_len} and group_size={self.group_size}"
            )
        if self.seq_len != seq_len:
            raise ValueError(f"{name}.seq_len={self.seq_len} does not match the inputs' S={seq_len}")
        if self.indices.device != device or self.counts.device != device:
            raise ValueError(
                f"{name} tensors are on {self.indices.device}/{self.counts.device}, inputs on {device}"
            )

    @classmethod
    def from_topk(
        cls,
        scores: torch.Tensor,
        keep_blocks: torch.Tensor,
        group_size: int,
        kv_block: int,
        seq_len: int,
    ) -> SparseIndex:
        """Keep, per row, the highest-scoring key blocks.

        Args:
            scores: float ``[B, H, NG, NKB]`` block scores, higher is more important; no NaN.
            keep_blocks: integer ``[H]`` blocks to keep per head (clipped to ``NKB``), each >= 1.
            group_size, kv_block, seq_len: geometry of the index; must match the ``scores`` shape.

        Ties at the selection boundary keep the lower block id.
        """
        for name, value in (("group_size", group_size), ("kv_block", kv_block), ("seq_len", seq_len)):
            # Here, not at the index's first use: 0 divided below, and a NumPy int made an index that
            # `validate` then refused.
            check_positive_int(value, f"SparseIndex.from_topk: {name}")
        num_groups = math.ceil(seq_len / group_size)
        num_kv_blocks = math.ceil(seq_len / kv_block)
        if scores.dim() != 4 or tuple(scores.shape[2:]) != (num_groups, num_kv_blocks):
            raise ValueError(
                f"scores must be [B, H, NG={num_groups}, NKB={num_kv_blocks}] for seq_len={seq_len}, "
                f"group_size={group_size}, kv_block={kv_block}; got shape {tuple(scores.shape)}"
            )
        keep = check_keep_blocks(keep_blocks, scores.shape[1], num_kv_blocks, scores.device)
        indices, counts = select_top_blocks(scores, keep)
        return cls(indices, counts, group_size, kv_block, seq_len)


def key_major_csr(indices: torch.Tensor, num_kv_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-major CSR of an index: for each (b, h, key block), the ascending ids of the groups that list it.

    Args:
        indices: int32 ``[B, H, NG, K_max]`` in the ``SparseIndex`` layout; ``PAD`` entries are skipped.
        num_kv_blocks: ``NKB``, the number of key blocks.

    Returns:
        ``offsets`` int32 ``[B*H*NKB + 1]`` and ``groups`` int32 ``[B*H*NG*K_max]``: the groups listing key
        block ``j`` of ``(b, h)`` are ``groups[offsets[s]:offsets[s + 1]]`` with ``s = (b*H + h)*NKB + j``;
        entries past ``offsets[-1]`` are padding.

    A stable sort by ``(b*H + h)*NKB + block`` keeps groups ascending per segment; segment bounds come from a
    binary search of the sorted keys, with no host synchronisation.
    """
    batch_heads = indices.shape[0] * indices.shape[1]
    num_groups, max_blocks = indices.shape[2], indices.shape[3]
    rows = indices.reshape(batch_heads, num_groups, max_blocks)
    segment_base = torch.arange(batch_heads, device=rows.device, dtype=torch.int32).view(-1, 1, 1) * num_kv_blocks
    sentinel = batch_heads * num_kv_blocks  # padding entries sort after every segment
    keys = torch.where(rows != PAD, rows + segment_base, sentinel).flatten()
    sorted_keys, order = torch.sort(keys, stable=True)
    groups = ((order // max_blocks) % num_groups).to(torch.int32)
    bounds = torch.arange(sentinel + 1, device=rows.device, dtype=torch.int32)
    offsets = torch.searchsorted(sorted_keys, bounds, out_int32=True)
    return offsets, groups


def check_keep_blocks(
    keep_blocks: torch.Tensor, heads: int, num_kv_blocks: int, device: torch.device
) -> torch.Tensor:
    """Validate per-head keep counts; return them as int64 ``[H]`` on ``device``, clipped to ``NKB``."""
    keep = torch.as_tensor(keep_blocks)
    if keep.dtype.is_floating_point or keep.dtype.is_complex or keep.dtype == torch.bool:
        raise ValueError(f"keep_blocks must be an integer tensor [H], got dtype {keep.dtype}")
    if keep.shape != (heads,):
        raise ValueError(f"keep_blocks must have shape [H]=[{heads}], got {tuple(keep.shape)}")
    if bool((keep < 1).any()):
        raise ValueError(f"keep_blocks must be >= 1 for every head, got {keep.tolist()}")
    return keep.to(device=device, dtype=torch.int64).clamp(max=num_kv_blocks)


def select_top_blocks(scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection rule of the index, on any number of group rows.

    Args:
        scores: float ``[B, H, R, NKB]`` block scores for ``R`` group rows; no NaN.
        keep: int64 ``[H]`` blocks to keep per head, in ``[1, NKB]``.

    Returns:
        ``(indices int32 [B, H, R, max(keep)], counts int32 [B, H, R])`` in the ``SparseIndex`` layout.
    """
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN (from a NaN or Inf in the estimate's inputs: in a DSV layer, its "
                         "predictor's weights or the layer input); block selection would be arbitrary")
    batch, heads, rows, num_kv_blocks = scores.shape
    max_keep = int(keep.max())
    # A stable descending sort keeps equal scores in ascending block order, so the lower id wins ties.
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :max_keep]
    beyond_keep = torch.arange(max_keep, device=scores.device) >= keep.view(1, heads, 1, 1)
    # Sentinel NKB sorts after every real id, which leaves the padding at the end of each row.
    kept_ascending = torch.sort(ranked.masked_fill(beyond_keep, num_kv_blocks), dim=-1).values
    indices = kept_ascending.masked_fill(kept_ascending == num_kv_blocks, PAD).to(torch.int32)
    counts = keep.to(torch.int32).view(1, heads, 1).expand(batch, heads, rows).contiguous()
    return indices, counts


def resolve_chunk_size(requested: int | None, total: int, bytes_per_item: int, name: str) -> int:
    """Items (query groups or rows) per chunk of a chunked op.

    ``requested`` wins when given (must be a positive int); otherwise the chunk fills
    ``DEFAULT_CHUNK_BYTES`` of temporaries at ``bytes_per_item`` each. Never more than ``total``.
    """
    if requested is None:
        requested = max(1, DEFAULT_CHUNK_BYTES // max(1, bytes_per_item))
    elif not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"{name} must be a positive int or None, got {requested!r}")
    return min(requested, total)


def check_bhsd(tensors: dict[str, torch.Tensor]) -> tuple[int, int, int, int]:
    """Check named tensors are floating ``[B, H, S, D]`` of one shape, dtype and device.

    Returns ``(B, H, S, D)``. Raises ValueError naming the first offending argument.
    """
    names = list(tensors)
    first = tensors[names[0]]
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a tensor [B, H, S, D], got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {tuple(tensor.shape)}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name} must have a floating dtype, got {tensor.dtype}")
        if tensor.shape[2] < 1 or tensor.shape[3] < 1:
            raise ValueError(f"{name} must have S >= 1 and D >= 1, got shape {tuple(tensor.shape)}")
    for name in names[1:]:
        tensor = tensors[name]
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but {names[0]} has {tuple(first.shape)}; "
                "both must be [B, H, S, D]"
            )
        if tensor.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype} but {names[0]} has {first.dtype}")
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {names[0]} is on {first.device}")
    return tuple(first.shape)


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``head_dim ** -0.5`` for None, else ``scale`` as a float if it is a finite real
    number > 0; raises ValueError naming ``scale`` otherwise (a string, a bool, 0, a negative or NaN)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float or None (D ** -0.5), got {scale!r}")
    return float(scale)


def check_positive_int(value, name: str) -> int:
    """`value` if it is a Python int >= 1 (not a bool, a float or a NumPy int), else ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the reference ops: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def values_readable(q: torch.Tensor) -> bool:
    """Whether reading tensor values on the host is possible here: not while tracing (torch.compile, fake or
    functional tensors under a dispatch mode) nor while a CUDA graph is being captured."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    # Plain tensors and parameters hold real values; other subclasses (fake, functional) may not.
    return not (torch.compiler.is_compiling() or type(q) not in (torch.Tensor, torch.nn.Parameter)
                or _get_current_dispatch_mode() is not None or (q.is_cuda and torch.cuda.is_current_stream_capturing()))
