"""Sequence-wise CP with critical-KV exchange on gloo: shards equal the single-process sparse attention."""

import math

import pytest
import torch
import torch.distributed as dist

from dsv.ops.index import SparseIndex
from dsv.ops.sparse_attention import sparse_attention_reference
from dsv.parallel.hcp import hcp_attention, sparse_attention_fn
from dsv.parallel.scp import LocalIndex, check_sequence_split, scp_attention
from tests.parallel import run_distributed

TOLERANCES = {
    # Both sides float64; the fetched keys sit in another order in the row, so only the summation
    # order of the softmax sums differs (<= 64 terms).
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
    # float32 accumulation on both sides in different key orders: ~100 float32 eps over <= 64 terms.
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
}
DIM, BATCH = 8, 2


def random_index(heads, seq_len, group_size, kv_block, keep, shared=0.0):
    """Top-k index; ``shared`` > 0 adds a per-head block preference common to all groups of the head."""
    num_groups, num_blocks = math.ceil(seq_len / group_size), math.ceil(seq_len / kv_block)
    scores = torch.randn(BATCH, heads, num_groups, num_blocks) + shared * torch.randn(BATCH, heads, 1, num_blocks)
    return SparseIndex.from_topk(scores, torch.as_tensor(keep), group_size, kv_block, seq_len)


def local_window_index(heads, seq_len, group_size, kv_block, world):
    """Each group keeps only key blocks of its own rank: nothing needs fetching."""
    local_len = seq_len // world
    num_groups = seq_len // group_size
    blocks_per_rank = local_len // kv_block
    owner = torch.arange(num_groups) * group_size // local_len
    indices = (owner[:, None] * blocks_per_rank + torch.arange(blocks_per_rank)).to(torch.int32)
    indices = indices.expand(BATCH, heads, -1, -1).contiguous()
    counts = torch.full((BATCH, heads, num_groups), blocks_per_rank, dtype=torch.int32)
    return SparseIndex(indices, counts, group_size, kv_block, seq_len)


def make_case(index, dtype):
    batch, heads, seq_len = index.indices.shape[0], index.indices.shape[1], index.seq_len
    tensors = [torch.randn(batch, heads, seq_len, DIM, dtype=torch.float64).to(dtype) for _ in range(4)]
    return dict(zip(("q", "k", "v", "grad_out"), tensors), index=index)


def shard(x, rank, world):
    return x.chunk(world, dim=2)[rank]


def expected_fetches(index, rank, world):
    """Distinct (batch, head, block) triples of rank's rows owned elsewhere, counted the slow way."""
    local = LocalIndex.from_global(index, rank, world)
    blocks_per_rank = index.seq_len // world // index.kv_block
    wanted = set()
    for b in range(local.indices.shape[0]):
        for h in range(local.indices.shape[1]):
            for g in range(local.indices.shape[2]):
                for j in local.indices[b, h, g, : local.counts[b, h, g]].tolist():
                    if j // blocks_per_rank != rank:
                        wanted.add((b, h, j))
    return len(wanted)


