"""Head-wise CP on gloo: outputs and gradients of every rank's shard equal the single-process result."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsv.ops.index import SparseIndex
from dsv.ops.sparse_attention import sparse_attention_reference
from dsv.parallel.hcp import all_to_all, dense_attention_fn, hcp_attention, sparse_attention_fn
from dsv.parallel.placement import place_heads
from tests.parallel import run_distributed

TOLERANCES = {
    # HCP only moves data: each head's attention runs on the same values in the same order as the
    # reference, so float64 results agree to rounding.
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    # float32: same arithmetic, but SDPA on a [B, H_r, ...] slice may pick a different blocking than on
    # [B, H, ...]; 1e-5 is ~100 float32 eps over sums of <= 64 terms.
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
}
GROUP, KV_BLOCK, DIM, BATCH = 4, 4, 8, 2


def make_case(heads, seq_len, dtype, sparse):
    q, k, v, grad_out = (torch.randn(BATCH, heads, seq_len, DIM, dtype=torch.float64).to(dtype) for _ in range(4))
    index = None
    if sparse:
        num_groups, num_blocks = math.ceil(seq_len / GROUP), math.ceil(seq_len / KV_BLOCK)
        keep = torch.randint(1, num_blocks + 1, (heads,))  # a different budget per head
        scores = torch.randn(BATCH, heads, num_groups, num_blocks)
        index = SparseIndex.from_topk(scores, keep, GROUP, KV_BLOCK, seq_len)
    # Skewed per-head cost, so LPT places uneven head counts.
    cost = (torch.rand(heads) ** 4).tolist()
    return {"q": q, "k": k, "v": v, "grad_out": grad_out, "index": index, "cost": cost}


def reference(case):
    q, k, v = (case[name].clone().requires_grad_() for name in ("q", "k", "v"))
    if case["index"] is None:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        out = sparse_attention_reference(q, k, v, case["index"])
    grads = torch.autograd.grad(out, (q, k, v), case["grad_out"])
    return (out.detach(), *grads)


def shard(x, rank, world):
    return x.chunk(world, dim=2)[rank]


def hcp_worker(rank, world, cases, placements):
    results = []
    for case, placement in zip(cases, placements):
        q, k, v = (shard(case[name], rank, world).clone().requires_grad_() for name in ("q", "k", "v"))
        fn = dense_attention_fn() if case["index"] is None else sparse_attention_fn(case["index"])
        out = hcp_attention(q, k, v, placement, fn)
        grads = torch.autograd.grad(out, (q, k, v), shard(case["grad_out"], rank, world))
        results.append((out.detach(), *grads))
    return results


@pytest.mark.parametrize("world,heads,seq_len", [(2, 5, 32), (4, 6, 64)])
def test_hcp_matches_single_process(tmp_path, world, heads, seq_len):
    cases, placements = [], []
    for dtype, sparse, method in [
        (torch.float64, False, "lpt"),
        (torch.float64, True, "exact"),
        (torch.float32, False, "lpt"),
        (torch.float64, True, "naive"),
    ]:
        case = make_case(heads, seq_len, dtype, sparse)
        cases.append(case)
        placements.append(place_heads(case["cost"], world, method))
    # The cost-balanced placements really are uneven here (heads % world != 0).
    assert any(len({len(m) for m in p}) > 1 for p in placements)

    per_rank = run_distributed(hcp_worker, world, cases, placements, out_dir=tmp_path)
    for case_id, case in enumerate(cases):
        expected = reference(case)
        tol = TOLERANCES[case["q"].dtype]
        for rank, results in enumerate(per_rank):
            for name, got, want in zip(("out", "dq", "dk", "dv"), results[case_id], expected):
                torch.testing.assert_close(got, shard(want, rank, world), **tol,
                                           msg=lambda m, name=name: f"{name}: {m}")


def errors_worker(rank, world):
    """Bad configurations raise ValueError on every rank before any collective runs."""
    messages = {}
    q = torch.randn(1, 3, 4, 8)
    try:
        hcp_attention(q, q, q, [[0], [1], [2]], dense_attention_fn())
    except ValueError as err:
        messages["too_few_heads"] = str(err)
    q = torch.randn(1, 4, 4, 8)
    try:
        hcp_attention(q, q, q, [[0, 1], [2, 3]], dense_attention_fn())
    except ValueError as err:
        messages["wrong_rank_count"] = str(err)
    try:
        hcp_attention(q, q, q, [[0], [0], [2], [3]], dense_attention_fn())
    except ValueError as err:
        messages["repeated_head"] = str(err)
    try:
        all_to_all(q, [1] * world, [1] * world)
    except ValueError as err:
        messages["bad_splits"] = str(err)
    # Wrong on one rank only, in its input and then in its attention_fn's output: its peers went on into the
    # exchange and failed there with a transport error, or waited.
    try:
        k = q if rank != 2 else torch.randn(1, 4, 4, 6)  # k unlike q
        hcp_attention(q, k, q, [[0], [1], [2], [3]], dense_attention_fn())
    except ValueError as err:
        messages["one_rank_input"] = str(err)
    dense = dense_attention_fn()
    try:
        hcp_attention(q, q, q, [[0], [1], [2], [3]],
                      lambda *args: dense(*args)[..., :-1, :] if rank == 3 else dense(*args))
    except ValueError as err:
        messages["one_rank_output"] = str(err)
    dist.barrier()
    return messages


def test_hcp_bad_configurations_raise_clear_errors(tmp_path):
    results = run_distributed(errors_worker, 4, out_dir=tmp_path)
    for messages in results:
        assert "needs at least 4 heads, got H=3" in messages["too_few_heads"]
        assert "placement lists 2 ranks, expected 4" in messages["wrong_rank_count"]
        assert "exactly once" in messages["repeated_head"]
        assert "input_splits sum to 4 but x has 1 rows" in messages["bad_splits"]
    for rank, messages in enumerate(results):
        assert ("another rank of the group refused" in messages["one_rank_input"]) == (rank != 2)
        assert ("another rank of the group refused" in messages["one_rank_output"]) == (rank != 3)
    assert "(1, 4, 4, 6)" in results[2]["one_rank_input"]
    assert "attention_fn returned shape (1, 1, 15, 8)" in results[3]["one_rank_output"]
