import math
import warnings

import pytest
import torch

from dsv.ops.estimate.naive import estimate_index
from dsv.ops.index import PAD


def brute_force_estimate(q_lr, k_lr, keep_blocks, group_size, kv_block):
    """Loop-level spec: group-mean proxies, block-mean keys, dense scores, python top-k with low-id ties."""
    B, H, S, _ = q_lr.shape
    group_rows = [range(g, min(g + group_size, S)) for g in range(0, S, group_size)]
    block_rows = [range(j, min(j + kv_block, S)) for j in range(0, S, kv_block)]
    rows = {}
    for b in range(B):
        for h in range(H):
            keys = [k_lr[b, h, list(r)].mean(0) for r in block_rows]
            k = min(int(keep_blocks[h]), len(block_rows))
            for g, r in enumerate(group_rows):
                proxy = q_lr[b, h, list(r)].mean(0)
                scores = [float(proxy @ key) for key in keys]
                ranked = sorted(range(len(keys)), key=lambda j: (-scores[j], j))
                rows[b, h, g] = sorted(ranked[:k])
    return rows


@pytest.mark.parametrize(
    "B, S, group_size, kv_block, chunk_groups",
    [
        (2, 64, 8, 8, None),  # kv_block = group_size, even split
        (1, 45, 8, 4, 1),  # ragged groups and blocks, one group per chunk
        (2, 30, 4, 1, 3),  # token-level blocks, chunk not dividing NG
        (1, 37, 5, 5, 2),  # ragged, kv_block = group_size
    ],
)
def test_matches_brute_force_dense_topk(B, S, group_size, kv_block, chunk_groups):
    H, rank = 3, 4
    # float64 keeps accidental near-ties from flipping between the two summation orders.
    q_lr = torch.randn(B, H, S, rank, dtype=torch.float64)
    k_lr = torch.randn(B, H, S, rank, dtype=torch.float64)
    keep = torch.tensor([1, 3, 100])
    index = estimate_index(q_lr, k_lr, keep, group_size, kv_block, chunk_groups=chunk_groups)
    index.validate()
    num_kv_blocks = math.ceil(S / kv_block)
    assert index.counts[0, :, 0].tolist() == [1, 3, num_kv_blocks]
    for (b, h, g), expected in brute_force_estimate(q_lr, k_lr, keep, group_size, kv_block).items():
        row = index.indices[b, h, g].tolist()
        assert row == expected + [PAD] * (index.max_blocks - len(expected)), (b, h, g)


def test_chunking_does_not_change_the_index():
    q_lr, k_lr = torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 8)
    keep = torch.tensor([4, 9])
    whole = estimate_index(q_lr, k_lr, keep, group_size=4, kv_block=2)
    for chunk in (1, 5, 13):
        chunked = estimate_index(q_lr, k_lr, keep, group_size=4, kv_block=2, chunk_groups=chunk)
        assert torch.equal(chunked.indices, whole.indices)


def test_equal_scores_keep_lowest_block_ids():
    # Identical key rows give every block the same score for every group.
    q_lr = torch.randn(1, 2, 24, 4)
    k_lr = torch.ones(1, 2, 24, 4)
    index = estimate_index(q_lr, k_lr, torch.tensor([2, 5]), group_size=4, kv_block=4)
    assert (index.indices[0, 0, :, :2] == torch.tensor([0, 1], dtype=torch.int32)).all()
    assert (index.indices[0, 1] == torch.arange(5, dtype=torch.int32)).all()


def test_bfloat16_inputs_give_a_valid_index():
    q_lr = torch.randn(1, 2, 40, 16).bfloat16()
    k_lr = torch.randn(1, 2, 40, 16).bfloat16()
    index = estimate_index(q_lr, k_lr, torch.tensor([3, 6]), group_size=8, kv_block=8)
    index.validate()
    assert index.indices.shape == (1, 2, 5, 5)


