"""Head placement for head-wise context parallelism: which heads each rank computes.

With sparse attention a head's cost is proportional to the work it keeps, ``1 - sparsity``, so equal head
counts per rank (Ulysses) leave stragglers. These functions assign heads to ranks by cost so that the
slowest rank (the makespan) is as fast as possible.

A placement is ``list[list[int]]``: entry ``r`` lists the global head ids rank ``r`` computes, ascending.
Every head appears exactly once and every rank gets at least one head (with ``ranks <= heads`` an optimal
placement with no empty rank always exists: moving a head from a rank with two or more heads onto an
empty rank never raises the makespan, and an empty rank would only idle).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

METHODS = ("lpt", "exact", "naive")

EXACT_MAX_HEADS = 16
"""Largest head count ``method="exact"`` accepts; its branch and bound is exponential in the worst case."""

EXACT_MAX_NODES = 2_000_000
"""Search nodes after which ``method="exact"`` raises instead of running for minutes (a few seconds)."""


def _check_costs(head_cost: Sequence[float] | torch.Tensor) -> list[float]:
    if isinstance(head_cost, torch.Tensor):
        if head_cost.dim() != 1:
            raise ValueError(f"head_cost must be 1-D [H], got shape {tuple(head_cost.shape)}")
        costs = [float(c) for c in head_cost.tolist()]
    else:
        costs = [float(c) for c in head_cost]
    if not costs:
        raise ValueError("head_cost must list at least one head")
    bad = [c for c in costs if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"head_cost must be finite and >= 0 for every head, got {bad[:4]}")
    return costs


def _check_ranks(ranks: int, heads: int) -> None:
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    if ranks > heads:
        raise ValueError(
            f"cannot place {heads} heads on {ranks} ranks: head-wise parallelism needs ranks <= heads "
            f"(use fewer head-parallel ranks, or sequence parallelism for the rest)"
        )


def _naive(heads: int, ranks: int) -> list[list[int]]:
    # Contiguous runs whose lengths differ by at most one; the first H % N ranks take the extra head.
    base, extra = divmod(heads, ranks)
    placement, start = [], 0
    for rank in range(ranks):
        stop = start + base + (1 if rank < extra else 0)
        placement.append(list(range(start, stop)))
        start = stop
    return placement


def _lpt(costs: list[float], ranks: int) -> list[list[int]]:
    # Heaviest head first onto the least loaded rank. Ties on load go to the rank with fewer heads, so
    # zero-cost heads still spread one per rank before any rank takes a second; then the lower rank id.
    order = sorted(range(len(costs)), key=lambda h: (-costs[h], h))
    heap = [(0.0, 0, rank) for rank in range(ranks)]
    placement: list[list[int]] = [[] for _ in range(ranks)]
    for head in order:
        load, count, rank = heapq.heappop(heap)
        placement[rank].append(head)
        heapq.heappush(heap, (load + costs[head], count + 1, rank))
    return [sorted(heads) for heads in placement]


def _exact(costs: list[float], ranks: int) -> list[list[int]]:
    heads = len(costs)
    if heads > EXACT_MAX_HEADS:
        raise ValueError(
            f'method="exact" handles at most {EXACT_MAX_HEADS} heads, got {heads}; use method="lpt"'
        )
    order = sorted(range(heads), key=lambda h: (-costs[h], h))
    # smallest[j]: sum of the j cheapest heads. Heads are placed in decreasing cost, so the heads still
    # to place are always the cheapest ones and smallest[j] bounds what any j of them add to a rank.
    smallest = [0.0]
    for head in reversed(order):
        smallest.append(smallest[-1] + costs[head])
    best = _lpt(costs, ranks)
    best_span = makespan(best, costs)
    # No placement beats the heaviest head, a perfect split of the total, or the ceil(H/N) cheapest
    # heads (some rank holds at least that many).
    lower_bound = max(max(costs), sum(costs) / ranks, smallest[-(-heads // ranks)])
    # Improvements below float rounding of the load sums are not improvements: without this margin the
    # search would keep going to shave 1e-16 off an already optimal makespan.
    margin = 1e-12 * max(lower_bound, 1e-300)
    loads = [0.0] * ranks
    members: list[list[int]] = [[] for _ in range(ranks)]
    nodes = 0

    def can_improve(remaining: int) -> bool:
        """Whether the heads left can still fit under ``best_span`` by count: each rank can take at most
        as many as keep it below ``best_span`` when they are the cheapest ones."""
        room = 0
        for load in loads:
            take = 0
            while take < remaining and load + smallest[take + 1] < best_span - margin:
                take += 1
            room += take
        return room >= remaining

    def search(position: int) -> bool:
        """Depth-first over heads in decreasing cost; True once a placement meets the lower bound."""
        nonlocal best, best_span, nodes
        nodes += 1
        if nodes > EXACT_MAX_NODES:
            raise RuntimeError(
                f'method="exact" gave up after {EXACT_MAX_NODES} search nodes on {heads} heads and '
                f'{ranks} ranks without proving optimality; use method="lpt"'
            )
        if position == heads:
            span = max(loads)
            if span < best_span - margin:
                best, best_span = [sorted(m) for m in members], span
            return best_span <= lower_bound + margin
        empty = sum(1 for m in members if not m)
        if heads - position < empty or not can_improve(heads - position):
            return False
        head = order[position]
        tried_loads = set()
        for rank in range(ranks):
            # Ranks with equal load (and equally empty or not) are interchangeable for the rest of the
            # search: try only the first of them.
            key = (loads[rank], not members[rank])
            if key in tried_loads or loads[rank] + costs[head] >= best_span - margin:
                continue
            tried_loads.add(key)
            loads[rank] += costs[head]
            members[rank].append(head)
            done = search(position + 1)
            members[rank].pop()
            loads[rank] -= costs[head]
            if done:
                return True
        return False

    if best_span > lower_bound + margin:
        search(0)
    return best


def place_heads(
    head_cost: Sequence[float] | torch.Tensor, ranks: int, method: str = "lpt"
) -> list[list[int]]:
    """Assign heads to ranks so that the most loaded rank is as light as possible.

    Args:
        head_cost: ``[H]`` non-negative cost per head, e.g. ``1 - sparsity`` (list or 1-D tensor).
        ranks: number of head-parallel ranks ``N``, ``1 <= N <= H``.
        method: ``"lpt"`` (longest processing time first: heaviest head onto the least loaded rank;
            within 4/3 of optimal), ``"exact"`` (branch and bound seeded with LPT, optimal; at most
            ``EXACT_MAX_HEADS`` heads; raises RuntimeError when it cannot prove optimality within
            ``EXACT_MAX_NODES`` search nodes, e.g. 16 near-equal heads on 7 ranks) or ``"naive"``
            (contiguous equal counts, as Ulysses; ignores cost).

    Returns:
        ``N`` lists of head ids, each ascending and non-empty; every head exactly once.
    """
    costs = _check_costs(head_cost)
    _check_ranks(ranks, len(costs))
    if method == "lpt":
        return _lpt(costs, ranks)
    if method == "exact":
        return _exact(costs, ranks)
    if method == "naive":
        return _naive(len(costs), ranks)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def check_placement(placement: Sequence[Sequence[int]], heads: int, ranks: int) -> None:
    """Raise ValueError unless ``placement`` gives ``ranks`` non-empty lists covering ``range(heads)`` once."""
    if len(placement) != ranks:
        raise ValueError(f"placement lists {len(placement)} ranks, expected {ranks}")
    empty = [rank for rank, members in enumerate(placement) if len(members) == 0]
    if empty:
        raise ValueError(f"placement leaves ranks {empty} without heads; every rank needs at least one")
    flat = [int(h) for members in placement for h in members]
    if sorted(flat) != list(range(heads)):
        missing = sorted(set(range(heads)) - set(flat))
        repeated = sorted({h for h in flat if flat.count(h) > 1})
        outside = sorted({h for h in flat if not 0 <= h < heads})
        raise ValueError(
            f"placement must list each of the {heads} heads exactly once; "
            f"missing {missing}, repeated {repeated}, out of range {outside}"
        )


def rank_loads(placement: Sequence[Sequence[int]], head_cost: Sequence[float] | torch.Tensor) -> list[float]:
    """Summed cost of each rank's heads."""
    costs = _check_costs(head_cost)
    check_placement(placement, len(costs), len(placement))
    return [sum(costs[h] for h in members) for members in placement]


def makespan(placement: Sequence[Sequence[int]], head_cost: Sequence[float] | torch.Tensor) -> float:
    """Cost of the most loaded rank: the time every rank waits for at the next collective."""
    return max(rank_loads(placement, head_cost))
