import itertools

import pytest
import torch

from dsv.parallel import placement as placement_module
from dsv.parallel.placement import check_placement, makespan, place_heads, rank_loads

# The paper's setting: heads of one block with sparsity spread from 0.80 to 0.99; cost ∝ kept work 1 - s.
PAPER_SPARSITY = [0.80 + 0.19 * h / 15 for h in range(16)]
PAPER_COST = [1.0 - s for s in PAPER_SPARSITY]


def brute_force_makespan(costs, ranks):
    """Optimal makespan over every assignment that leaves no rank empty (tiny cases only)."""
    best = float("inf")
    for owners in itertools.product(range(ranks), repeat=len(costs)):
        if len(set(owners)) < ranks:
            continue
        loads = [0.0] * ranks
        for head, owner in enumerate(owners):
            loads[owner] += costs[head]
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("method", ["lpt", "exact", "naive"])
@pytest.mark.parametrize("heads,ranks", [(16, 4), (16, 16), (5, 2), (7, 3), (1, 1)])
def test_every_head_placed_once_and_no_rank_empty(method, heads, ranks):
    costs = torch.rand(heads)
    placement = place_heads(costs, ranks, method)
    check_placement(placement, heads, ranks)
    assert all(members == sorted(members) for members in placement)


def test_lpt_balances_the_paper_profile_far_better_than_naive():
    naive = makespan(place_heads(PAPER_COST, 4, "naive"), PAPER_COST)
    lpt = makespan(place_heads(PAPER_COST, 4, "lpt"), PAPER_COST)
    ideal = sum(PAPER_COST) / 4
    # Naive puts the four densest heads on rank 0: far behind a perfect split.
    assert naive > 1.5 * ideal
    assert lpt < 1.05 * ideal


@pytest.mark.parametrize("heads,ranks", [(6, 2), (7, 3), (8, 3), (6, 4)])
def test_exact_is_optimal_and_never_worse_than_lpt(heads, ranks):
    costs = torch.rand(heads).tolist()
    exact = makespan(place_heads(costs, ranks, "exact"), costs)
    lpt = makespan(place_heads(costs, ranks, "lpt"), costs)
    assert exact <= lpt + 1e-12
    assert exact == pytest.approx(brute_force_makespan(costs, ranks), abs=1e-12)


def test_exact_beats_lpt_on_its_classic_bad_case():
    # Costs 3,3,2,2,2 on 2 ranks: LPT ends {3,2,2},{3,2} = 7; the optimum {3,3},{2,2,2} = 6.
    costs = [3, 3, 2, 2, 2]
    assert makespan(place_heads(costs, 2, "lpt"), costs) == 7
    assert makespan(place_heads(costs, 2, "exact"), costs) == 6


def test_exact_on_sixteen_heads_is_fast_and_at_most_lpt():
    costs = (torch.rand(16) ** 3).tolist()
    exact = makespan(place_heads(costs, 5, "exact"), costs)
    assert exact <= makespan(place_heads(costs, 5, "lpt"), costs)
    assert exact >= max(max(costs), sum(costs) / 5) - 1e-12


def test_exact_proves_near_equal_heads_quickly_by_the_count_bound():
    # 16 near-equal heads on 5 ranks: some rank holds 4 heads, so the 4 cheapest together are optimal.
    costs = [0.98 + 0.01 * ((h * 0.618) % 1) for h in range(16)]
    assert makespan(place_heads(costs, 5, "exact"), costs) == pytest.approx(sum(sorted(costs)[:4]))


def test_exact_gives_up_loudly_past_its_node_budget(monkeypatch):
    monkeypatch.setattr(placement_module, "EXACT_MAX_NODES", 100)
    costs = [0.98 + 0.01 * ((h * 0.618) % 1) for h in range(16)]
    with pytest.raises(RuntimeError, match='gave up after 100 search nodes.*use method="lpt"'):
        place_heads(costs, 7, "exact")


def test_zero_cost_heads_still_spread_over_every_rank():
    placement = place_heads([0.0] * 4, 4, "lpt")
    assert sorted(len(m) for m in placement) == [1, 1, 1, 1]
    check_placement(place_heads([1.0, 0.0, 0.0, 0.0], 3, "exact"), 4, 3)


def test_naive_is_contiguous_with_counts_differing_by_at_most_one():
    assert place_heads([1.0] * 7, 3, "naive") == [[0, 1, 2], [3, 4], [5, 6]]


def test_rank_loads_and_makespan():
    costs = [1.0, 2.0, 3.0]
    assert rank_loads([[0, 1], [2]], costs) == [3.0, 3.0]
    assert makespan([[0], [1, 2]], costs) == 5.0


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: place_heads([1.0, 1.0], 3), "ranks <= heads"),
        (lambda: place_heads([1.0, 1.0], 0), "positive int"),
        (lambda: place_heads([1.0, -1.0], 1), "finite and >= 0"),
        (lambda: place_heads([1.0, float("nan")], 1), "finite and >= 0"),
        (lambda: place_heads([], 1), "at least one head"),
        (lambda: place_heads(torch.ones(2, 2), 1), "1-D"),
        (lambda: place_heads([1.0] * 4, 2, "greedy"), "method must be one of"),
        (lambda: place_heads([1.0] * 17, 2, "exact"), "at most 16 heads"),
        (lambda: check_placement([[0], [0]], 2, 2), "exactly once"),
        (lambda: check_placement([[0, 1], []], 2, 2), "without heads"),
        (lambda: check_placement([[0, 1]], 2, 2), "expected 2"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
