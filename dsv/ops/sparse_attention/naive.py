"""PyTorch reference of block-sparse attention over a ``SparseIndex``.

CPU path, test oracle and spec of the sparse attention kernel. Every query of group ``g`` attends to
exactly the tokens of the key blocks listed in its index row. Work goes one chunk of query groups at a
time: the chunk's selected keys and values are gathered into dense tiles, so memory is
``O(chunk * G * K_tokens)`` and never ``S x S``. The backward recomputes the probabilities from the saved
log-sum-exp, FlashAttention-2 style.
"""

from __future__ import annotations

import torch

from dsv.ops.index import SparseIndex, check_bhsd, compute_dtype, resolve_chunk_size, resolve_scale


class _ChunkGeometry:
    """Token-level view of the index rows of query groups ``[start, stop)``.

    Attributes:
        rows: slice of the chunk's query tokens in ``[0, S)``.
        num_rows: tokens in ``rows`` (fewer than ``(stop - start) * G`` on a ragged tail).
        token_ids: int64 ``[B, H, C, K_tok]`` key token ids, ``K_tok = K_max * kv_block``; padding
            entries point at token 0 so gathers stay in range.
        key_mask: bool ``[B, H, C, 1, K_tok]``, True at real key tokens; broadcasts over a group's rows.

    Query rows past ``S`` in a ragged last group are zero-padded, not masked: their outputs are dropped
    and their zero output gradients add nothing to dk or dv.
    """

    def __init__(self, index: SparseIndex, start: int, stop: int):
        group_size, kv_block, seq_len = index.group_size, index.kv_block, index.seq_len
        device = index.indices.device
        blocks = index.indices[:, :, start:stop].long()
        offsets = torch.arange(kv_block, device=device)
        token_ids = (blocks.unsqueeze(-1) * kv_block + offsets).flatten(-2)
        block_valid = torch.arange(index.max_blocks, device=device) < index.counts[:, :, start:stop, None]
        # Padding entries (PAD ids) and tokens past S in a partial last key block are not keys.
        key_valid = block_valid.repeat_interleave(kv_block, dim=-1) & (token_ids < seq_len)
        self.num_groups, self.group_size = stop - start, group_size
        self.rows = slice(start * group_size, min(stop * group_size, seq_len))
        self.num_rows = self.rows.stop - self.rows.start
        self.token_ids = torch.where(key_valid, token_ids, 0)
        self.key_mask = key_valid.unsqueeze(3)

    def gather(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of ``x [B, H, S, D]`` at ``token_ids``, as ``[B, H, C, K_tok, D]`` in ``dtype``."""
        batch, heads, chunk, tokens = self.token_ids.shape
        flat_ids = self.token_ids.view(batch, heads, chunk * tokens, 1).expand(-1, -1, -1, x.shape[-1])
        return torch.gather(x, 2, flat_ids).to(dtype).view(batch, heads, chunk, tokens, x.shape[-1])

    def grouped_rows(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The chunk's query rows of ``x [B, H, S, D]`` as ``[B, H, C, G, D]``; ragged rows are zero."""
        rows = x[:, :, self.rows].to(dtype)
        rows = torch.nn.functional.pad(rows, (0, 0, 0, self.num_groups * self.group_size - self.num_rows))
        return rows.view(x.shape[0], x.shape[1], self.num_groups, self.group_size, x.shape[-1])

    def scatter_rows(self, dest: torch.Tensor, grouped: torch.Tensor) -> None:
        """Write ``grouped [B, H, C, G, ...]`` into the chunk's rows of ``dest [B, H, S, ...]``."""
        flat = grouped.flatten(2, 3)[:, :, : self.num_rows]
        dest[:, :, self.rows] = flat.to(dest.dtype)

    def accumulate(self, dest: torch.Tensor, per_token: torch.Tensor) -> None:
        """Add ``per_token [B, H, C, K_tok, D]`` into ``dest [B, H, S, D]`` at ``token_ids``."""
        batch, heads, seq_len, dim = dest.shape
        head_offsets = torch.arange(batch * heads, device=dest.device).view(batch, heads, 1, 1) * seq_len
        flat_ids = (self.token_ids + head_offsets).flatten()
        dest.view(batch * heads * seq_len, dim).index_add_(0, flat_ids, per_token.reshape(-1, dim))


def _chunk_groups(index: SparseIndex, batch: int, heads: int, dim: int, chunk_groups: int | None) -> int:
    key_tokens = index.max_blocks * index.kv_block
    group_size = index.group_size
    # Backward peak per group, in elements: scores, probabilities and their gradient (G x K_tok), the
    # gathered k, v and the dk, dv tiles (K_tok x D), the group's q, o, do, dq rows (G x D); float64 bound.
    elements = 3 * group_size * key_tokens + 4 * key_tokens * dim + 4 * group_size * dim
    return resolve_chunk_size(chunk_groups, index.num_groups, batch * heads * elements * 8, "chunk_groups")


def _chunk_scores(
    q: torch.Tensor, k: torch.Tensor, geometry: _ChunkGeometry, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked scaled scores ``[B, H, C, G, K_tok]`` (-inf off the index), the query rows and the keys."""
    q_rows = geometry.grouped_rows(q, dtype)
    keys = geometry.gather(k, dtype)
    scores = (q_rows @ keys.transpose(-1, -2)) * scale
    return scores.masked_fill(~geometry.key_mask, float("-inf")), q_rows, keys


# Custom ops rather than an autograd.Function: torch.compile keeps each one as a single opaque node
# (the chunk loops and the index checks read values, which a graph cannot branch on), and activation
# checkpointing recomputes them like any op.


@torch.library.custom_op("dsv::sparse_attention_reference_fwd", mutates_args=())
def _reference_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    group_size: int,
    kv_block: int,
    scale: float,
    chunk_groups: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Autocast off: the op's kernel runs below autocast's dispatch, but its matmuls would still see the
    # caller's autocast and run in bf16 instead of the compute dtype (and differ from a compiled graph's).
    with torch.autocast(q.device.type, enabled=False):
        return _reference_fwd_impl(q, k, v, indices, counts, group_size, kv_block, scale, chunk_groups)


def _reference_fwd_impl(q, k, v, indices, counts, group_size, kv_block, scale, chunk_groups):
    batch, heads, seq_len, dim = q.shape
    index = SparseIndex(indices, counts, group_size, kv_block, seq_len)
    index.validate()  # here, not in the caller: its checks read the index's values
    dtype = compute_dtype(q.dtype)
    # NaN-filled so a row that no chunk writes shows up in every test instead of passing as zero.
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, heads, seq_len), float("nan"), dtype=dtype, device=q.device)
    chunk = _chunk_groups(index, batch, heads, dim, chunk_groups)
    for start in range(0, index.num_groups, chunk):
        geometry = _ChunkGeometry(index, start, min(start + chunk, index.num_groups))
        scores, _, _ = _chunk_scores(q, k, geometry, scale, dtype)
        # Every row keeps >= 1 block and every block >= 1 token, so no real row is all -inf; the zero
        # padding rows of a ragged tail see finite scores too.
        row_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - row_lse.unsqueeze(-1))
        geometry.scatter_rows(out, probs @ geometry.gather(v, dtype))
        geometry.scatter_rows(lse, row_lse)
    return out, lse


@_reference_fwd.register_fake
def _(q, k, v, indices, counts, group_size, kv_block, scale, chunk_groups):
    batch, heads, seq_len, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seq_len), dtype=compute_dtype(q.dtype))


@torch.library.custom_op("dsv::sparse_attention_reference_bwd", mutates_args=())
def _reference_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    group_size: int,
    kv_block: int,
    scale: float,
    chunk_groups: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(q.device.type, enabled=False):  # as in the forward
        return _reference_bwd_impl(grad_out, q, k, v, out, lse, indices, counts, group_size, kv_block, scale,
                                   chunk_groups)


def _reference_bwd_impl(grad_out, q, k, v, out, lse, indices, counts, group_size, kv_block, scale, chunk_groups):
    batch, heads, seq_len, dim = q.shape
    index = SparseIndex(indices, counts, group_size, kv_block, seq_len)
    chunk = _chunk_groups(index, batch, heads, dim, chunk_groups)  # the forward's chunks
    dtype = compute_dtype(q.dtype)
    dq = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)
    # Keys no group selects get no gradient, so dk and dv start from zero and accumulate.
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for start in range(0, index.num_groups, chunk):
        geometry = _ChunkGeometry(index, start, min(start + chunk, index.num_groups))
        scores, q_rows, keys = _chunk_scores(q, k, geometry, scale, dtype)
        # Padding query rows of a ragged tail get lse 0; their zero dO rows contribute nothing.
        row_lse = geometry.grouped_rows(lse.unsqueeze(-1), dtype)
        probs = torch.exp(scores - row_lse)
        d_out = geometry.grouped_rows(grad_out, dtype)
        out_rows = geometry.grouped_rows(out, dtype)
        values = geometry.gather(v, dtype)
        # D_i = rowsum(dO * O) equals rowsum(P * dP), the softmax-Jacobian correction per row.
        correction = (d_out * out_rows).sum(-1, keepdim=True)
        d_scores = probs * (d_out @ values.transpose(-1, -2) - correction)
        geometry.scatter_rows(dq, (d_scores @ keys) * scale)
        geometry.accumulate(dk, (d_scores.transpose(-1, -2) @ q_rows) * scale)
        geometry.accumulate(dv, probs.transpose(-1, -2) @ d_out)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_reference_bwd.register_fake
def _(grad_out, q, k, v, out, lse, indices, counts, group_size, kv_block, scale, chunk_groups):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, indices, counts, group_size, kv_block, scale, chunk_groups = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, indices, counts)
    ctx.group_size, ctx.kv_block, ctx.scale, ctx.chunk_groups = group_size, kv_block, scale, chunk_groups
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, indices, counts = ctx.saved_tensors
    dq, dk, dv = _reference_bwd(grad_out, q, k, v, out, lse, indices, counts, ctx.group_size, ctx.kv_block,
                                ctx.scale, ctx.chunk_groups)
    return dq, dk, dv, None, None, None, None, None, None


_reference_fwd.register_autograd(_backward, setup_context=_setup_context)


def check_sparse_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: SparseIndex, scale: float | None
) -> float:
    """Validate sparse-attention arguments; return the softmax scale (default ``D ** -0.5``)."""
    batch, heads, seq_len, dim = check_bhsd({"q": q, "k": k, "v": v})
    if not isinstance(index, SparseIndex):
        raise ValueError(f"index must be a SparseIndex, got {type(index).__name__}")
    index.check_matches(batch, heads, seq_len, q.device, "index")
    return resolve_scale(scale, dim)


def sparse_attention_reference_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    scale: float | None = None,
    chunk_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention that also returns the per-row log-sum-exp.

    Args:
        q, k, v: ``[B, H, S, D]`` floating, same shape, dtype and device; ``S`` in grouped order.
        index: ``SparseIndex`` with ``[B, H, NG]`` rows for these inputs and ``seq_len == S``.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_groups: query groups per chunk; ``None`` sizes chunks to ``DEFAULT_CHUNK_BYTES``.

    Returns:
        ``(out [B, H, S, D]`` in the input dtype, ``lse [B, H, S]`` of the scaled scores over each row's
        kept keys in float32, or float64 for float64 inputs). ``lse`` carries no gradient.
    """
    scale = check_sparse_attention_inputs(q, k, v, index, scale)
    return _reference_fwd(q, k, v, index.indices, index.counts, index.group_size, index.kv_block, scale,
                          chunk_groups)


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: SparseIndex,
    scale: float | None = None,
    chunk_groups: int | None = None,
) -> torch.Tensor:
    """Block-sparse attention, differentiable in ``q``, ``k``, ``v``.

    Args:
        q, k, v: ``[B, H, S, D]`` floating, same shape, dtype and device; ``S`` in grouped order.
        index: ``SparseIndex`` with ``[B, H, NG]`` rows for these inputs and ``seq_len == S``.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_groups: query groups per chunk; ``None`` sizes chunks to ``DEFAULT_CHUNK_BYTES``.

    Returns:
        ``out [B, H, S, D]`` in the input dtype, accumulated in float32 (float64 for float64 inputs).
    """
    return sparse_attention_reference_with_lse(q, k, v, index, scale, chunk_groups)[0]
