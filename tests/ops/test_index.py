import dataclasses
import math

import pytest
import torch

from dsv.ops.index import PAD, SparseIndex


def brute_force_selection(scores, keep_blocks):
    """Python-level selection rule: highest score first, lower block id first on ties, then ascending."""
    B, H, NG, NKB = scores.shape
    rows = {}
    for b in range(B):
        for h in range(H):
            k = min(int(keep_blocks[h]), NKB)
            for g in range(NG):
                row = scores[b, h, g].tolist()
                ranked = sorted(range(NKB), key=lambda j: (-row[j], j))
                rows[b, h, g] = sorted(ranked[:k])
    return rows


def test_from_topk_matches_brute_force_with_many_ties():
    S, G, kv = 29, 4, 3  # ragged: NG = 8, NKB = 10
    NG, NKB = math.ceil(S / G), math.ceil(S / kv)
    # Integer-valued scores from a small range make boundary ties common.
    scores = torch.randint(0, 4, (2, 4, NG, NKB)).float()
    keep = torch.tensor([1, 3, 7, 50])  # per-head counts; 50 is clipped to NKB
    index = SparseIndex.from_topk(scores, keep, G, kv, S)
    index.validate()
    assert index.indices.shape == (2, 4, NG, NKB)
    assert index.indices.dtype == torch.int32 and index.counts.dtype == torch.int32
    assert index.counts[:, :, 0].tolist() == [[1, 3, 7, NKB]] * 2
    for (b, h, g), expected in brute_force_selection(scores, keep).items():
        row = index.indices[b, h, g].tolist()
        assert row == expected + [PAD] * (NKB - len(expected)), (b, h, g)


def test_tie_keeps_lower_block_id():
    scores = torch.tensor([1.0, 5.0, 5.0, 5.0, 0.0]).view(1, 1, 1, 5)
    index = SparseIndex.from_topk(scores, torch.tensor([2]), group_size=5, kv_block=1, seq_len=5)
    assert index.indices.tolist() == [[[[1, 2]]]]
    equal = SparseIndex.from_topk(torch.zeros(1, 1, 1, 5), torch.tensor([3]), 5, 1, 5)
    assert equal.indices.tolist() == [[[[0, 1, 2]]]]