@pytest.mark.parametrize(
    "q_shape, k_shape, keep, kwargs, match",
    [
        ((2, 16, 4), (2, 16, 4), [1, 1], {}, r"q_lr must be 4-D \[B, H, S, D\]"),
        ((1, 2, 16, 4), (1, 2, 12, 4), [1, 1], {}, r"k_lr has shape .* but q_lr has"),
        ((1, 2, 16, 4), (1, 2, 16, 4), [1, 1, 1], {}, r"keep_blocks must have shape \[H\]=\[2\]"),
        ((1, 2, 16, 4), (1, 2, 16, 4), [1, 1], {"group_size": 0}, r"group_size must be a positive int"),
        ((1, 2, 16, 4), (1, 2, 16, 4), [1, 1], {"chunk_groups": 0}, r"chunk_groups must be a positive int"),
    ],
)
def test_bad_arguments_rejected(q_shape, k_shape, keep, kwargs, match):
    arguments = {"group_size": 4, "kv_block": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        estimate_index(torch.randn(q_shape), torch.randn(k_shape), torch.tensor(keep), **arguments)


def test_the_dispatching_entries_check_what_they_read_first():
    """The backend choice read the input's device and divided by kv_block before any check: a list gave an
    AttributeError, kv_block=0 a ZeroDivisionError on a GPU."""
    from dsv.ops.estimate import estimate_index as dispatching_estimate_index
    from dsv.ops.estimate import estimate_index_from_means

    with pytest.raises(ValueError, match="q_lr must be a torch.Tensor"):
        dispatching_estimate_index([[1.0]], torch.randn(1, 1, 8, 4), torch.tensor([1]), 4, 4)
    with pytest.raises(ValueError, match="proxies must be a torch.Tensor"):
        estimate_index_from_means(None, torch.randn(1, 1, 2, 4), torch.tensor([1]), 4, 4, 8)
    for kv_block, seq_len, match in ((0, 8, "kv_block must be a positive int, got 0"),
                                     (4, None, "seq_len must be a positive int, got None")):
        with pytest.raises(ValueError, match=match):
            estimate_index_from_means(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.tensor([1]), 4,
                                      kv_block, seq_len)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_estimation_says_once_when_the_reference_runs_on_a_gpu(monkeypatch):
    """float64 on a GPU takes the reference (the kernel scores in float32): "auto" said nothing."""
    import importlib

    from dsv.ops.estimate import estimate_index as dispatching_estimate_index

    monkeypatch.setattr(importlib.import_module("dsv.ops.sparse_attention"), "_WARNED_FALLBACKS", set())
    q_lr, k_lr = torch.randn(1, 2, 32, 4, device="cuda", dtype=torch.float64), torch.randn(
        1, 2, 32, 4, device="cuda", dtype=torch.float64)
    with pytest.warns(UserWarning, match="critical-KV estimation: the PyTorch reference runs on cuda:0, not the "
                                         "Triton kernels: float64 inputs"):
        dispatching_estimate_index(q_lr, k_lr, torch.tensor([1, 2]), 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again, or the reference asked for: silent
        dispatching_estimate_index(q_lr, k_lr, torch.tensor([1, 2]), 8, 8)
        dispatching_estimate_index(q_lr, k_lr, torch.tensor([1, 2]), 8, 8, backend="reference")


def test_dtype_mismatch_rejected():
    with pytest.raises(ValueError, match=r"k_lr has dtype torch.float64 but q_lr has torch.float32"):
        estimate_index(torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4).double(), torch.tensor([1]), 4, 4)


@pytest.mark.parametrize(
    "proxy_rows, key_rows, seq_len, match",
    [
        (5, 5, 40, r"proxies must have NG = ceil\(seq_len / group_size\) = 10 rows"),
        (10, 4, 40, r"block_keys must have NKB = ceil\(seq_len / kv_block\) = 5 rows"),
    ],
)
def test_from_means_rejects_row_counts_that_do_not_fit_seq_len(proxy_rows, key_rows, seq_len, match):
    from dsv.ops.estimate.naive import estimate_index_from_means

    with pytest.raises(ValueError, match=match):
        estimate_index_from_means(torch.randn(1, 2, proxy_rows, 4), torch.randn(1, 2, key_rows, 4),
                                  torch.tensor([1, 2]), 4, 8, seq_len)


def test_rows_from_means_equal_those_rows_of_the_whole_index():
    """Sequence-parallel selection: each rank's groups alone give the whole index's rows of those groups."""
    from dsv.ops.estimate import estimate_index_from_means, estimate_rows_from_means

    torch.manual_seed(0)
    proxies, block_keys, keep = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 20, 4), torch.tensor([2, 5, 7])
    whole = estimate_index_from_means(proxies, block_keys, keep, 8, 4, 80)
    for first, stop in ((0, 5), (5, 10), (3, 4)):
        indices, counts = estimate_rows_from_means(proxies[:, :, first:stop], block_keys, keep, 8, 4, 80, first)
        assert torch.equal(indices, whole.indices[:, :, first:stop])
        assert torch.equal(counts, whole.counts[:, :, first:stop])


@pytest.mark.parametrize("rows, first_group", [(5, 6), (5, -1), (0, 0)])
def test_rows_from_means_reject_groups_outside_the_sequence(rows, first_group):
    from dsv.ops.estimate import estimate_rows_from_means

    with pytest.raises(ValueError, match=r"proxies must hold query groups first_group \.\. first_group \+ n - 1"):
        estimate_rows_from_means(torch.randn(1, 2, rows, 4), torch.randn(1, 2, 20, 4), torch.tensor([1, 2]), 8, 4,
                                 80, first_group)
