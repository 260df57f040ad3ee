"""Check the DSV paper's observations (power law, no locality, heterogeneity, dynamics, neighbours share) on a
checkpoint: plots and a markdown summary from exact softmax rows of its held-out clips.

Every statistic works on sampled query rows: the dense softmax of ``R`` rows over all ``S`` keys, chunked over
rows (``DEFAULT_CHUNK_BYTES`` of temporaries per chunk), never the ``S x S`` matrix. The layers hand q and k
over in grouped (cube-permuted) order; everything here first maps them back to raster order, so a token's
position ``i`` is ``(t, h, w)`` with ``i = (t * H + h) * W + w``.

Definitions (θ: the critical mass, the run's ``attention.theta`` unless given):
- critical keys of a query: the fewest keys whose softmax weights sum to at least θ (ties: sort order);
- distance: Chebyshev distance on the 3-D grid, ``max(|dt|, |dh|, |dw|)`` in tokens;
- overlap of two queries i, j of one cube: ``|C_i ∩ C_j| / |C_i|``, the fraction of i's critical keys that j
  also holds; a cube's overlap is the mean over its ordered pairs i != j (Jaccard is reported beside it);
- selection mass of a cube shape: the softmax mass a query keeps when its cube's queries share the exact best
  set of whole key cubes of that shape (the kernels' blocks at the default ``attention.kv_block = 0``; a run with
  other key blocks is compared at cube-sized ones), ``(1 - s)`` of them per head (s: the head's sparsity at θ;
  interpolated between whole numbers of cubes): what a perfect predictor would keep with that cube.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
import torch

from dsv.analysis.checkpointed_model import load_model, run_precision
from dsv.analysis.figures import save_figure
from dsv.analysis.profile import check_clips_and_theta, heatmap, heldout_clips, remove_stale_outputs
from dsv.ops import head_sparsity, index_recall, oracle_index
from dsv.ops.grouping import check_cube_tiles, check_sequence_matches_grid, cube_permutation
from dsv.ops.index import check_bhsd, compute_dtype, resolve_chunk_size, resolve_scale
from dsv.ops.measure import check_theta
from dsv.train.checkpoint import resolve_checkpoint, write_text_atomic
from dsv.train.durable import check_folder_possible

NEAR, FAR = 5, 10
"""A critical key is *near* at distance <= NEAR and *far* at distance > FAR (the paper's 5 and 10 tokens)."""
TOP_FRACTION, TOP_MASS = 0.1, 0.9
"""Power law test: do the top TOP_FRACTION of keys hold at least TOP_MASS of a query's softmax mass?"""
DEFAULT_CUBES = ((1, 2, 2), (2, 2, 2), (2, 4, 4), (4, 4, 4))
SELECTION_CUBES = ((2, 4, 4), (1, 4, 8), (4, 4, 4), (2, 4, 8), (1, 8, 8), (8, 4, 4), (4, 4, 8), (2, 8, 8))
"""Cube shapes of 32, 64 and 128 tokens whose selection mass is compared (the model's own cube is added)."""
EFFICIENT_CUBE_TOKENS = 64
"""The smallest cube the recommendation takes: by the dispatch speed model (`dsv.modules.dispatch`) 64- and
128-token blocks cost 1.30x / 1.25x dense's time per kept key, 32-token blocks 3.95x."""


# ---------------------------------------------------------------------------------------------- statistics


def grid_coords(grid: tuple[int, int, int]) -> torch.Tensor:
    """int64 ``[S, 3]``: the ``(t, h, w)`` of every raster position of ``grid``."""
    t, h, w = (int(size) for size in grid)
    return torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), -1).view(-1, 3)


def to_raster(x: torch.Tensor, grid: tuple[int, int, int], cube: tuple[int, int, int]) -> torch.Tensor:
    """``x [B, H, S, D]`` in the grouped order of ``cube`` → the same tokens in raster order."""
    _, inv = cube_permutation(grid, cube)
    return x.index_select(2, inv.to(x.device))


