"""Head-wise context parallelism (HCP, Ulysses-like) with uneven, cost-balanced head counts.

Layout. ``N`` ranks of a process group each hold a contiguous chunk of the grouped-order sequence:
rank ``r`` holds tokens ``[r * S_local, (r + 1) * S_local)`` of every head, ``S = N * S_local``. A
placement (``dsv.parallel.placement``) gives rank ``r`` the heads ``placement[r]`` (``H_r`` of them; the
counts may differ). Heads are permuted into the order ``placement[0] + placement[1] + ...`` so that each
rank's heads are one contiguous run of ``H_r`` heads; one ``all_to_all_single`` with split sizes
``[H_0, ..., H_{N-1}]`` then hands rank ``r`` the full sequence of its heads, and the reverse exchange
returns each rank its ``S_local`` rows of every head's output.

Communication per rank and direction: ``3 * H_r * S_local * D * (N - 1)`` elements in for q, k, v and
``H_r * S_local * D * (N - 1)`` out for the output; the backward moves the same volumes the other way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsv.modules.attention import any_rank
from dsv.ops.index import SparseIndex, check_bhsd
from dsv.ops.sparse_attention import sparse_attention_reference
from dsv.parallel.placement import check_placement

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
"""``attention_fn(q, k, v, head_ids) -> out``: ``[B, H_r, S, D]`` inputs of the global heads ``head_ids``."""


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 with uneven splits; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, output_splits: list[int], input_splits: list[int], group):
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        output_splits, input_splits = ctx.splits
        # The gradient of a row goes back to where the row came from: the same exchange, splits swapped.
        grad_in = grad_out.new_empty((sum(input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group=None
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0.

    Args:
        x: ``[sum(input_splits), ...]``; the ``input_splits[j]`` rows after the first
            ``sum(input_splits[:j])`` go to rank ``j`` of ``group``.
        output_splits: rows received from each rank; must match what each rank sends here.
        input_splits: rows sent to each rank.
        group: process group, default the world.

    Returns:
        ``[sum(output_splits), ...]``, the rows from rank 0 first. Its gradient is routed back to the
        senders by the reverse exchange (collective in backward too: every rank must run backward).
    """
    world = dist.get_world_size(group)
    if len(output_splits) != world or len(input_splits) != world:
        raise ValueError(
            f"split lists must have one entry per rank ({world}), got {len(output_splits)} and "
            f"{len(input_splits)}"
        )
    if sum(input_splits) != x.shape[0]:
        raise ValueError(f"input_splits sum to {sum(input_splits)} but x has {x.shape[0]} rows")
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group)


