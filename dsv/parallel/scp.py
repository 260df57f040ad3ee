"""Sequence-wise context parallelism (SCP) that moves only the remote *critical* key/value blocks.

Layout. ``N`` ranks each hold a contiguous chunk of the grouped-order sequence: rank ``r`` holds tokens
``[r * S_local, (r + 1) * S_local)`` of q, k and v for every head, ``S = N * S_local``. ``S_local`` must be
a whole number of query groups and of key blocks, so rank ``r`` owns query groups
``[r * S_local / G, (r + 1) * S_local / G)`` and key blocks ``[r * S_local / kv_block, ...)``.

Forward, per rank:
1. From its index rows, list the distinct ``(batch, head, key block)`` triples owned by other ranks.
2. Exchange the request counts, then the requests (``all_to_all_single`` with uneven splits).
3. Owners send the requested K/V blocks back; the requester appends them after its local K/V, per
   ``(batch, head)`` in ascending block order ("slots"), zero-padded to the largest slot count ``M``.
4. Run ``sparse_attention`` on ``[local K/V + fetched blocks]`` (``S_local + M * kv_block``
   rows) with the index remapped to that layout. The queries are zero-padded to the same length because
   the kernels take equal q/k/v shapes; each padding query group attends to one block and is dropped.

Backward: the K/V exchange is ``dsv.parallel.hcp.all_to_all``, whose gradient is the reverse exchange,
and the owner's block gather is an ``index_select``, whose gradient sums the dK/dV of every requester of
a block into the owner's dk/dv.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsv.ops.index import PAD, SparseIndex, check_bhsd
from dsv.ops.sparse_attention import sparse_attention
from dsv.parallel.hcp import all_to_all


@dataclass(frozen=True)
class LocalIndex:
    """One rank's rows of a global critical-KV index.

    Attributes:
        indices: int32 ``[B, H, NG_local, K_max]`` *global* key-block ids of this rank's query groups;
            per row distinct, ascending, ``PAD`` after ``counts`` entries (the ``SparseIndex`` layout).
        counts: int32 ``[B, H, NG_local]``, ``1 <= counts <= K_max``.
        group_size, kv_block: as in ``SparseIndex``.
        seq_len: the *global* sequence length ``S``.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    group_size: int
    kv_block: int
    seq_len: int

    @classmethod
    def from_global(cls, index: SparseIndex, rank: int, world: int) -> LocalIndex:
        """The rows of ``index`` (over the whole sequence) for the query groups of ``rank``."""
        local_len = check_sequence_split(index.seq_len, world, index.group_size, index.kv_block)
        groups = local_len // index.group_size
        rows = slice(rank * groups, (rank + 1) * groups)
        return cls(index.indices[:, :, rows], index.counts[:, :, rows], index.group_size, index.kv_block,
                   index.seq_len)


@dataclass(frozen=True)
class ScpCommStats:
    """What one rank moved in one ``scp_attention`` forward; the backward moves the K/V volume reversed.

    Attributes:
        fetched_blocks: ``(batch, head, key block)`` entries this rank received.
        served_blocks: entries this rank sent to requesters.
        kv_bytes_received: K/V payload received (forward); the backward sends as many dK/dV bytes.
        kv_bytes_sent: K/V payload sent (forward); the backward receives as many dK/dV bytes.
        request_bytes_sent: request counts and request ids sent.
        full_kv_bytes: K/V bytes this rank would receive fetching every remote row (ring attention).
    """

    fetched_blocks: int
    served_blocks: int
    kv_bytes_received: int
    kv_bytes_sent: int
    request_bytes_sent: int
    full_kv_bytes: int


