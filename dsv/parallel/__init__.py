"""Sparsity-aware context parallelism, on torch.distributed only (gloo and NCCL).

- ``placement``: head placement by cost (LPT, exact, naive) for head-wise CP.
- ``hcp``: head-wise CP (Ulysses-like all-to-all) with uneven, cost-balanced head counts.
- ``scp``: sequence-wise CP that fetches only the remote critical key/value blocks.
- ``planner``: cost model and per-block HCP x SCP planner; ``plan_cli`` is ``dsv plan``.
- ``fsdp``: FSDP2 sharding of a DSV model; predictors replicated, DSV EMAs averaged over ranks.
"""

from dsv.parallel.fsdp import (
    check_replicas_in_sync,
    replica_divergence,
    shard_model,
)
from dsv.parallel.hcp import (
    all_to_all,
    dense_attention_fn,
    hcp_attention,
    sparse_attention_fn,
)
from dsv.parallel.placement import check_placement, makespan, place_heads, rank_loads
from dsv.parallel.planner import (
    AttentionShape,
    Cluster,
    hybrid_plan,
    paper_profile,
    plan_model,
)
from dsv.parallel.scp import LocalIndex, ScpCommStats, scp_attention

__all__ = [
    "AttentionShape",
    "Cluster",
    "LocalIndex",
    "ScpCommStats",
    "all_to_all",
    "check_placement",
    "check_replicas_in_sync",
    "dense_attention_fn",
    "hcp_attention",
    "hybrid_plan",
    "makespan",
    "paper_profile",
    "place_heads",
    "plan_model",
    "rank_loads",
    "replica_divergence",
    "scp_attention",
    "shard_model",
    "sparse_attention_fn",
]
