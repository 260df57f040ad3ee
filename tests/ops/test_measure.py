import itertools
import math

import numpy as np
import pytest
import torch

from dsv.ops.grouping import cube_permutation
from dsv.ops.index import PAD, SparseIndex
from dsv.ops.measure import (
    critical_counts,
    head_sparsity,
    index_recall,
    keep_blocks_from_sparsity,
    oracle_index,
    recall_at_equal_keep,
    sample_key_positions,
    sample_query_rows,
    window_extents,
    window_index,
)


def softmax_row(q, k, b, h, i):
    return torch.softmax(q[b, h, i].double() @ k[b, h].double().T * q.shape[-1] ** -0.5, -1)


def peaky_inputs(B, H, S, D):
    """fp64 q, k whose softmax rows range from flat to peaked, so critical counts vary."""
    q = torch.randn(B, H, S, D, dtype=torch.float64) * torch.linspace(0.5, 4.0, H).view(1, H, 1, 1)
    return q, torch.randn(B, H, S, D, dtype=torch.float64)


def test_sample_query_rows():
    assert sample_query_rows(10, 3).tolist() == [0, 3, 6, 9]
    assert sample_query_rows(10, 3, offset=4).tolist() == [1, 4, 7]
    assert sample_query_rows(10, 3, offset=-1).tolist() == [2, 5, 8]
    with pytest.raises(ValueError, match=r"stride must be a positive int"):
        sample_query_rows(10, 0)
    with pytest.raises(ValueError, match=r"offset=3 .* leaves no row of seq_len=2"):
        sample_query_rows(2, 5, offset=3)


def test_sample_key_positions():
    assert sample_key_positions(100, 0, seed=1) is None  # 0: every key, no copy
    assert sample_key_positions(100, 100, seed=1) is None
    keys = sample_key_positions(1000, 200, seed=7)
    assert keys.dtype == torch.int64 and keys.shape == (200,)
    assert keys.unique().numel() == 200 and 0 <= int(keys.min()) and int(keys.max()) < 1000
    assert torch.equal(keys, sample_key_positions(1000, 200, seed=7))  # the seed alone decides
    assert not torch.equal(keys, sample_key_positions(1000, 200, seed=8))
    # Uniform over the sequence: both halves get about half the draws (binomial std ~7 of 100).
    assert 60 <= int((keys < 500).sum()) <= 140
    with pytest.raises(ValueError, match=r"count must be >= 0"):
        sample_key_positions(10, -1, seed=0)


@pytest.mark.parametrize("theta", [0.5, 0.9])
def test_critical_counts_match_brute_force_sort(theta):
    B, H, S = 2, 3, 24
    q, k = peaky_inputs(B, H, S, 8)
    rows = sample_query_rows(S, 5, offset=2)
    counts = critical_counts(q, k, rows, theta=theta)
    assert counts.shape == (B, H, rows.numel()) and counts.dtype == torch.int64
    for b, h, r in itertools.product(range(B), range(H), range(rows.numel())):
        weights = sorted(softmax_row(q, k, b, h, int(rows[r])).tolist(), reverse=True)
        covered, needed = 0.0, 0
        while covered < theta:
            covered += weights[needed]
            needed += 1
        assert int(counts[b, h, r]) == needed, (b, h, r)
    assert len(set(counts.flatten().tolist())) > 1  # the data exercise more than one count


def test_critical_counts_of_flat_and_peaked_rows():
    S = 16
    flat = torch.zeros(1, 1, S, 4)  # q = 0: every key weighs exactly 1/16
    assert (critical_counts(flat, torch.randn(1, 1, S, 4), torch.arange(S), theta=0.5) == 8).all()
    # One key aligned with a large query takes almost all of the mass.
    k = torch.zeros(1, 1, S, 4)
    k[0, 0, 5] = 1.0
    q = torch.full((1, 1, S, 4), 50.0)
    assert (critical_counts(q, k, torch.arange(S), theta=0.9) == 1).all()
    assert (critical_counts(q, k, torch.arange(S), theta=1 - 1e-9) <= S).all()
    # All the mass: decided by where the rounded sum reaches 1 (on peaked rows float32 and float64 disagreed
    # thirtyfold), so refused, as the config refuses it.
    with pytest.raises(ValueError, match=r"theta must lie in \(0, 1\), got 1.0"):
        critical_counts(q, k, torch.arange(S), theta=1.0)