def scp_worker(rank, world, cases):
    results = []
    for case in cases:
        q, k, v = (shard(case[name], rank, world).clone().requires_grad_() for name in ("q", "k", "v"))
        out, stats = scp_attention(q, k, v, LocalIndex.from_global(case["index"], rank, world))
        grads = torch.autograd.grad(out, (q, k, v), shard(case["grad_out"], rank, world))
        results.append(((out.detach(), *grads), stats))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_scp_matches_single_process(tmp_path, world):
    seq_len = 16 * world
    heads = 3
    cases = [
        make_case(random_index(heads, seq_len, 4, 4, [1, 2, seq_len // 8]), torch.float64),
        # Key blocks smaller and larger than query groups.
        make_case(random_index(heads, seq_len, 4, 2, [3, 1, 5]), torch.float64),
        make_case(random_index(heads, seq_len, 2, 8, [1, 2, 2]), torch.float64),
        make_case(random_index(heads, seq_len, 4, 4, [2, 3, 4]), torch.float32),
        # Nothing remote: the exchanges carry zero rows.
        make_case(local_window_index(heads, seq_len, 4, 4, world), torch.float64),
    ]
    per_rank = run_distributed(scp_worker, world, cases, out_dir=tmp_path)
    for case_id, case in enumerate(cases):
        q, k, v = (case[name].clone().requires_grad_() for name in ("q", "k", "v"))
        out = sparse_attention_reference(q, k, v, case["index"])
        expected = (out.detach(), *torch.autograd.grad(out, (q, k, v), case["grad_out"]))
        tol = TOLERANCES[case["q"].dtype]
        for rank, results in enumerate(per_rank):
            got, stats = results[case_id]
            for name, g, want in zip(("out", "dq", "dk", "dv"), got, expected):
                torch.testing.assert_close(g, shard(want, rank, world), **tol, msg=lambda m, name=name: f"{name}: {m}")
            assert stats.fetched_blocks == expected_fetches(case["index"], rank, world)
        # Every block one rank fetched, another rank served.
        assert sum(r[case_id][1].fetched_blocks for r in per_rank) == sum(r[case_id][1].served_blocks for r in per_rank)
    assert all(r[-1][1].kv_bytes_received == 0 for r in per_rank)


def test_scp_bytes_moved_shrink_as_sparsity_rises(tmp_path):
    world, heads, seq_len, kv_block = 4, 2, 128, 4
    num_blocks = seq_len // kv_block
    sparsities = [0.5, 0.75, 0.875, 0.9375]
    # Neighbouring groups share most critical keys (as the DSV paper measured), so the per-head preference dominates.
    cases = [
        make_case(random_index(heads, seq_len, 4, kv_block, [round((1 - s) * num_blocks)] * heads, shared=3.0),
                  torch.float32)
        for s in sparsities
    ]
    per_rank = run_distributed(scp_worker, world, cases, out_dir=tmp_path)
    received = [sum(r[i][1].kv_bytes_received for r in per_rank) for i in range(len(cases))]
    full = sum(r[0][1].full_kv_bytes for r in per_rank)
    assert full == 2 * BATCH * heads * seq_len * (world - 1) * DIM * 4  # every rank: all remote K and V rows
    assert all(a > b for a, b in zip(received, received[1:])), received
    # At 93.75% sparsity the fetch is a small fraction of moving every remote K/V row.
    assert received[-1] < 0.25 * full, (received, full)


def errors_worker(rank, world):
    messages = {}
    q = torch.randn(BATCH, 2, 8, 4)
    local = LocalIndex.from_global(random_index(2, 16, 4, 4, [1, 2]), rank, world)
    descending = local.indices.clone()
    descending[:, 1] = descending[:, 1].flip(-1)  # head 1 keeps 2 blocks: its rows become descending
    bad = [
        ("seq_len", LocalIndex(local.indices, local.counts, 4, 4, 24)),
        ("shape", LocalIndex(local.indices[:, :1], local.counts[:, :1], 4, 4, 16)),
        ("ascending", LocalIndex(descending, local.counts, 4, 4, 16)),
    ]
    for name, candidate in bad:
        try:
            scp_attention(q, q, q, candidate)
        except ValueError as err:
            messages[name] = str(err)
    # Invalid on rank 1 only: its peers raised a transport error of no evident cause, or waited.
    out_of_range = local.indices.clone()
    out_of_range[0, 0, 0, 0] = 7  # 4 key blocks in all
    try:
        scp_attention(q, q, q, local if rank != 1 else LocalIndex(out_of_range, local.counts, 4, 4, 16))
    except ValueError as err:
        messages["one_rank"] = str(err)
    dist.barrier()
    return messages


def test_scp_bad_configurations_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        check_sequence_split(16, 3, 4, 4)
    with pytest.raises(ValueError, match="whole number of query groups"):
        LocalIndex.from_global(random_index(1, 24, 8, 4, [1]), 0, 2)
    with pytest.raises(ValueError, match="whole number of key blocks"):
        check_sequence_split(24, 2, 4, 8)
    rank0, rank1 = run_distributed(errors_worker, 2, out_dir=tmp_path)
    for messages in (rank0, rank1):
        assert "must equal N * S_local = 2 * 8" in messages["seq_len"]
        assert "[B, H, NG_local, K_max] = [2, 2, 2, K]" in messages["shape"]
        assert "strictly ascending" in messages["ascending"]
    assert "rank(s) [1] of the group refused their input" in rank0["one_rank"]
    assert "valid entries must lie in [0, NKB=4)" in rank1["one_rank"]


def subgroups_worker(rank, world, hcp_cases, scp_cases):
    """HCP inside pairs {0,1},{2,3} and SCP across pairs {0,2},{1,3}, each pair on its own input."""
    # gloo needs every rank to create every group, in the same order.
    pairs = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
    hcp_ranks = (0, 1) if rank < 2 else (2, 3)
    scp_ranks = (0, 2) if rank % 2 == 0 else (1, 3)
    results = {}
    for kind, ranks, case in (("hcp", hcp_ranks, hcp_cases[rank // 2]), ("scp", scp_ranks, scp_cases[rank % 2])):
        group, local_rank = pairs[ranks], ranks.index(rank)
        q, k, v = (shard(case[name], local_rank, 2).clone().requires_grad_() for name in ("q", "k", "v"))
        if kind == "hcp":
            out = hcp_attention(q, k, v, [[0, 2], [1]], sparse_attention_fn(case["index"]), group=group)
        else:
            out, _ = scp_attention(q, k, v, LocalIndex.from_global(case["index"], local_rank, 2), group=group)
        grads = torch.autograd.grad(out, (q, k, v), shard(case["grad_out"], local_rank, 2))
        results[kind] = (out.detach(), *grads)
    return results


def test_hcp_and_scp_run_on_subgroups(tmp_path):
    hcp_cases = [make_case(random_index(3, 32, 4, 4, [2, 3, 5]), torch.float64) for _ in range(2)]
    scp_cases = [make_case(random_index(3, 32, 4, 4, [1, 4, 2]), torch.float64) for _ in range(2)]
    per_rank = run_distributed(subgroups_worker, 4, hcp_cases, scp_cases, out_dir=tmp_path)
    for rank, results in enumerate(per_rank):
        checks = (("hcp", hcp_cases[rank // 2], rank % 2), ("scp", scp_cases[rank % 2], rank // 2))
        for kind, case, local_rank in checks:
            q, k, v = (case[name].clone().requires_grad_() for name in ("q", "k", "v"))
            out = sparse_attention_reference(q, k, v, case["index"])
            expected = (out.detach(), *torch.autograd.grad(out, (q, k, v), case["grad_out"]))
            for name, got, want in zip(("out", "dq", "dk", "dv"), results[kind], expected):
                torch.testing.assert_close(got, shard(want, local_rank, 2), **TOLERANCES[torch.float64],
                                           msg=lambda m, kind=kind, name=name: f"{kind} {name}: {m}")


def test_fetched_fraction_counts_each_ranks_distinct_remote_blocks():
    from dsv.ops import estimate_index
    from dsv.parallel.scp import fetched_fraction

    q, k = torch.randn(2, 3, 256, 8), torch.randn(2, 3, 256, 8)
    index = estimate_index(q, k, torch.tensor([8, 3, 1]), 16, 16)
    world, blocks_per_rank, groups_per_rank = 4, 4, 4
    expected = torch.zeros(3, dtype=torch.float64)
    for b in range(2):
        for h in range(3):
            for rank in range(world):
                rows = index.indices[b, h, rank * groups_per_rank:(rank + 1) * groups_per_rank]
                ids = {int(x) for x in rows.flatten() if x >= 0 and int(x) // blocks_per_rank != rank}
                expected[h] += len(ids) / ((world - 1) * blocks_per_rank) / (2 * world)
    torch.testing.assert_close(torch.tensor(fetched_fraction(index, world), dtype=torch.float64), expected)