def sample_rows(seq_len: int, count: int, seed: int = 0) -> torch.Tensor:
    """``min(count, S)`` distinct query rows, ascending, int64 ``[R]``; random rather than strided so that
    the sample does not favour one in-cube offset or one grid column."""
    if count < 1:
        raise ValueError(f"rows must be >= 1, got {count}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(seq_len, generator=gen)[: min(count, seq_len)].sort().values


def _sorted_chunks(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float | None,
                   rows_per_chunk: int | None = None):
    """Yield ``(chunk_rows [r], weights [B, H, r, S], key ids [B, H, r, S])``: each sampled row's softmax
    weights sorted descending, and the key each weight belongs to. ``rows_per_chunk`` must be a multiple of
    whatever unit the caller needs whole (cube volume); ``None`` sizes chunks to the memory budget."""
    batch, heads, seq_len, dim = check_bhsd({"q": q, "k": k})
    scale = resolve_scale(scale, dim)
    dtype = compute_dtype(q.dtype)
    # Per row: scores, sorted weights, cumulative sums, masks and distances, plus int64 sort ids.
    chunk = resolve_chunk_size(rows_per_chunk, rows.numel(), batch * heads * seq_len * 48, "rows_per_chunk")
    kt = k.to(dtype).transpose(-1, -2)
    for start in range(0, rows.numel(), chunk):
        chunk_rows = rows[start : start + chunk].to(q.device)
        probs = torch.softmax((q[:, :, chunk_rows].to(dtype) @ kt) * scale, dim=-1)
        weights, keys = torch.sort(probs, dim=-1, descending=True)
        yield chunk_rows, weights, keys


def _critical_mask(weights: torch.Tensor, keys: torch.Tensor, theta: float) -> torch.Tensor:
    """bool ``[..., S]`` over key ids: the critical keys, from descending ``weights`` and their ``keys``."""
    check_theta(theta)
    seq_len = weights.shape[-1]
    # One more than the prefixes still short of θ; rounding can leave a θ near 1 unreached, hence the cap.
    counts = ((weights.cumsum(-1) < theta).sum(-1, keepdim=True) + 1).clamp(max=seq_len)
    in_prefix = torch.arange(seq_len, device=weights.device) < counts
    return torch.zeros_like(in_prefix).scatter_(-1, keys, in_prefix)


def top_mass(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, top_fraction: float = TOP_FRACTION,
             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mass held by each sampled query's heaviest keys, and the mean sorted weight curve.

    Args:
        q, k: ``[B, H, S, D]`` (any token order: the statistic ignores positions).
        rows: int64 ``[R]`` sampled query rows.
        top_fraction: the heaviest ``ceil(top_fraction * S)`` keys count, in ``(0, 1]``.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(mass [B, H, R] float32, mean_sorted [H, S] float32)``: ``mean_sorted[h, r]`` is the weight of the
        ``r``-th heaviest key averaged over batch and sampled rows.
    """
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top_fraction must lie in (0, 1], got {top_fraction!r}")
    top = math.ceil(top_fraction * q.shape[2])
    masses, curve = [], 0.0
    for _, weights, _ in _sorted_chunks(q, k, rows, scale):
        masses.append(weights[..., :top].sum(-1))
        curve = curve + weights.sum(dim=(0, 2))
    return torch.cat(masses, -1).float(), (curve / (q.shape[0] * rows.numel())).float()


def critical_distances(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, grid: tuple[int, int, int],
                       theta: float = 0.9, scale: float | None = None) -> torch.Tensor:
    """Where each sampled query's critical keys lie, by Chebyshev distance from the query on the grid.

    Args:
        q, k: ``[B, H, S, D]`` in raster order of ``grid`` (``to_raster``).
        rows: int64 ``[R]`` sampled query rows (raster positions).
        grid: ``(T, H, W)``, ``T * H * W == S``.
        theta: critical mass in ``(0, 1)``.

    Returns:
        float32 ``[B, H, R, max(T, H, W)]``: entry ``d`` is the fraction of the row's critical keys at
        distance ``d``; each row sums to 1.
    """
    check_sequence_matches_grid(q.shape[2], grid)
    coords = grid_coords(grid).to(q.device)
    bins = max(grid)
    hists = []
    for chunk_rows, weights, keys in _sorted_chunks(q, k, rows, scale):
        mask = _critical_mask(weights, keys, theta)
        dist = (coords[chunk_rows, None, :] - coords[None, :, :]).abs().amax(-1)  # [r, S]
        counts = torch.zeros(*mask.shape[:-1], bins, device=q.device)
        counts.scatter_add_(-1, dist.expand_as(mask), mask.float())
        hists.append(counts / counts.sum(-1, keepdim=True))
    return torch.cat(hists, dim=2)


def uniform_distances(rows: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """The ``critical_distances`` histogram if every key were critical, float32 ``[max(T, H, W)]`` mean over
    ``rows``: the baseline that tells no-locality from a grid too small to be far."""
    coords = grid_coords(grid)
    dist = (coords[rows, None, :] - coords[None, :, :]).abs().amax(-1)
    counts = torch.zeros(rows.numel(), max(grid)).scatter_add_(-1, dist, torch.ones(dist.shape))
    return (counts / counts.sum(-1, keepdim=True)).mean(0)


def cube_overlap(q: torch.Tensor, k: torch.Tensor, grid: tuple[int, int, int], cube: tuple[int, int, int],
                 theta: float = 0.9, scale: float | None = None, max_cubes: int = 64
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """How much queries of one cube share their critical keys.

    Args:
        q, k: ``[B, H, S, D]`` in raster order of ``grid``.
        grid: ``(T, H, W)``; cube: ``(t, h, w)`` dividing it, at least 2 tokens.
        theta: critical mass in ``(0, 1)``.
        max_cubes: cubes measured, evenly spaced over the grouped order (all when there are fewer).

    Returns:
        ``(overlap [B, H], jaccard [B, H])`` float32, means over measured cubes and ordered pairs of distinct
        queries: ``|C_i ∩ C_j| / |C_i|`` and ``|C_i ∩ C_j| / |C_i ∪ C_j|``.
    """
    check_sequence_matches_grid(q.shape[2], grid)
    check_cube_tiles(grid, cube, "the critical-key overlap inside query cubes")
    perm, _ = cube_permutation(grid, cube)
    group = math.prod(cube)
    if group < 2:
        raise ValueError(f"cube {tuple(cube)} holds one token: overlap needs at least two queries")
    if max_cubes < 1:
        raise ValueError(f"max_cubes must be >= 1, got {max_cubes}")
    num_cubes = q.shape[2] // group
    cubes = torch.linspace(0, num_cubes - 1, min(max_cubes, num_cubes)).round().long().unique()
    # Grouped positions of the chosen cubes → raster rows, one cube's queries contiguous.
    rows = perm[(cubes[:, None] * group + torch.arange(group)).view(-1)]
    batch, heads = q.shape[:2]
    budget = resolve_chunk_size(None, rows.numel(), batch * heads * q.shape[2] * 48, "rows_per_chunk")
    per_chunk = max(group, budget // group * group)  # whole cubes per chunk
    pair = ~torch.eye(group, dtype=torch.bool, device=q.device)
    overlap_sum = torch.zeros(batch, heads, device=q.device)
    jaccard_sum = torch.zeros(batch, heads, device=q.device)
    for _, weights, keys in _sorted_chunks(q, k, rows, scale, rows_per_chunk=per_chunk):
        mask = _critical_mask(weights, keys, theta).float()
        mask = mask.view(batch, heads, -1, group, mask.shape[-1])  # [B, H, cubes, G, S]
        inter = mask @ mask.transpose(-1, -2)  # [B, H, cubes, G, G]
        size = inter.diagonal(dim1=-2, dim2=-1)  # |C_i| >= 1
        overlap = inter / size[..., :, None]
        jaccard = inter / (size[..., :, None] + size[..., None, :] - inter)
        overlap_sum += overlap[..., pair].mean(-1).sum(-1)
        jaccard_sum += jaccard[..., pair].mean(-1).sum(-1)
    return (overlap_sum / cubes.numel()).float(), (jaccard_sum / cubes.numel()).float()


def selection_mass(q: torch.Tensor, k: torch.Tensor, grid: tuple[int, int, int], cube: tuple[int, int, int],
                   sparsity: torch.Tensor, rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The attention mass a query keeps when the queries of its ``cube`` share the exact best key cubes.

    Head ``h`` keeps ``(1 - sparsity[h]) * NKB`` key cubes: where that is not a whole number, the mass is
    interpolated between the whole numbers around it, so that cubes of different sizes compare at the same kept
    fraction of the keys (rounding up would favour large cubes on small grids).

    Args:
        q, k: ``[B, H, S, D]`` in raster order of ``grid``.
        grid: ``(T, H, W)``; cube: ``(t, h, w)`` dividing it: the query group and the key block.
        sparsity: float ``[H]`` head sparsity at θ, in [0, 1].
        rows: integer ``[R]`` raster query rows to measure on.

    Returns:
        float32 ``[B, H]``: the mean over ``rows`` of the softmax mass inside the kept key cubes
        (``oracle_index`` then ``index_recall`` in the cube's grouped order).
    """
    check_sequence_matches_grid(q.shape[2], grid)
    check_cube_tiles(grid, cube, "the selection mass of a cube shape")
    perm, inv = cube_permutation(grid, cube)
    group = math.prod(cube)
    num_blocks = q.shape[2] // group
    grouped_q, grouped_k = q.index_select(2, perm.to(q.device)), k.index_select(2, perm.to(k.device))
    grouped_rows = inv.to(q.device)[rows.to(q.device)]
    blocks = (1.0 - sparsity.double().cpu().clamp(0.0, 1.0)) * num_blocks
    fewer = blocks.floor().clamp(max=num_blocks - 1)

    def mass_at(keep: torch.Tensor) -> torch.Tensor:  # keep: whole key cubes per head, >= 1
        index = oracle_index(grouped_q, grouped_k, keep.to(torch.int32).to(q.device), group, group, scale=scale)
        return index_recall(grouped_q, grouped_k, index, grouped_rows, scale=scale)

    weight = (blocks - fewer).to(device=q.device, dtype=torch.float32)
    # Each side only where a head needs it (a head below one key cube: no mass below; a whole number: none above).
    below = (mass_at(fewer.clamp(min=1)) * (fewer >= 1).to(q.device) if bool((fewer >= 1).any())
             else torch.zeros(q.shape[0], q.shape[1], device=q.device))
    if not bool((weight > 0).any()):
        return below
    return below + weight * (mass_at(fewer + 1) - below)


def recommend_selection_cube(masses: dict[tuple[int, int, int], float], min_tokens: int = EFFICIENT_CUBE_TOKENS):
    """The cube keeping the most selection mass among those of at least ``min_tokens`` tokens (all cubes when
    none is that large; ties: the larger cube), or ``None`` without cubes."""
    candidates = [cube for cube in masses if math.prod(cube) >= min_tokens] or list(masses)
    return max(candidates, key=lambda cube: (masses[cube], math.prod(cube)), default=None)


def recommendation_scope(selection: dict) -> str:
    """Which cubes ``selection`` (the ``"selection"`` of ``observe_checkpoint``) recommended from, in words."""
    if math.prod(selection["recommended"]) >= selection["min_tokens"]:
        return (f"among the cubes of at least {selection['min_tokens']} tokens (smaller blocks run the sparse "
                "kernels at ~3x the cost per kept key)")
    return f"among the measured cubes (none of at least {selection['min_tokens']} tokens divides the grid)"


def usable_cubes(cubes, grid: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """The ``cubes`` that divide ``grid`` and hold at least two tokens (an overlap needs a pair)."""
    return [c for c in cubes if math.prod(c) > 1 and all(g % s == 0 for g, s in zip(grid, c))]


def recommend_cube(overlaps: dict[tuple[int, int, int], float], threshold: float = 0.8):
    """The largest cube (by volume, then in given order) whose mean overlap is at least ``threshold``, or
    ``None`` when none is."""
    passing = [cube for cube, value in overlaps.items() if value >= threshold]
    return max(passing, key=math.prod, default=None)


# --------------------------------------------------------------------------------------------- checkpoint


class _Collector:
    """Observer for every DSVAttention: all per-layer statistics of one forward pass over held-out clips."""

    def __init__(self, theta: float, num_rows: int, cubes: tuple[tuple[int, int, int], ...], max_cubes: int,
                 selection_cubes: tuple[tuple[int, int, int], ...] = ()):
        self.theta, self.num_rows, self.cubes, self.max_cubes = theta, num_rows, cubes, max_cubes
        self.selection_cubes = selection_cubes
        self.layers: dict[int, dict] = {}
        self.grid = None
        self.rows = None

    def __call__(self, layer, hidden, q, k, grid) -> None:
        grid = tuple(int(size) for size in grid)
        q, k = to_raster(q, grid, layer.cfg.cube), to_raster(k, grid, layer.cfg.cube)
        self.grid = grid
        self.rows = sample_rows(q.shape[2], self.num_rows)
        mass, curve = top_mass(q, k, self.rows, scale=layer.scale)
        hist = critical_distances(q, k, self.rows, grid, self.theta, scale=layer.scale)
        overlap = {cube: cube_overlap(q, k, grid, cube, self.theta, layer.scale, self.max_cubes)
                   for cube in usable_cubes(self.cubes, grid)}
        sparsity = head_sparsity(q, k, self.rows.to(q.device), self.theta, scale=layer.scale)
        selection = {cube: selection_mass(q, k, grid, cube, sparsity, self.rows, layer.scale).mean(0).cpu()
                     for cube in usable_cubes(self.selection_cubes, grid)}
        self.layers[layer.layer_index] = {
            "sparsity": sparsity.cpu(),
            "selection": selection,  # {cube: [H]}
            "power_law": (mass >= TOP_MASS).float().mean(dim=(0, 2)).cpu(),  # [H]
            "top_mass": mass.mean(dim=(0, 2)).cpu(),  # [H]
            "curve": curve.cpu(),  # [H, S]
            "hist": hist.mean(dim=(0, 2)).cpu(),  # [H, bins]
            "near": hist[..., : NEAR + 1].sum(-1).mean(dim=(0, 2)).cpu(),  # [H]
            "far": hist[..., FAR + 1 :].sum(-1).mean(dim=(0, 2)).cpu(),  # [H]
            "overlap": {cube: (o.mean(0).cpu(), j.mean(0).cpu()) for cube, (o, j) in overlap.items()},
        }


def power_law_slope(curve: torch.Tensor) -> float:
    """Slope of log(weight) vs log(rank) over the top ``TOP_FRACTION`` ranks of a mean sorted curve ``[S]``."""
    top = max(2, math.ceil(TOP_FRACTION * curve.numel()))
    x = torch.log(torch.arange(1, top + 1, dtype=torch.float64))
    y = torch.log(curve[:top].double().clamp_min(1e-30))
    x = x - x.mean()
    return float((x * (y - y.mean())).sum() / (x * x).sum())


def find_metrics(checkpoint: str) -> Path | None:
    """``metrics.jsonl`` of the run that ``checkpoint`` (a run folder or one of its checkpoint folders)
    belongs to, or None."""
    for folder in (Path(checkpoint), resolve_checkpoint(checkpoint).parent.parent):
        if (folder / "metrics.jsonl").is_file():
            return folder / "metrics.jsonl"
    return None


def sparsity_history(metrics: Path, up_to_step: int) -> tuple[list[int], torch.Tensor]:
    """Steps up to ``up_to_step`` and per-layer mean profiled sparsity ``[steps, L]`` (NaN where never measured)
    from a metrics log; an earlier checkpoint's observations leave out the steps its run went on to train."""
    steps, rows = [], []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "layers" in record and int(record["step"]) <= up_to_step:
            steps.append(int(record["step"]))
            means = (mean_of_measured(layer["sparsity"]) for layer in record["layers"])
            rows.append([math.nan if mean is None else mean for mean in means])
    return steps, torch.tensor(rows, dtype=torch.float64)


def mean_of_measured(values: list[float | None]) -> float | None:
    """Mean of a layer's logged per-head values over the heads with a measurement (a head logs None until its
    first one, or after a non-finite one); None if no head has one."""
    measured = [v for v in values if v is not None]
    return statistics.fmean(measured) if measured else None


def _plot_power_law(layers: dict, path: Path) -> None:
    shown = sorted({0, len(layers) // 2, len(layers) - 1})
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.4), squeeze=False)
    for ax, index in zip(axes[0], shown):
        curve = layers[index]["curve"]
        ranks = list(range(1, curve.shape[1] + 1))
        for head, row in enumerate(curve):
            ax.loglog(ranks, row.clamp_min(1e-12).tolist(), label=f"head {head}")
        ax.axvline(math.ceil(TOP_FRACTION * curve.shape[1]), color="grey", ls=":", lw=1)
        ax.set_title(f"block {index}")
        ax.set_xlabel("key rank")
    axes[0][0].set_ylabel("softmax weight (mean over queries)")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def _plot_locality(layers: dict, baseline: torch.Tensor, path: Path) -> None:
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.2), squeeze=False, sharey=True)
    bins = list(range(baseline.numel()))
    for ax, (index, stats) in zip(axes[0], sorted(layers.items())):
        ax.bar(bins, stats["hist"].mean(0).tolist(), color="tab:blue", label="critical keys")
        ax.step(bins, baseline.tolist(), where="mid", color="tab:red", label="all keys")
        ax.set_title(f"block {index}")
        ax.set_xlabel("Chebyshev distance (tokens)")
    axes[0][0].set_ylabel("fraction of a query's keys")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def _plot_dynamics(steps: list[int], history: torch.Tensor, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for index in range(history.shape[1]):
        ax.plot(steps, history[:, index].tolist(), marker=".", label=f"block {index}")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean head sparsity (profiler EMA)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def _plot_overlap(overlap: torch.Tensor, cubes: list, threshold: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.4))
    volumes = [math.prod(cube) for cube in cubes]
    for index, row in enumerate(overlap):
        ax.plot(volumes, row.tolist(), marker="o", label=f"block {index}")
    ax.axhline(threshold, color="grey", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(volumes, ["×".join(map(str, cube)) for cube in cubes])
    ax.set_xlabel("query cube")
    ax.set_ylabel("mean shared fraction of critical keys")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    save_figure(fig, path)


@torch.no_grad()
def observe_checkpoint(checkpoint: str, out_dir: str, device: str = "auto", clips: int = 4,
                       theta: float | None = None, cube_shapes=DEFAULT_CUBES, overlap_threshold: float = 0.8,
                       rows: int = 256, max_cubes: int = 64, selection_cubes=SELECTION_CUBES) -> dict:
    """Measure the five observations on ``clips`` held-out clips of a checkpoint; write plots,
    ``observations.md`` and ``observations.json`` to ``out_dir``.

    ``cube_shapes`` that do not divide the grid (or hold one token) are skipped and listed as such; ``rows``
    query rows per layer are sampled for the power-law, locality and sparsity statistics, and at most
    ``max_cubes`` cubes per shape for the overlap. ``overlap_threshold`` picks the cube the paper's criterion
    recommends; ``selection_cubes`` (with the model's own cube) are compared by selection mass, which picks the
    recommended cube for the kernels (``recommend_selection_cube``). Returns the numbers of
    ``observations.json`` plus ``files`` (paths written) and ``summary`` (the markdown).
    """
    check_clips_and_theta(clips, theta)
    if not 0.0 <= overlap_threshold <= 1.0:
        raise ValueError(f"overlap_threshold must lie in [0, 1], got {overlap_threshold!r}")
    check_folder_possible(out_dir, "--out")  # before the model runs, not after
    model, cfg, step = load_model(checkpoint, device)
    dev = next(model.parameters()).device
    theta = cfg.attention.theta if theta is None else theta
    x0 = heldout_clips(cfg, clips).to(dev)
    cubes = tuple(tuple(int(s) for s in cube) for cube in cube_shapes)
    model_cube = tuple(int(s) for s in cfg.attention.cube)
    compared = tuple(dict.fromkeys((model_cube, *(tuple(int(s) for s in cube) for cube in selection_cubes))))
    collector = _Collector(theta, rows, cubes, max_cubes, compared)
    for layer in model.controller.layers:
        layer.observer = collector
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(x0.shape[0], generator=gen).to(dev)
    noise = torch.randn(x0.shape, generator=gen).to(dev)
    tb = t.view(-1, 1, 1, 1, 1)
    try:
        with run_precision(cfg, dev):
            model((1 - tb) * x0 + tb * noise, t)
    finally:
        for layer in model.controller.layers:
            layer.observer = None
    layers, grid = collector.layers, collector.grid
    usable = usable_cubes(cubes, grid)
    skipped = [c for c in cubes if c not in usable]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []

    sparsity = torch.stack([layers[i]["sparsity"] for i in sorted(layers)])
    power = torch.stack([layers[i]["power_law"] for i in sorted(layers)])
    held = torch.stack([layers[i]["top_mass"] for i in sorted(layers)])
    near = torch.stack([layers[i]["near"] for i in sorted(layers)])
    far = torch.stack([layers[i]["far"] for i in sorted(layers)])
    exponents = [power_law_slope(layers[i]["curve"].mean(0)) for i in sorted(layers)]
    baseline = uniform_distances(collector.rows, grid)
    overlap = torch.stack([torch.stack([layers[i]["overlap"][c][0].mean() for c in usable]) for i in sorted(layers)]) \
        if usable else torch.empty(len(layers), 0)
    jaccard = torch.stack([torch.stack([layers[i]["overlap"][c][1].mean() for c in usable]) for i in sorted(layers)]) \
        if usable else torch.empty(len(layers), 0)
    mean_overlap = {c: float(overlap[:, j].mean()) for j, c in enumerate(usable)}
    recommended = recommend_cube(mean_overlap, overlap_threshold)
    selectable = usable_cubes(compared, grid)
    selection = torch.stack([torch.stack([layers[i]["selection"][c].mean() for c in selectable])
                             for i in sorted(layers)]) if selectable else torch.empty(len(layers), 0)
    mean_selection = {c: float(selection[:, j].mean()) for j, c in enumerate(selectable)}
    for_kernels = recommend_selection_cube(mean_selection)

    _plot_power_law(layers, out / "power_law.png")
    _plot_locality(layers, baseline, out / "locality.png")
    heatmap(sparsity, f"sparsity at θ={theta} (step {step})", out / "heterogeneity.png", 0.0, 1.0)
    files += ["power_law.png", "locality.png", "heterogeneity.png"]
    if usable:
        _plot_overlap(overlap, usable, overlap_threshold, out / "neighbours.png")
        files.append("neighbours.png")
    metrics = find_metrics(checkpoint)
    history = None
    if metrics is not None:
        steps, history = sparsity_history(metrics, step)
        if steps:
            _plot_dynamics(steps, history, out / "dynamics.png")
            files.append("dynamics.png")
        else:
            history = None

    result = {
        "step": step, "theta": theta, "grid": list(grid), "clips": clips, "rows": collector.rows.numel(),
        "power_law": {"top_fraction": TOP_FRACTION, "mass": TOP_MASS, "fraction_of_queries": power.mean(1).tolist(),
                      "per_head": power.tolist(), "mean_top_mass": held.mean(1).tolist(), "log_log_slope": exponents},
        "locality": {"metric": "chebyshev", "near": NEAR, "far": FAR, "near_fraction": near.mean(1).tolist(),
                     "far_fraction": far.mean(1).tolist(),
                     "uniform_near": float(baseline[: NEAR + 1].sum()), "uniform_far": float(baseline[FAR + 1 :].sum()),
                     "histogram": [layers[i]["hist"].mean(0).tolist() for i in sorted(layers)],
                     "uniform_histogram": baseline.tolist()},
        "sparsity": sparsity.tolist(),
        "dynamics": None if history is None else {"metrics": str(metrics), "steps": steps,
                                                   # JSON null where a block had no measured head yet
                                                   "mean_sparsity": [[None if math.isnan(v) else v for v in row]
                                                                     for row in history.tolist()]},
        "neighbours": {"cubes": [list(c) for c in usable], "skipped": [list(c) for c in skipped],
                       "overlap": overlap.tolist(), "jaccard": jaccard.tolist(),
                       "mean_overlap": [mean_overlap[c] for c in usable], "threshold": overlap_threshold,
                       "recommended": None if recommended is None else list(recommended)},
        "selection": {"cubes": [list(c) for c in selectable], "tokens": [math.prod(c) for c in selectable],
                      "skipped": [list(c) for c in compared if c not in selectable],
                      "model_cube": list(model_cube), "mass": selection.tolist(),
                      "mean_mass": [mean_selection[c] for c in selectable], "min_tokens": EFFICIENT_CUBE_TOKENS,
                      "recommended": None if for_kernels is None else list(for_kernels)},
    }
    summary = _summary(result)
    write_text_atomic(out / "observations.md", summary)
    write_text_atomic(out / "observations.json", json.dumps(result, indent=1))
    files += ["observations.md", "observations.json"]
    remove_stale_outputs(out, ("neighbours.png", "dynamics.png"), files)
    return {**result, "files": [str(out / f) for f in files], "summary": summary}


def _summary(r: dict) -> str:
    """The markdown of ``observations.md`` from the numbers of ``observe_checkpoint``."""
    pl, loc, nb = r["power_law"], r["locality"], r["neighbours"]
    num_layers = len(r["sparsity"])
    lines = [f"# Attention observations, checkpoint step {r['step']}", "",
             (f"θ = {r['theta']}, grid (T, H, W) = {tuple(r['grid'])}, {r['clips']} held-out clips, "
             f"{r['rows']} sampled query rows per layer (exact softmax over all keys). Positions are raster "
             "(t, h, w) coordinates (grouped order mapped back through the inverse cube permutation)."), "",
             ("| block | power law: queries with top 10% keys ≥ 90% mass | mean mass of top 10% keys | "
             f"log-log slope (top 10% ranks) | critical keys ≤ {NEAR} away | > {FAR} away | mean sparsity | "
             "head sparsity min–max |"),
             "|---|---|---|---|---|---|---|---|"]
    for i in range(num_layers):
        heads = r["sparsity"][i]
        lines.append(f"| {i} | {pl['fraction_of_queries'][i]:.3f} | {pl['mean_top_mass'][i]:.3f} | "
                     f"{pl['log_log_slope'][i]:.2f} | "
                     f"{loc['near_fraction'][i]:.3f} | {loc['far_fraction'][i]:.3f} | "
                     f"{sum(heads) / len(heads):.3f} | {min(heads):.2f}–{max(heads):.2f} |")
    lines += ["", "## Power law (power_law.png)",
              ("Fraction of sampled queries (over clips and heads) whose heaviest 10% of keys hold at least 90% of "
              "the softmax mass; the plot shows the mean sorted weight vs rank per head (first, middle, last block)."),
              "", "## Locality (locality.png)",
              (f"Distance is Chebyshev, max(|dt|, |dh|, |dw|) in tokens. If every key were critical, "
              f"{loc['uniform_near']:.3f} of them would lie ≤ {NEAR} away and {loc['uniform_far']:.3f} > {FAR} away "
              "(red outline in the plot): compare the table against these, not against 0.")]
    if max(r["grid"]) - 1 <= FAR:
        lines.append(f"On this grid no two tokens are more than {max(r['grid']) - 1} apart, so '> {FAR} away' is "
                     "0 by construction; the paper's 16×16×16 latent is needed for that number to mean anything.")
    lines += ["", "## Heterogeneity (heterogeneity.png)",
              "Per-block × per-head sparsity at θ on the sampled rows (the measure of `dsv profile`; both run the "
              "model in its training precision).", "",
              "## Dynamics (dynamics.png)"]
    if r["dynamics"] is None:
        lines.append("No metrics.jsonl found next to the checkpoint: not measured.")
    else:
        dyn = r["dynamics"]
        lines.append(f"Mean per-block profiled sparsity (EMA) from {dyn['metrics']}:")
        lines += ["", "| block | " + " | ".join(f"step {s}" for s in (dyn["steps"][0], dyn["steps"][-1])) + " |",
                  "|---|---|---|"]
        for i in range(len(dyn["mean_sparsity"][0])):
            first, last = (("-" if v is None else f"{v:.3f}") for v in (dyn["mean_sparsity"][0][i],
                                                                         dyn["mean_sparsity"][-1][i]))
            lines.append(f"| {i} | {first} | {last} |")
    lines += ["", "## Neighbours share (neighbours.png)",
              ("Overlap of queries i, j in one cube = |C_i ∩ C_j| / |C_i| (fraction of i's critical keys that j "
              "also has), mean over ordered pairs i ≠ j, measured cubes, clips and heads; Jaccard beside it. "
              "Independent random sets would overlap by about 1 − sparsity (the keep fraction), the chance level.")]
    if nb["skipped"]:
        lines.append("Skipped (one token, or not dividing the grid): "
                     + ", ".join("×".join(map(str, c)) for c in nb["skipped"]) + ".")
    if nb["cubes"]:
        lines += ["", "| block | " + " | ".join("×".join(map(str, c)) for c in nb["cubes"]) + " |",
                  "|---|" + "---|" * len(nb["cubes"])]
        for i in range(num_layers):
            cells = " | ".join(f"{o:.3f} (J {j:.3f})" for o, j in zip(nb["overlap"][i], nb["jaccard"][i]))
            lines.append(f"| {i} | {cells} |")
        lines.append("| mean | " + " | ".join(f"{o:.3f}" for o in nb["mean_overlap"]) + " |")
        if nb["recommended"] is None:
            lines += ["", (f"By the paper's criterion (the largest cube with a mean overlap ≥ {nb['threshold']}): "
                      "no measured cube reaches it.")]
        else:
            index = nb["cubes"].index(nb["recommended"])
            lines += ["", (f"By the paper's criterion: cube {'×'.join(map(str, nb['recommended']))}, the largest "
                      f"with a mean overlap ≥ {nb['threshold']} ({nb['mean_overlap'][index]:.3f}).")]
    lines += _selection_summary(r["selection"])
    return "\n".join(lines) + "\n"


def _cube_name(cube) -> str:
    return "×".join(map(str, cube))


def _selection_summary(sel: dict) -> list[str]:
    """The markdown lines of the cube comparison by selection mass."""
    lines = ["", "## Cube for the kernels (selection mass)",
             ("Mean softmax mass a query keeps when its cube's queries share the exact best key cubes of the same "
              "shape (the kernels' blocks), each head keeping as many as its sparsity at θ leaves: what a perfect "
              "predictor keeps with that cube; mean over sampled rows, clips and heads. The overlap above asks "
              "whether neighbours need the same keys; this asks what one shared selection of whole blocks costs.")]
    if sel["skipped"]:
        lines.append("Skipped (one token, or not dividing the grid): "
                     + ", ".join(_cube_name(c) for c in sel["skipped"]) + ".")
    if not sel["cubes"]:
        return lines
    header = " | ".join(f"{_cube_name(c)} ({t})" for c, t in zip(sel["cubes"], sel["tokens"]))
    lines += ["", f"| block | {header} |", "|---|" + "---|" * len(sel["cubes"])]
    for i, row in enumerate(sel["mass"]):
        lines.append(f"| {i} | " + " | ".join(f"{m:.3f}" for m in row) + " |")
    lines.append("| mean | " + " | ".join(f"{m:.3f}" for m in sel["mean_mass"]) + " |")
    best = sel["recommended"]
    best_mass = sel["mean_mass"][sel["cubes"].index(best)]
    own = sel["mean_mass"][sel["cubes"].index(sel["model_cube"])] if sel["model_cube"] in sel["cubes"] else None
    against = ("" if own is None or best == sel["model_cube"] else
               f"; the model's cube {_cube_name(sel['model_cube'])} keeps {own:.3f}")
    lines += ["", f"**Recommendation:** cube {_cube_name(best)} ({best_mass:.3f}), the most selection mass "
                  f"{recommendation_scope(sel)}{against}."]
    return lines


# ---------------------------------------------------------------------------------------------------- CLI


def _cube(text: str, option: str = "--cubes") -> tuple[int, int, int]:
    try:
        cube = tuple(int(part) for part in text.split(","))
    except ValueError:
        cube = ()
    if len(cube) != 3 or min(cube) < 1:
        raise ValueError(f"{option} entries must be three positive ints t,h,w, got {text!r}")
    return cube


def add_arguments(parser) -> None:
    """Add the options of ``observe_checkpoint`` to an argparse parser (e.g. a ``dsv observe`` subcommand)."""
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    parser.add_argument("--out", default="observations", help="output folder")
    parser.add_argument("--clips", type=int, default=4, help="held-out clips to measure on")
    parser.add_argument("--theta", type=float, default=None, help="critical mass (default: the run's)")
    from dsv.cli import device_name  # here: dsv.cli imports this module

    parser.add_argument("--device", type=device_name, default="auto")
    parser.add_argument("--cubes", nargs="+", default=[",".join(map(str, c)) for c in DEFAULT_CUBES],
                        metavar="T,H,W", help="query cubes for the neighbours-share measurement")
    parser.add_argument("--overlap-threshold", type=float, default=0.8,
                        help="the paper's criterion: the largest cube whose mean overlap reaches this")
    parser.add_argument("--selection-cubes", nargs="+", default=[",".join(map(str, c)) for c in SELECTION_CUBES],
                        metavar="T,H,W", help="cube shapes compared by selection mass (the model's own is added)")
    parser.add_argument("--rows", type=int, default=256, help="sampled query rows per layer")


def run(args) -> int:
    """Run ``observe_checkpoint`` from parsed ``add_arguments`` options; print the summary and the files."""
    result = observe_checkpoint(args.checkpoint, args.out, device=args.device, clips=args.clips, theta=args.theta,
                                cube_shapes=tuple(_cube(c) for c in args.cubes),
                                overlap_threshold=args.overlap_threshold, rows=args.rows,
                                selection_cubes=tuple(_cube(c, "--selection-cubes") for c in args.selection_cubes))
    print(result["summary"])
    print("wrote: " + ", ".join(result["files"]))
    return 0