def check_sequence_split(seq_len: int, world: int, group_size: int, kv_block: int) -> int:
    """Return ``S_local = S / N``; raise ValueError unless it is a whole number of groups and key blocks."""
    if seq_len % world:
        raise ValueError(f"sequence of S={seq_len} tokens does not split evenly over {world} ranks")
    local_len = seq_len // world
    if local_len % group_size:
        raise ValueError(
            f"each rank's S/N={local_len} tokens must be a whole number of query groups "
            f"(group_size={group_size})"
        )
    if local_len % kv_block:
        raise ValueError(
            f"each rank's S/N={local_len} tokens must be a whole number of key blocks (kv_block={kv_block})"
        )
    return local_len


REFUSED = -1
"""The request count a rank sends every peer in the first exchange when its own input is invalid."""


def _check_local_index(index: LocalIndex, batch: int, heads: int, local_len: int, world: int) -> None:
    if not isinstance(index, LocalIndex):
        raise ValueError(f"index must be a LocalIndex, got {type(index).__name__}")
    for name in ("group_size", "kv_block", "seq_len"):
        value = getattr(index, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"LocalIndex.{name} must be a positive int, got {value!r}")
    if index.seq_len != world * local_len:
        raise ValueError(
            f"LocalIndex.seq_len={index.seq_len} must equal N * S_local = {world} * {local_len}: "
            "every rank holds an equal contiguous chunk"
        )
    check_sequence_split(index.seq_len, world, index.group_size, index.kv_block)
    if index.indices.dtype != torch.int32 or index.counts.dtype != torch.int32:
        raise ValueError("LocalIndex.indices and counts must be int32 tensors")
    groups = local_len // index.group_size
    if index.indices.dim() != 4 or tuple(index.indices.shape[:3]) != (batch, heads, groups):
        raise ValueError(
            f"LocalIndex.indices must be [B, H, NG_local, K_max] = [{batch}, {heads}, {groups}, K], "
            f"got {tuple(index.indices.shape)}"
        )
    if tuple(index.counts.shape) != (batch, heads, groups):
        raise ValueError(f"LocalIndex.counts must be [{batch}, {heads}, {groups}], got {tuple(index.counts.shape)}")
    k_max = index.indices.shape[-1]
    if bool(((index.counts < 1) | (index.counts > k_max)).any()):
        raise ValueError(f"LocalIndex.counts must lie in [1, K_max={k_max}]")
    valid = torch.arange(k_max, device=index.indices.device) < index.counts.unsqueeze(-1)
    num_blocks = index.seq_len // index.kv_block
    if bool((valid & ((index.indices < 0) | (index.indices >= num_blocks))).any()):
        raise ValueError(f"LocalIndex.indices valid entries must lie in [0, NKB={num_blocks})")
    if bool((~valid & (index.indices != PAD)).any()):
        raise ValueError(f"LocalIndex.indices must hold PAD={PAD} after each row's counts entries")
    if bool((valid[..., 1:] & (index.indices[..., 1:] <= index.indices[..., :-1])).any()):
        raise ValueError("LocalIndex.indices valid entries must be strictly ascending in every row")


