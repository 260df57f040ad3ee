"""Cost model and per-block planner for sparsity-aware context parallelism (HCP x SCP).

``N = |G_hcp| * |G_scp|`` GPUs, numbered node-major. An HCP group is ``h = |G_hcp|`` consecutive GPUs
(node-aligned: inside one node or whole nodes); the ``c = |G_scp|`` HCP groups each hold ``S / c``
consecutive tokens of the sequence. Inside an HCP group an all-to-all turns the ``S / N``-token shards
into the group's ``S / c`` tokens of the rank's heads (placed by cost, ``dsv.parallel.placement``, the
same in every group); SCP then fetches each head's remote critical K/V rows from the ``c - 1`` GPUs that
hold the same heads in the other groups. ``h = N`` is pure HCP (Ulysses); ``h = 1`` is pure SCP.

Cost of head ``i`` (sparsity ``s_i``, kept fraction ``k_i = 1 - s_i`` when the block runs sparse, else 1)
on its GPU, forward plus backward, batch ``B``, head dim ``D``, ``b`` bytes per element:

- compute: ``14 * B * (S / c) * S * D * k_i`` FLOPs at ``dense_tflops`` (times ``sparse_efficiency`` in
  sparse blocks). 14 = 4 (QK^T and PV, 2 FLOPs per multiply-add) x 3.5 (backward ~2.5x forward); this
  is the FLOP count that puts §3's cuDNN anchor at 557 TFLOP/s.
- HCP: the GPU receives q, k, v of its head from the ``h - 1`` peers and returns their output rows:
  ``4 * B * (S / c) * D * (h - 1) / h * b`` bytes per pass, two passes (the backward mirrors it). This is
  the receiver's view, ``4 * H_i * S * D * (N - 1) / N`` per GPU for pure HCP with ``H_i`` heads.
- SCP: the GPU fetches K and V of the kept remote keys and returns their gradients:
  ``2 * 2 * B * k_i * S * sigma * D * b`` bytes, ``sigma = (c - 1) / c`` the remote fraction (critical keys
  have no locality, as the DSV paper measured). Naive SCP (ring attention) fetches every remote row: ``k_i = 1`` here.
- A transfer split over peers inside and outside the node takes ``max(intra bytes / intra bandwidth,
  inter bytes / inter bandwidth)``: NVLink and the network run at the same time.

Every term is a sum over the GPU's heads, so a GPU's time is the sum of its heads' costs and the
slowest GPU of a block is the makespan of the placement. Compute and communication are not overlapped.
Each block synchronises at its collectives, so a step's attention time is the sum of per-block makespans.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsv.ops.index import check_positive_int
from dsv.parallel.placement import place_heads

ATTENTION_FLOPS_PER_QK_DIM = 14
"""Forward+backward FLOPs of dense attention per (query, key, head-dim) triple: 4 forward x 3.5."""


@dataclass(frozen=True)
class AttentionShape:
    """One attention block's problem: ``tokens`` (S), ``heads`` (H), ``head_dim`` (D), per GPU batch."""

    tokens: int
    heads: int
    head_dim: int
    batch: int = 1
    bytes_per_element: int = 2

    def __post_init__(self):
        for name in ("tokens", "heads", "head_dim", "batch", "bytes_per_element"):
            check_positive_int(getattr(self, name), name)


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths are GB/s per GPU and direction; ``dense_tflops`` is fwd+bwd attention.

    ``hcp_overhead_s`` / ``scp_overhead_s``: what a block under HCP (``h > 1``) / SCP (``c > 1``) costs per
    step beyond its FLOPs and bytes (launches, index remapping, host synchronisation), measured (0: the
    FLOP-and-byte model alone).
    """

    gpus: int
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    dense_tflops: float
    sparse_efficiency: float = 1.0
    hcp_overhead_s: float = 0.0
    scp_overhead_s: float = 0.0

    def __post_init__(self):
        check_positive_int(self.gpus, "gpus")
        check_positive_int(self.gpus_per_node, "gpus_per_node")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"gpus={self.gpus} must fill whole nodes of gpus_per_node={self.gpus_per_node} "
                "(or fit inside one node)"
            )
        for name in ("intra_node_gbps", "inter_node_gbps", "dense_tflops"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if not 0 < self.sparse_efficiency <= 1:
            raise ValueError(f"sparse_efficiency must lie in (0, 1], got {self.sparse_efficiency!r}")
        for name in ("hcp_overhead_s", "scp_overhead_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class BlockPlan:
    """A block's factorisation, head placement and predicted per-GPU cost (seconds, fwd+bwd).

    Attributes:
        hcp, scp: ``|G_hcp|`` and ``|G_scp|``, ``hcp * scp = N``.
        placement: heads of each HCP rank (the same in every SCP group).
        compute_s, comm_s: per HCP rank, summed over its heads.
        memory_bytes: the largest per-GPU attention working set: q, k, v, out and their gradients for
            the rank's heads over its ``S / c`` queries, plus the fetched K/V rows and their gradients.
        sparse: whether the block runs sparse attention.
    """

    hcp: int
    scp: int
    placement: list[list[int]]
    compute_s: list[float]
    comm_s: list[float]
    memory_bytes: int
    sparse: bool

    @property
    def rank_s(self) -> list[float]:
        return [a + b for a, b in zip(self.compute_s, self.comm_s)]

    @property
    def time_s(self) -> float:
        """The slowest GPU: every GPU waits for it at the block's next collective."""
        return max(self.rank_s)