def test_head_sparsity_is_mean_uncritical_fraction():
    B, H, S = 2, 3, 20
    q, k = peaky_inputs(B, H, S, 8)
    rows = sample_query_rows(S, 3)
    counts = critical_counts(q, k, rows)
    sparsity = head_sparsity(q, k, rows)
    assert sparsity.shape == (H,) and sparsity.dtype == torch.float32
    torch.testing.assert_close(sparsity, (1 - counts.double() / S).mean((0, 2)).float())
    flat = torch.zeros(1, 2, 16, 4)
    assert head_sparsity(flat, torch.randn(1, 2, 16, 4), torch.arange(16), theta=0.5).tolist() == [0.5, 0.5]


def random_index(B, H, S, group_size, kv_block, keep):
    scores = torch.randn(B, H, math.ceil(S / group_size), math.ceil(S / kv_block))
    return SparseIndex.from_topk(scores, torch.tensor(keep), group_size, kv_block, S)


def test_statistics_ignore_the_callers_autocast():
    """Sparsity, recall and the oracle are computed in float32 under a bf16 autocast too (under it the scores,
    and on the CPU the softmax and cumulative sums, would be bf16: sparsity biased upwards)."""
    torch.manual_seed(0)
    q, k = (x.float() for x in peaky_inputs(1, 3, 256, 16))
    rows = sample_query_rows(256, 4)
    index = oracle_index(q, k, torch.tensor([3, 5, 8]), 16, 16)

    def stats():
        return (head_sparsity(q, k, rows), index_recall(q, k, index, rows),
                oracle_index(q, k, torch.tensor([3, 5, 8]), 16, 16).indices)

    plain = stats()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for a, b in zip(plain, stats()):
            assert torch.equal(a, b)