def scp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: LocalIndex,
    scale: float | None = None,
    group=None,
    backend: str = "auto",
) -> tuple[torch.Tensor, ScpCommStats]:
    """Block-sparse attention over a sequence-sharded input, fetching only the remote key blocks used.

    Every rank of ``group`` must call this with the same shapes and geometry.

    Args:
        q, k, v: ``[B, H, S_local, D]``, this rank's contiguous chunk of the grouped-order sequence.
        index: this rank's rows of the global index (``LocalIndex.from_global``), global key-block ids.
        scale: softmax scale, default ``D ** -0.5``.
        group: process group, default the world.
        backend: the local attention's backend (``dsv.ops.sparse_attention``): Triton where it can run.

    Returns:
        ``(out [B, H, S_local, D], stats)``: this rank's rows of the attention output, equal to
        ``sparse_attention`` on the full sequence; differentiable in ``q``, ``k``, ``v`` (collective in
        backward: every rank must run backward). ``stats`` counts the bytes this rank moved.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    try:
        batch, heads, local_len, dim = check_bhsd({"q": q, "k": k, "v": v})
        _check_local_index(index, batch, heads, local_len, world)
    except ValueError:
        # The peers learn of it in the first exchange, which they are waiting in, and raise too: alone, this
        # rank's error left them with a transport error of no evident cause, or waiting.
        device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
        refusal = torch.full((world,), REFUSED, dtype=torch.int64, device=device)
        dist.all_to_all_single(torch.empty_like(refusal), refusal, group=group)
        raise
    device, kv_block = q.device, index.kv_block
    local_blocks = local_len // kv_block
    num_blocks = world * local_blocks
    pairs = batch * heads

    with torch.no_grad():
        ids = index.indices.long()
        valid = torch.arange(ids.shape[-1], device=device) < index.counts.unsqueeze(-1)
        remote = valid & (ids // local_blocks != rank)
        pair_of_row = torch.arange(pairs, device=device).view(batch, heads, 1, 1)
        # One key per (batch, head, global block): sorted by pair, then by block id.
        keys = pair_of_row * num_blocks + ids
        wanted = torch.unique(keys[remote])
        wanted_pair, wanted_block = wanted // num_blocks, wanted % num_blocks
        per_pair = torch.bincount(wanted_pair, minlength=pairs)
        slot = torch.arange(wanted.numel(), device=device) - (torch.cumsum(per_pair, 0) - per_pair)[wanted_pair]

        # Requests go out grouped by owner; a stable sort keeps (pair, block) order inside each owner.
        owner = wanted_block // local_blocks
        by_owner = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        # One host read for the exchange sizes and the most blocks any (batch, head) fetches (0 if none).
        sizes = torch.cat((send_counts, recv_counts, per_pair.max().view(1))).tolist()
        send_list, recv_list, slots = sizes[:world], sizes[world:2 * world], sizes[-1]
        refused = [peer for peer, count in enumerate(recv_list) if count == REFUSED]
        if refused:
            raise ValueError(f"scp_attention: rank(s) {refused} of the group refused their input (their own error "
                             "names it); this rank stops before the exchange")
        # Owner-local block row: pair * blocks_per_rank + block within the owner's chunk.
        requests = (wanted_pair * local_blocks + wanted_block % local_blocks)[by_owner]
        served = requests.new_empty(sum(recv_list))
        dist.all_to_all_single(served, requests, recv_list, send_list, group=group)

    # [B, H, S_local, D] -> [B*H*blocks_per_rank, kv_block, D], one row per owned (pair, block); only the
    # served rows are gathered into the [served, 2, kv_block, D] message.
    k_rows, v_rows = (t.reshape(pairs * local_blocks, kv_block, dim) for t in (k, v))
    message = torch.stack((k_rows.index_select(0, served), v_rows.index_select(0, served)), dim=1)
    fetched = all_to_all(message, send_list, recv_list, group)
    placed = fetched.new_zeros(pairs, slots, 2, kv_block, dim).index_put(
        (wanted_pair[by_owner], slot[by_owner]), fetched
    )
    placed = placed.view(batch, heads, slots, 2, kv_block, dim)
    k_ext = torch.cat((k, placed[:, :, :, 0].reshape(batch, heads, slots * kv_block, dim)), dim=2)
    v_ext = torch.cat((v, placed[:, :, :, 1].reshape(batch, heads, slots * kv_block, dim)), dim=2)
    ext_len = local_len + slots * kv_block
    q_ext = F.pad(q, (0, 0, 0, ext_len - local_len))

    with torch.no_grad():
        ext_index = _remap_index(index, ids, valid, remote, keys, wanted, slot, rank, local_blocks, ext_len)
    out = sparse_attention(q_ext, k_ext, v_ext, ext_index, scale, backend, check_index=False)[:, :, :local_len]

    element = q.element_size()
    block_bytes = 2 * kv_block * dim * element
    stats = ScpCommStats(
        fetched_blocks=sum(send_list),
        served_blocks=sum(recv_list),
        kv_bytes_received=sum(send_list) * block_bytes,
        kv_bytes_sent=sum(recv_list) * block_bytes,
        request_bytes_sent=(world + requests.numel()) * requests.element_size(),
        full_kv_bytes=2 * pairs * (world - 1) * local_len * dim * element,
    )
    return out, stats


def _remap_index(index, ids, valid, remote, keys, wanted, slot, rank, local_blocks, ext_len) -> SparseIndex:
    """The local rows with block ids of the extended layout, plus one-block rows for the padding groups.

    Local block ``j`` becomes ``j - rank * blocks_per_rank``; a fetched block becomes
    ``blocks_per_rank + its slot``. Rows are re-sorted, since the remap does not keep the order.
    """
    group_size, kv_block = index.group_size, index.kv_block
    ext_blocks = math.ceil(ext_len / kv_block)
    remapped = ids - rank * local_blocks
    # ``wanted`` is sorted and holds every remote key, so searchsorted finds each one's slot.
    remapped[remote] = local_blocks + slot[torch.searchsorted(wanted, keys[remote])]
    # Sentinel ext_blocks sorts after every real id, leaving the padding at the end of each row.
    remapped = torch.sort(torch.where(valid, remapped, ext_blocks), dim=-1).values
    remapped = remapped.masked_fill(remapped == ext_blocks, PAD).to(torch.int32)
    batch, heads, groups, k_max = remapped.shape
    pad_groups = math.ceil(ext_len / group_size) - groups
    pad_rows = torch.full((batch, heads, pad_groups, k_max), PAD, dtype=torch.int32, device=ids.device)
    # One block each, spread over the blocks: all on block 0 would make that block's key-major backward
    # program walk every padding group alone (a straggler), for outputs that are dropped anyway.
    pad_rows[..., 0] = torch.arange(pad_groups, dtype=torch.int32, device=ids.device) % ext_blocks
    pad_counts = torch.ones((batch, heads, pad_groups), dtype=torch.int32, device=ids.device)
    return SparseIndex(
        torch.cat((remapped, pad_rows), dim=2),
        torch.cat((index.counts, pad_counts), dim=2),
        group_size,
        kv_block,
        ext_len,
    )


def fetched_fraction(index: SparseIndex, world: int) -> list[float]:
    """Per head, the fraction of remote key blocks SCP over ``world`` ranks fetches for ``index`` (the
    whole-sequence index): the union over each rank's query groups of their remote blocks, averaged over
    ranks and batch. The planner's SCP volume (``dsv.parallel.planner.head_costs``)."""
    local_len = check_sequence_split(index.seq_len, world, index.group_size, index.kv_block)
    groups, local_blocks = local_len // index.group_size, local_len // index.kv_block
    batch, heads = index.indices.shape[:2]
    valid = index.valid_mask()
    wanted = torch.zeros(batch, heads, world, world * local_blocks, dtype=torch.bool, device=index.indices.device)
    owner_of_row = (torch.arange(index.indices.shape[2], device=index.indices.device) // groups).view(1, 1, -1, 1)
    rows = owner_of_row.expand_as(index.indices)
    b, h = (torch.arange(n, device=index.indices.device) for n in (batch, heads))
    b, h = b.view(-1, 1, 1, 1).expand_as(index.indices), h.view(1, -1, 1, 1).expand_as(index.indices)
    wanted[b[valid], h[valid], rows[valid], index.indices[valid].long()] = True
    owner_of_block = torch.arange(world * local_blocks, device=wanted.device) // local_blocks
    remote = owner_of_block.view(1, -1) != torch.arange(world, device=wanted.device).view(-1, 1)  # [rank, block]
    fraction = (wanted & remote).sum(-1).double() / ((world - 1) * local_blocks)
    return fraction.mean(dim=(0, 2)).tolist()