@dataclass(frozen=True)
class BlockComparison:
    """One block under naive HCP (``None`` when infeasible: more GPUs than heads), naive SCP and hybrid."""

    sparsity: list[float]
    naive_hcp: BlockPlan | None
    naive_scp: BlockPlan
    hybrid: BlockPlan


@dataclass(frozen=True)
class ModelPlan:
    """Per-block plans of a whole model on one cluster; totals are attention seconds per training step."""

    cluster: Cluster
    blocks: list[BlockComparison]

    @property
    def naive_hcp_s(self) -> float | None:
        if any(block.naive_hcp is None for block in self.blocks):
            return None
        return sum(block.naive_hcp.time_s for block in self.blocks)

    @property
    def naive_scp_s(self) -> float:
        return sum(block.naive_scp.time_s for block in self.blocks)

    @property
    def hybrid_s(self) -> float:
        return sum(block.hybrid.time_s for block in self.blocks)


def factorisations(cluster: Cluster, heads: int) -> list[tuple[int, int]]:
    """Valid ``(|G_hcp|, |G_scp|)`` pairs: ``h * c = N``, ``h <= heads``, HCP groups node-aligned.

    Node-aligned: a group lies inside one node (``h`` divides ``gpus_per_node``) or spans whole nodes
    (``gpus_per_node`` divides ``h``). Groups that span nodes are allowed so that pure HCP, a baseline,
    is inside the search; the cost model charges their cross-node traffic at the inter-node bandwidth.
    """
    gpus, per_node = cluster.gpus, cluster.gpus_per_node
    pairs = []
    for hcp in range(1, min(gpus, heads) + 1):
        aligned = gpus <= per_node or per_node % hcp == 0 or hcp % per_node == 0
        if gpus % hcp == 0 and aligned:
            pairs.append((hcp, gpus // hcp))
    return pairs


def _link_seconds_per_byte(cluster: Cluster, intra_peers: int, inter_peers: int) -> float:
    """Seconds per byte of a transfer spread evenly over the given peers (NVLink and network concurrent)."""
    peers = intra_peers + inter_peers
    if peers == 0:
        return 0.0
    intra = intra_peers / peers / (cluster.intra_node_gbps * 1e9)
    inter = inter_peers / peers / (cluster.inter_node_gbps * 1e9)
    return max(intra, inter)


def _peers(cluster: Cluster, hcp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((HCP intra, HCP inter), (SCP intra, SCP inter))`` peer counts of one GPU."""
    scp = cluster.gpus // hcp
    node = min(cluster.gpus, cluster.gpus_per_node)
    hcp_intra = min(hcp, node) - 1
    # SCP peers sit at stride hcp: the node holds node / hcp groups when a group fits inside it.
    scp_intra = node // hcp - 1 if hcp < node else 0
    return (hcp_intra, hcp - 1 - hcp_intra), (scp_intra, scp - 1 - scp_intra)


def head_costs(
    kept: Sequence[float], shape: AttentionShape, cluster: Cluster, hcp: int, sparse: bool,
    fetched: Sequence[float] | None = None,
) -> tuple[list[float], list[float], list[int]]:
    """Per head: ``(compute seconds, communication seconds, working-set bytes)`` on its GPU, fwd+bwd.

    Args:
        kept: ``[H]`` kept fraction of keys per head (``1 - sparsity``, or 1 in a dense block).
        hcp: ``|G_hcp|``; ``|G_scp| = N / hcp``.
        sparse: whether the block runs the sparse kernel (its throughput is ``sparse_efficiency`` x dense).
        fetched: ``[H]`` fraction of the remote keys SCP moves per head: the union of the critical keys of
            the GPU's query groups, which exceeds one group's kept fraction unless the groups agree
            (measured by ``dsv.parallel.scp.fetched_fraction``); default ``kept`` (the method's formula,
            the lower bound); all ones is ring attention.
    """
    scp = cluster.gpus // hcp
    tokens, dim, batch, size = shape.tokens, shape.head_dim, shape.batch, shape.bytes_per_element
    queries = tokens / scp
    sigma = (scp - 1) / scp
    tflops = cluster.dense_tflops * (cluster.sparse_efficiency if sparse else 1.0)
    (hcp_intra, hcp_inter), (scp_intra, scp_inter) = _peers(cluster, hcp)
    hcp_rate = _link_seconds_per_byte(cluster, hcp_intra, hcp_inter)
    scp_rate = _link_seconds_per_byte(cluster, scp_intra, scp_inter)
    hcp_bytes = 2 * 4 * batch * queries * dim * (hcp - 1) / hcp * size
    compute, comm, memory = [], [], []
    for head, fraction in enumerate(kept):
        moved = fraction if fetched is None else fetched[head]
        scp_bytes = 2 * 2 * batch * moved * tokens * sigma * dim * size
        compute.append(ATTENTION_FLOPS_PER_QK_DIM * batch * queries * tokens * dim * fraction / (tflops * 1e12))
        comm.append(hcp_bytes * hcp_rate + scp_bytes * scp_rate)
        memory.append(round(batch * dim * size * (8 * queries + 4 * moved * tokens * sigma)))
    return compute, comm, memory


def evaluate(
    sparsity: Sequence[float],
    shape: AttentionShape,
    cluster: Cluster,
    hcp: int,
    placement: list[list[int]],
    sparse: bool,
    fetched: Sequence[float] | None = None,
) -> BlockPlan:
    """Predicted cost of one block under a given factorisation and head placement."""
    kept = [1.0 - s if sparse else 1.0 for s in sparsity]
    compute, comm, memory = head_costs(kept, shape, cluster, hcp, sparse, fetched)
    scp = cluster.gpus // hcp
    overhead = (cluster.hcp_overhead_s if hcp > 1 else 0.0) + (cluster.scp_overhead_s if scp > 1 else 0.0)
    return BlockPlan(
        hcp=hcp,
        scp=scp,
        placement=placement,
        compute_s=[sum(compute[h] for h in heads) for heads in placement],
        comm_s=[sum(comm[h] for h in heads) + overhead for heads in placement],
        memory_bytes=max(sum(memory[h] for h in heads) for heads in placement),
        sparse=sparse,
    )


def naive_hcp_plan(sparsity: Sequence[float], shape: AttentionShape, cluster: Cluster, sparse: bool):
    """Ulysses over all GPUs with equal contiguous head counts; ``None`` when GPUs outnumber heads."""
    if cluster.gpus > shape.heads:
        return None
    placement = place_heads([1.0] * shape.heads, cluster.gpus, "naive")
    return evaluate(sparsity, shape, cluster, cluster.gpus, placement, sparse)


def naive_scp_plan(sparsity: Sequence[float], shape: AttentionShape, cluster: Cluster, sparse: bool):
    """Sequence parallelism over all GPUs that moves every remote K/V row, as ring attention does."""
    return evaluate(sparsity, shape, cluster, 1, [list(range(shape.heads))], sparse, fetched=[1.0] * shape.heads)


def hybrid_plan(
    sparsity: Sequence[float],
    shape: AttentionShape,
    cluster: Cluster,
    sparse: bool,
    memory_cap_bytes: int | None = None,
    methods: Sequence[str] = ("naive", "lpt"),
    fetched: Mapping[int, Sequence[float]] | None = None,
) -> BlockPlan:
    """The factorisation and head placement with the fastest slowest GPU whose working set fits the cap.

    Searches every ``factorisations`` pair and, for each, the placements of the per-head total cost by
    ``methods`` (``dsv.parallel.placement``; ``"exact"`` is optimal but can take seconds per call, or
    raise RuntimeError, on many near-equal heads). With no cap and ``"naive"`` in ``methods`` the result
    is never slower than naive HCP or naive SCP: both lie inside the search (SCP here moves only the
    critical rows). ``fetched`` maps an SCP degree ``c`` to the per-head fraction of remote keys that SCP
    moves at that degree (``head_costs``); degrees it lacks use the kept fraction.
    """
    check_profile([list(sparsity)], shape.heads)  # a longer list planned heads the model does not have
    for degree, volumes in (fetched or {}).items():
        if len(volumes) != shape.heads or not all(0 <= v <= 1 for v in volumes):
            raise ValueError(f"fetched[{degree}] must list {shape.heads} fractions in [0, 1] (one per head), "
                             f"got {list(volumes)}")
    kept = [1.0 - s if sparse else 1.0 for s in sparsity]
    if not methods:
        raise ValueError("methods must name at least one placement method")
    best, smallest_memory = None, None
    for hcp, _ in factorisations(cluster, shape.heads):
        scp_fetched = (fetched or {}).get(cluster.gpus // hcp)
        compute, comm, _ = head_costs(kept, shape, cluster, hcp, sparse, scp_fetched)
        cost = [a + b for a, b in zip(compute, comm)]
        for method in methods:
            placement = place_heads(cost, hcp, method)
            plan = evaluate(sparsity, shape, cluster, hcp, placement, sparse, scp_fetched)
            if smallest_memory is None or plan.memory_bytes < smallest_memory:
                smallest_memory = plan.memory_bytes
            if memory_cap_bytes is not None and plan.memory_bytes > memory_cap_bytes:
                continue
            if best is None or plan.time_s < best.time_s:
                best = plan
    if best is None:
        raise ValueError(
            f"no factorisation of {cluster.gpus} GPUs fits the memory cap of {memory_cap_bytes} bytes; "
            f"the smallest per-GPU working set is {smallest_memory} bytes"
        )
    return best


def plan_model(
    profile: Sequence[Sequence[float]],
    shape: AttentionShape,
    cluster: Cluster,
    sparse_threshold: float = 0.8,
    memory_cap_bytes: int | None = None,
    methods: Sequence[str] = ("naive", "lpt"),
) -> ModelPlan:
    """Plan every block of a model.

    Args:
        profile: ``[layers][heads]`` head sparsity in ``[0, 1)``; ``shape.heads`` entries per layer.
        sparse_threshold: a block runs sparse when its mean head sparsity is at least this (the operator
            dispatcher's rule, as ``DSVAttention.dispatch``); otherwise dense, every key kept.
        memory_cap_bytes: per-GPU cap on the attention working set of the hybrid plan.
        methods: head placement methods the hybrid search tries (``hybrid_plan``).
    """
    check_profile(profile, shape.heads)
    if shape.tokens % cluster.gpus:
        raise ValueError(f"tokens={shape.tokens} do not split evenly over {cluster.gpus} GPUs")
    blocks = []
    for sparsity in profile:
        sparse = sum(sparsity) / len(sparsity) >= sparse_threshold
        blocks.append(
            BlockComparison(
                sparsity=list(sparsity),
                naive_hcp=naive_hcp_plan(sparsity, shape, cluster, sparse),
                naive_scp=naive_scp_plan(sparsity, shape, cluster, sparse),
                hybrid=hybrid_plan(sparsity, shape, cluster, sparse, memory_cap_bytes, methods),
            )
        )
    return ModelPlan(cluster=cluster, blocks=blocks)


def check_profile(profile: Sequence[Sequence[float]], heads: int | None = None) -> None:
    """Raise ValueError unless ``profile`` is ``[layers][heads]`` of sparsities in ``[0, 1)``."""
    if not isinstance(profile, (list, tuple)) or not profile:
        raise ValueError("sparsity profile must be a non-empty list of layers, each a list of head sparsities")
    widths = {len(layer) if isinstance(layer, (list, tuple)) else -1 for layer in profile}
    if len(widths) != 1 or -1 in widths or 0 in widths:
        raise ValueError(f"every layer of the sparsity profile must list the same number of heads, got {widths}")
    if heads is not None and widths != {heads}:
        raise ValueError(f"sparsity profile has {widths.pop()} heads per layer, the model has {heads}")
    for layer_id, layer in enumerate(profile):
        for head_id, value in enumerate(layer):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"sparsity of layer {layer_id} head {head_id} must lie in [0, 1), got {value!r}")


GOLDEN_FRACTION = (math.sqrt(5) - 1) / 2


def paper_profile(layers: int = 32, heads: int = 16) -> list[list[float]]:
    """The DSV paper's measured 2.7B sparsity profile with a deterministic per-head spread.

    The first 3 blocks and the last: sparsity in [0.01, 0.02]; block 4: [0.70, 0.80] (~0.75); the rest:
    [0.90, 0.99]. Head ``h`` of layer ``l`` sits at fraction ``frac((l * heads + h + 1) * 0.618...)`` of
    its range (a golden-ratio sequence: evenly spread, no random generator).
    """
    check_positive_int(layers, "layers")
    check_positive_int(heads, "heads")
    if layers < 5:
        raise ValueError(
            f"the paper profile needs at least 5 layers (3 dense, 1 at ~0.75, the last dense), got {layers}"
        )
    profile = []
    for layer in range(layers):
        if layer < 3 or layer == layers - 1:
            low, high = 0.01, 0.02
        elif layer == 3:
            low, high = 0.70, 0.80
        else:
            low, high = 0.90, 0.99
        spread = [((layer * heads + head + 1) * GOLDEN_FRACTION) % 1.0 for head in range(heads)]
        profile.append([round(low + (high - low) * u, 4) for u in spread])
    return profile


def load_profile(path: str | Path) -> list[list[float]]:
    """Read a sparsity profile: JSON ``[[s, ...], ...]`` or ``{"sparsity": [[...], ...]}``, layers x heads."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        if "sparsity" not in data:
            raise ValueError(f"{path}: a JSON object profile needs a 'sparsity' key, found {sorted(data)}")
        data = data["sparsity"]
    check_profile(data)
    return [[float(s) for s in layer] for layer in data]