def test_rows_are_ascending_distinct_and_padded():
    S, G, kv = 64, 8, 4
    scores = torch.randn(3, 2, S // G, S // kv)
    index = SparseIndex.from_topk(scores, torch.tensor([5, 11]), G, kv, S)
    valid = index.valid_mask()
    for row, row_valid in zip(index.indices.view(-1, 11), valid.view(-1, 11)):
        kept = row[row_valid].tolist()
        assert kept == sorted(set(kept))
        assert (row[~row_valid] == PAD).all()
    assert index.num_groups == 8 and index.num_kv_blocks == 16 and index.max_blocks == 11


def test_kept_fraction_counts_tokens_of_partial_last_block():
    # S = 10, kv_block = 4: blocks hold 4, 4 and 2 tokens.
    indices = torch.tensor([[[[0, 2], [1, PAD]], [[0, 1], [2, PAD]]]], dtype=torch.int32)
    counts = torch.tensor([[[2, 1], [2, 1]]], dtype=torch.int32)
    index = SparseIndex(indices, counts, group_size=5, kv_block=4, seq_len=10)
    index.validate()
    expected = torch.tensor([[((4 + 2) / 10 + 4 / 10) / 2, ((4 + 4) / 10 + 2 / 10) / 2]])
    torch.testing.assert_close(index.kept_fraction(), expected)


def ragged_index(batch, heads, seq_len, group_size, kv_block, max_keep, seed=0):
    """Random index whose every row keeps its own number of blocks, PAD after them."""
    generator = torch.Generator().manual_seed(seed)
    num_groups, num_kv_blocks = math.ceil(seq_len / group_size), math.ceil(seq_len / kv_block)
    indices = torch.full((batch, heads, num_groups, max_keep), PAD, dtype=torch.int32)
    counts = torch.randint(1, max_keep + 1, (batch, heads, num_groups), dtype=torch.int32, generator=generator)
    for row, count in zip(indices.view(-1, max_keep), counts.flatten().tolist()):
        row[:count] = torch.randperm(num_kv_blocks, generator=generator)[:count].sort().values
    return SparseIndex(indices, counts, group_size, kv_block, seq_len)


def test_key_major_lists_the_selecting_groups_of_each_key_block_in_order():
    index = ragged_index(2, 3, 100, 16, 8, max_keep=5)  # ragged S: NG = 7, NKB = 13
    index.validate()
    offsets, groups = index.key_major()
    nkb, ng = index.num_kv_blocks, index.num_groups
    assert offsets.dtype == groups.dtype == torch.int32
    assert offsets.shape == (2 * 3 * nkb + 1,) and groups.shape == (index.indices.numel(),)
    assert offsets[0] == 0 and offsets[-1] == index.counts.sum()  # PAD entries land past offsets[-1]
    rows = index.indices.view(2 * 3, ng, -1).tolist()
    for bh in range(2 * 3):
        for j in range(nkb):
            segment = bh * nkb + j
            want = [g for g in range(ng) if j in rows[bh][g]]
            assert groups[offsets[segment]:offsets[segment + 1]].tolist() == want, (bh, j)


def test_key_major_is_built_once_per_index():
    index = ragged_index(1, 2, 64, 16, 16, max_keep=3)
    offsets, groups = index.key_major()
    again = index.key_major()
    assert again[0] is offsets and again[1] is groups
    assert "_key_major" not in repr(index)
    # A replaced index may hold other tensors: it starts without the cache and builds its own.
    other = ragged_index(1, 2, 64, 16, 16, max_keep=3, seed=1)
    replaced = dataclasses.replace(index, indices=other.indices, counts=other.counts)
    replaced_offsets, _ = replaced.key_major()
    assert replaced_offsets is not offsets and torch.equal(replaced_offsets, other.key_major()[0])
    assert not torch.equal(replaced_offsets, offsets)


def valid_index():
    scores = torch.randn(1, 2, 4, 6)
    return SparseIndex.from_topk(scores, torch.tensor([2, 4]), group_size=3, kv_block=2, seq_len=12)


def with_entry(tensor, position, value):
    tensor = tensor.clone()
    tensor[position] = value
    return tensor


def swap_first_two(indices, row):
    indices = indices.clone()
    indices[row][[0, 1]] = indices[row][[1, 0]]
    return indices


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda ix: {"indices": ix.indices.long()}, r"indices must be an int32 tensor"),
        (lambda ix: {"counts": ix.counts.long()}, r"counts must be an int32 tensor"),
        (lambda ix: {"indices": ix.indices[0]}, r"indices must be \[B, H, NG, K_max\]"),
        (lambda ix: {"indices": ix.indices[:, :, :3], "counts": ix.counts[:, :, :3]},
         r"indices has 3 groups"),
        (lambda ix: {"counts": ix.counts[:, :1]}, r"counts must have shape"),
        (lambda ix: {"counts": with_entry(ix.counts, (0, 0, 1), 0)}, r"counts must lie in \[1, K_max=4\]"),
        (lambda ix: {"counts": with_entry(ix.counts, (0, 1, 1), 5)}, r"counts must lie in"),
        (lambda ix: {"indices": with_entry(ix.indices, (0, 1, 0, 0), 6)}, r"indices valid entries must lie"),
        (lambda ix: {"indices": with_entry(ix.indices, (0, 0, 0, 3), 0)}, r"PAD=-1 after"),
        (lambda ix: {"indices": swap_first_two(ix.indices, (0, 1, 2))}, r"strictly ascending"),
        (lambda ix: {"indices": with_entry(ix.indices, (0, 1, 2, 1), int(ix.indices[0, 1, 2, 0]))},
         r"strictly ascending"),
        (lambda ix: {"seq_len": 0}, r"seq_len must be a positive int"),
        (lambda ix: {"group_size": 2.0}, r"group_size must be a positive int"),
    ],
)
def test_validate_names_the_broken_field(change, match):
    index = valid_index()
    index.validate()
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(index, **change(index)).validate()


@pytest.mark.parametrize(
    "scores, keep, match",
    [
        (torch.randn(1, 2, 4, 5), torch.tensor([1, 2]), r"scores must be \[B, H, NG=4, NKB=6\]"),
        (torch.randn(1, 2, 4, 6), torch.tensor([1, 2, 3]), r"keep_blocks must have shape \[H\]=\[2\]"),
        (torch.randn(1, 2, 4, 6), torch.tensor([1.0, 2.0]), r"keep_blocks must be an integer tensor"),
        (torch.randn(1, 2, 4, 6), torch.tensor([0, 2]), r"keep_blocks must be >= 1"),
        (torch.full((1, 2, 4, 6), float("nan")), torch.tensor([1, 2]), r"scores contain NaN"),
    ],
)
def test_from_topk_rejects_bad_arguments(scores, keep, match):
    with pytest.raises(ValueError, match=match):
        SparseIndex.from_topk(scores, keep, group_size=3, kv_block=2, seq_len=12)


@pytest.mark.parametrize("geometry", [{"group_size": 0}, {"kv_block": -2}, {"seq_len": 12.0}])
def test_from_topk_checks_its_geometry_first(geometry):
    """group_size=0 raised ZeroDivisionError; a float or NumPy geometry built an index validate then refused."""
    arguments = {"group_size": 3, "kv_block": 2, "seq_len": 12} | geometry
    name = next(iter(geometry))
    with pytest.raises(ValueError, match=f"from_topk: {name} must be a positive int"):
        SparseIndex.from_topk(torch.randn(1, 2, 4, 6), torch.tensor([1, 2]), **arguments)