def hcp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    placement: Sequence[Sequence[int]],
    attention_fn: AttentionFn,
    group=None,
) -> torch.Tensor:
    """Attention over a sequence-sharded input, computed head-parallel with uneven head counts.

    Every rank of ``group`` must call this with the same shapes, the same ``placement`` and an
    ``attention_fn`` that computes the same function of its heads.

    Args:
        q, k, v: ``[B, H, S_local, D]``, this rank's contiguous chunk of the grouped-order sequence
            (rank ``r`` holds tokens ``[r * S_local, (r + 1) * S_local)``).
        placement: ``N`` lists of global head ids (``dsv.parallel.placement.place_heads``); rank ``r``
            computes the heads ``placement[r]``, at least one.
        attention_fn: ``attention_fn(q_full, k_full, v_full, head_ids) -> out_full``, all
            ``[B, H_r, S, D]`` with ``S = N * S_local``; ``head_ids`` are the global ids of the ``H_r`` heads
            in order (``placement[r]``). E.g. ``dense_attention_fn()`` or ``sparse_attention_fn(index)``.
        group: process group, default the world.

    Returns:
        ``out [B, H, S_local, D]``: this rank's rows of the attention output of every head, in the
        input's head order. Differentiable in ``q``, ``k``, ``v`` (the backward is collective too).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    refusal = None
    try:
        batch, heads, local_len, dim = check_bhsd({"q": q, "k": k, "v": v})
        if world > heads:
            raise ValueError(
                f"head-wise CP over {world} ranks needs at least {world} heads, got H={heads}; "
                "use sequence-wise CP (dsv.parallel.scp) for the extra ranks"
            )
        check_placement(placement, heads, world)
    except ValueError as err:
        refusal = err
    _raise_on_every_rank(refusal, device, group)
    rank_heads = [int(h) for h in placement[rank]]
    qkv = torch.cat((q, k, v), dim=-1)  # one exchange for the three tensors
    q_full, k_full, v_full = heads_to_sequence(qkv, placement, group).split(dim, dim=-1)
    out_full = attention_fn(q_full, k_full, v_full, rank_heads)
    expected = (batch, len(rank_heads), world * local_len, dim)
    shape_error = None
    if tuple(out_full.shape) != expected:
        shape_error = ValueError(f"attention_fn returned shape {tuple(out_full.shape)}, expected {expected}")
    _raise_on_every_rank(shape_error, device, group)
    return sequence_to_heads(out_full, placement, group)


def _raise_on_every_rank(error: ValueError | None, device: torch.device, group) -> None:
    """Raise `error` here, and on the other ranks of `group` an error that points to it (one all-reduce):
    raised on one rank alone, the others waited in the next exchange or failed there with a transport error."""
    if any_rank(torch.tensor(error is not None, device=device), group):
        raise error if error is not None else ValueError(
            "hcp_attention: another rank of the group refused its input (its own error names it)")


def heads_to_sequence(x: torch.Tensor, placement: Sequence[Sequence[int]], group=None) -> torch.Tensor:
    """``[B, H, S_local, E]`` (this rank's sequence chunk, every head) -> ``[B, H_r, N * S_local, E]`` (the
    whole sequence of this rank's heads ``placement[rank]``, in that order). Differentiable; collective."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, _, local_len, width = x.shape
    order = torch.tensor([h for members in placement for h in members], device=x.device)
    counts = [len(members) for members in placement]
    mine = counts[rank]
    # Heads first, in placement order, so that each rank's heads are one contiguous split of dim 0.
    received = all_to_all(x.index_select(1, order).transpose(0, 1), [mine] * world, counts, group)
    # Rows arrive from rank 0 first, so the source rank index is the sequence chunk index.
    full = received.view(world, mine, batch, local_len, width).permute(2, 1, 0, 3, 4)
    return full.reshape(batch, mine, world * local_len, width)


def sequence_to_heads(x: torch.Tensor, placement: Sequence[Sequence[int]], group=None) -> torch.Tensor:
    """Inverse of ``heads_to_sequence``: ``[B, H_r, N * S_local, E]`` -> ``[B, H, S_local, E]`` in the
    global head order. Differentiable; collective."""
    world = dist.get_world_size(group)
    batch, mine, seq_len, width = x.shape
    local_len = seq_len // world
    order = torch.tensor([h for members in placement for h in members], device=x.device)
    counts = [len(members) for members in placement]
    # [B, H_r, N * S_local, E] -> [N, H_r, B, S_local, E]: chunk j goes back to rank j.
    chunks = x.reshape(batch, mine, world, local_len, width).permute(2, 1, 0, 3, 4)
    returned = all_to_all(chunks.reshape(world * mine, batch, local_len, width), counts, [mine] * world, group)
    out_permuted = returned.transpose(0, 1)  # [B, H, S_local, E], heads in placement order
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=x.device)
    return out_permuted.index_select(1, inverse)


def select_heads(index: SparseIndex, heads: Sequence[int]) -> SparseIndex:
    """The rows of ``index`` for the global head ids ``heads``, in that order."""
    ids = torch.tensor(list(heads), device=index.indices.device)
    return SparseIndex(index.indices.index_select(1, ids), index.counts.index_select(1, ids), index.group_size,
                       index.kv_block, index.seq_len)


def dense_attention_fn(scale: float | None = None) -> AttentionFn:
    """An ``attention_fn`` running dense ``F.scaled_dot_product_attention`` on the received heads."""

    def attention(q, k, v, head_ids):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    return attention


def sparse_attention_fn(index: SparseIndex, scale: float | None = None) -> AttentionFn:
    """An ``attention_fn`` running ``sparse_attention_reference`` with the received heads' rows of ``index``.

    Args:
        index: the full-sequence ``SparseIndex`` ``[B, H, NG, K_max]`` of all heads, identical on every rank.
        scale: softmax scale, default ``D ** -0.5``.
    """

    def attention(q, k, v, head_ids):
        return sparse_attention_reference(q, k, v, select_heads(index, head_ids), scale)

    return attention