def test_index_recall_matches_brute_force():
    B, H, S, G, kv = 2, 2, 27, 4, 3
    q, k = peaky_inputs(B, H, S, 8)
    index = random_index(B, H, S, G, kv, [2, 5])
    rows = sample_query_rows(S, 4, offset=1)
    recall = index_recall(q, k, index, rows)
    assert recall.shape == (B, H) and recall.dtype == torch.float32
    for b, h in itertools.product(range(B), range(H)):
        masses = []
        for i in rows.tolist():
            g = i // G
            blocks = set(index.indices[b, h, g, : index.counts[b, h, g]].tolist())
            probs = softmax_row(q, k, b, h, i)
            masses.append(sum(float(probs[t]) for t in range(S) if t // kv in blocks))
        # fp64 inside, float32 result: compare at float32 resolution.
        assert abs(float(recall[b, h]) - sum(masses) / len(masses)) < 1e-6, (b, h)


def test_index_recall_of_full_index_is_one():
    q, k = peaky_inputs(1, 2, 20, 8)
    full = random_index(1, 2, 20, 4, 4, [5, 5])
    torch.testing.assert_close(index_recall(q, k, full, torch.arange(20)), torch.ones(1, 2))


def test_index_recall_refuses_an_invalid_index():
    """A duplicate id was counted once here and twice by kept_fraction; an id of NKB fell into the padding."""
    q, k = peaky_inputs(1, 1, 16, 8)
    for row in ([3, 3], [2, 4]):  # 4 key blocks: id 4 is NKB
        indices = torch.tensor([[[[0, 1], [1, 2], [2, 3], row]]], dtype=torch.int32)
        index = SparseIndex(indices, torch.full((1, 1, 4), 2, dtype=torch.int32), 4, 4, 16)
        with pytest.raises(ValueError, match="SparseIndex.indices valid entries"):
            index_recall(q, k, index, torch.arange(16))


def brute_force_oracle(q, k, keep, group_size, kv_block):
    B, H, S, _ = q.shape
    num_kv_blocks = math.ceil(S / kv_block)
    rows = {}
    for b, h in itertools.product(range(B), range(H)):
        for g in range(math.ceil(S / group_size)):
            mass = [0.0] * num_kv_blocks
            for i in range(g * group_size, min((g + 1) * group_size, S)):
                for t, p in enumerate(softmax_row(q, k, b, h, i).tolist()):
                    mass[t // kv_block] += p
            ranked = sorted(range(num_kv_blocks), key=lambda j: (-mass[j], j))
            rows[b, h, g] = sorted(ranked[: min(keep[h], num_kv_blocks)])
    return rows


@pytest.mark.parametrize(
    "S, group_size, kv_block, chunk_groups", [(24, 4, 4, None), (23, 4, 3, 2), (18, 3, 1, 1)]
)
def test_oracle_index_matches_brute_force(S, group_size, kv_block, chunk_groups):
    q, k = peaky_inputs(2, 2, S, 8)
    keep = [2, 4]
    index = oracle_index(q, k, torch.tensor(keep), group_size, kv_block, chunk_groups=chunk_groups)
    index.validate()
    for (b, h, g), expected in brute_force_oracle(q, k, keep, group_size, kv_block).items():
        assert index.indices[b, h, g].tolist() == expected + [PAD] * (index.max_blocks - len(expected))


def test_oracle_recall_beats_random_index():
    B, H, S, G, kv = 2, 3, 45, 4, 3
    q, k = peaky_inputs(B, H, S, 8)
    keep = [1, 3, 6]
    rows = torch.arange(S)  # all rows: the oracle maximises exactly this recall for its counts
    oracle_recall = index_recall(q, k, oracle_index(q, k, torch.tensor(keep), G, kv), rows)
    for _ in range(5):
        random_recall = index_recall(q, k, random_index(B, H, S, G, kv, keep), rows)
        # float32 results of sums of fp64 masses: allow float32 rounding.
        assert (oracle_recall >= random_recall - 1e-6).all()
    assert (oracle_recall > 0).all() and (oracle_recall <= 1 + 1e-6).all()


def brute_force_window_tokens(grid, cube, cube_coord, extents, steps):
    """Per dimension, the in-grid aligned window containing the cube whose centre is nearest the cube's
    centre (ties: the larger start); returns the set of raster token ids inside all three ranges."""
    ranges = []
    for size, extent, window, step, c in zip(grid, cube, extents, steps, cube_coord):
        origin = c * extent
        candidates = [
            s for s in range(0, size - window + 1, step) if s <= origin and s + window >= origin + extent
        ]
        best = min(candidates, key=lambda s: (abs((s + window / 2) - (origin + extent / 2)), -s))
        ranges.append(range(best, best + window))
    T, H, W = grid
    return {(t * H + h) * W + w for t in range(T) for h in range(H) for w in range(W)
            if t in ranges[0] and h in ranges[1] and w in ranges[2]}


@pytest.mark.parametrize(
    "grid, cube, window_frac",
    [((4, 6, 6), (2, 2, 2), 2 / 3), ((3, 4, 6), (1, 2, 3), 0.5), ((4, 8, 4), (2, 2, 2), 0.3)],
)
@pytest.mark.parametrize("whole_cubes", [False, True])
def test_window_index_matches_brute_force(grid, cube, window_frac, whole_cubes):
    group_size = math.prod(cube)
    kv_block = group_size if whole_cubes else 1
    index = window_index(grid, cube, kv_block, batch=2, heads=3, window_frac=window_frac)
    index.validate()
    extents = window_extents(grid, cube, kv_block, window_frac)
    for size, extent, window in zip(grid, cube, extents):
        wanted = max(extent, math.floor(window_frac * size + 0.5))
        if whole_cubes:
            wanted = math.ceil(wanted / extent) * extent
        assert window == min(size, wanted)
    steps = cube if whole_cubes else (1, 1, 1)
    perm, _ = cube_permutation(grid, cube)
    n_cubes = [size // extent for size, extent in zip(grid, cube)]
    assert (index.counts == math.prod(extents) // kv_block).all()
    assert (index.indices == index.indices[0, 0]).all()  # same rows for every batch entry and head
    for g, cube_coord in enumerate(itertools.product(*(range(n) for n in n_cubes))):
        expected_tokens = brute_force_window_tokens(grid, cube, cube_coord, extents, steps)
        # The window always holds the query cube itself.
        assert set(perm[g * group_size : (g + 1) * group_size].tolist()) <= expected_tokens
        kept_blocks = index.indices[0, 0, g].long()
        kept_positions = (kept_blocks[:, None] * kv_block + torch.arange(kv_block)).flatten()
        kept_tokens = set(perm[kept_positions].tolist())
        assert kept_tokens == expected_tokens, g


def test_full_window_keeps_every_block():
    index = window_index((2, 4, 4), (1, 2, 2), kv_block=4, batch=1, heads=1, window_frac=1.0)
    assert (index.indices[0, 0] == torch.arange(8, dtype=torch.int32)).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_block": 2}, r"kv_block must be 1 or the cube volume 8"),
        ({"grid": (5, 4, 4)}, r"grid T=5 is not divisible by cube t=2"),
        ({"window_frac": 0.0}, r"window_frac must lie in \(0, 1\]"),
        ({"heads": 0}, r"heads must be a positive int"),
        ({"kv_block": np.int64(8)}, r"kv_block must be a positive int, got np.int64\(8\)"),  # built, then refused
    ],
)
def test_window_index_rejects_bad_arguments(kwargs, match):
    arguments = {"grid": (4, 4, 4), "cube": (2, 2, 2), "kv_block": 8, "batch": 1, "heads": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        window_index(**arguments)


def test_keep_blocks_from_sparsity():
    sparsity = torch.tensor([0.9, 0.0, 0.99, 0.5, 0.75], dtype=torch.float64)
    keep = keep_blocks_from_sparsity(sparsity, num_kv_blocks=10, floor_blocks=2)
    assert keep.dtype == torch.int32 and keep.tolist() == [2, 10, 2, 5, 3]
    # float32 0.9 is 0.8999999762: one block at 10 blocks, not two.
    assert keep_blocks_from_sparsity(torch.tensor([0.9]), 10, floor_blocks=1).tolist() == [1]
    # The float32 error grows with the blocks: exact whole budgets stay whole at long sequences too.
    for blocks in (4096, 16250, 65536):
        sparsity32 = torch.tensor([0.9, 0.95, 0.99])
        exact = [math.ceil(round((1 - s) * blocks, 6)) for s in (0.9, 0.95, 0.99)]
        assert keep_blocks_from_sparsity(sparsity32, blocks, floor_blocks=1).tolist() == exact, blocks
    assert keep_blocks_from_sparsity(torch.tensor([0.9]), 10, floor_blocks=1, margin=0.05).tolist() == [2]
    assert keep_blocks_from_sparsity(torch.tensor([0.0]), 10, floor_blocks=1, margin=0.5).tolist() == [10]
    assert keep_blocks_from_sparsity(torch.tensor([0.99]), 4, floor_blocks=9).tolist() == [4]
    per_head = keep_blocks_from_sparsity(torch.tensor([0.9, 0.9]), 10, floor_blocks=1, margin=torch.tensor([0.0, 0.3]))
    assert per_head.tolist() == [1, 4]
    with pytest.raises(ValueError, match=r"margin must be a float or a tensor of sparsity's shape \(2,\)"):
        keep_blocks_from_sparsity(torch.tensor([0.9, 0.9]), 10, floor_blocks=1, margin=torch.zeros(3))
    with pytest.raises(ValueError, match=r"floor_blocks must be a positive int"):
        keep_blocks_from_sparsity(sparsity, 10, floor_blocks=0)
    with pytest.raises(ValueError, match=r"sparsity must be a 1-D floating tensor"):
        keep_blocks_from_sparsity(torch.tensor([[0.5]]), 10, floor_blocks=1)
    # A head never measured (NaN, as the layers' buffers start) keeps every block; it cast to -2**31 before.
    assert keep_blocks_from_sparsity(torch.tensor([float("nan"), 0.5]), 10, floor_blocks=1).tolist() == [10, 5]


def test_head_sparsity_is_nan_for_heads_with_non_finite_q_or_k():
    """A NaN row's weights compare False with theta, so it counted one critical key: the sparsest head there
    is. Now such a head reads NaN (and a DSV layer's profiling step raises on it); the others are unchanged."""
    q, k = peaky_inputs(2, 3, 20, 4)
    rows = torch.arange(0, 20, 2)
    clean = head_sparsity(q, k, rows)
    q_bad, k_bad = q.clone(), k.clone()
    q_bad[1, 0, 4, 2] = float("nan")  # a sampled row of head 0
    k_bad[0, 2, 7, 1] = float("inf")  # a key of head 2
    got = head_sparsity(q_bad, k_bad, rows)
    assert torch.isnan(got[0]) and torch.isnan(got[2])
    assert got[1] == clean[1]
    q_unsampled = q.clone()
    q_unsampled[0, 0, 5] = float("nan")  # row 5 is not sampled: its head is measured as before
    assert torch.equal(head_sparsity(q_unsampled, k, rows), clean)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda q, k, ix: critical_counts(q, k, torch.tensor([0, 20])), r"rows must lie in \[0, S=20\)"),
        (lambda q, k, ix: critical_counts(q, k, torch.tensor([0.0])), r"rows must be an integer tensor"),
        (lambda q, k, ix: critical_counts(q, k, torch.arange(3), theta=0.0), r"theta must lie in \(0, 1\)"),
        (lambda q, k, ix: head_sparsity(q[0], k, torch.arange(3)), r"q must be 4-D"),
        (lambda q, k, ix: head_sparsity(q, k, torch.tensor([-1])), r"rows must lie in \[0, S=20\)"),
        (lambda q, k, ix: head_sparsity(q, k, torch.arange(3), theta=1.5), r"theta must lie in \(0, 1\)"),
        # Compared without a type check before: a TypeError, or an ambiguous truth value for a tensor.
        (lambda q, k, ix: head_sparsity(q, k, torch.arange(3), theta="0.9"), r"theta must lie in \(0, 1\), got '0.9'"),
        (lambda q, k, ix: critical_counts(q, k, torch.arange(3), theta=torch.tensor([0.9, 0.5])),
         r"theta must lie in \(0, 1\)"),
        (lambda q, k, ix: window_index((4, 4, 4), (2, 2, 2), 8, 1, 2, "0.5"), r"window_frac must lie in \(0, 1\]"),
        (lambda q, k, ix: index_recall(q, k.float(), ix, torch.arange(3)), r"k has dtype torch.float32"),
        (lambda q, k, ix: index_recall(q[:, :1], k[:, :1], ix, torch.arange(3)),
         r"index.indices has \[B, H, NG\]"),
        (lambda q, k, ix: oracle_index(q, k, torch.tensor([1]), 4, 4),
         r"keep_blocks must have shape \[H\]=\[2\]"),
        (lambda q, k, ix: oracle_index(q, k, torch.tensor([1, 1]), 4, 0), r"kv_block must be a positive int"),
        # A scale <= 0 selected other blocks (0: every score equal) without a word.
        (lambda q, k, ix: oracle_index(q, k, torch.tensor([1, 1]), 4, 4, scale=-1.0), r"scale must be a positive"),
        (lambda q, k, ix: head_sparsity(q, k, torch.arange(3), scale=0.0), r"scale must be a positive"),
        (lambda q, k, ix: index_recall(q, k, ix, torch.arange(3), scale="1"), r"scale must be a positive"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(call, match):
    q, k = peaky_inputs(1, 2, 20, 4)
    index = random_index(1, 2, 20, 4, 4, [1, 2])
    with pytest.raises(ValueError, match=match):
        call(q, k, index)


def test_small_memory_budget_chunks_without_changing_results(monkeypatch):
    q, k = peaky_inputs(2, 2, 30, 8)
    rows = sample_query_rows(30, 2)
    index = random_index(2, 2, 30, 4, 3, [2, 5])

    def measurements():
        oracle = oracle_index(q, k, torch.tensor([2, 5]), group_size=4, kv_block=3)
        return critical_counts(q, k, rows), index_recall(q, k, index, rows), oracle.indices

    counts, recall, oracle_rows = measurements()
    # One byte of budget forces one row (or one group) per chunk.
    monkeypatch.setattr("dsv.ops.index.DEFAULT_CHUNK_BYTES", 1)
    chunked_counts, chunked_recall, chunked_oracle_rows = measurements()
    assert torch.equal(chunked_counts, counts) and torch.equal(chunked_oracle_rows, oracle_rows)
    torch.testing.assert_close(chunked_recall, recall)


def test_recall_at_equal_keep_orders_token_and_block_selection():
    """With every row sampled and equal kept keys, token-level oracle selection captures at least the mass of
    block-level selection (each block set is one of the token sets it chooses from); keeping all is 1."""
    q, k = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    rows = torch.arange(256)
    recall = recall_at_equal_keep(q, k, 0.25, group_size=32, kv_blocks=(1, 16), rows=rows)
    assert bool((recall[1] >= recall[16] - 1e-6).all())
    full = recall_at_equal_keep(q, k, 1.0, group_size=32, kv_blocks=(1, 16), rows=rows)
    for value in full.values():
        assert torch.allclose(value, torch.ones_like(value), atol=1e-5)
