"""Noise-level budgets for sparse sampling: for each denoising step, each layer's per-head kept fraction and
whether it runs sparse, calibrated so that its selection keeps a chosen share of the attention mass at that
step's noise level.

Training dispatches one budget per head from the profiler's EMA, measured over the noise levels training draws,
whose selections keep about `recall_target` · θ of the attention mass (0.95 · 0.9 ≈ 0.86 in `quality_gpu`): every
sparse layer drops a tenth or more of each query's attention mass, which is what the training's speed is bought
with. Sampling can choose its own point: calibration noises clips to each level, measures each head's sparsity
there, and searches each head's budget until its selection keeps `kept_mass` of the attention mass; at each level
a layer then runs sparse where the measured kernel speed says that budget beats dense (without a speed model: where
it keeps at most 1 - sparse_threshold of the keys). Measured on an 8192-token model with this calibration's first
form (benchmarks/results/2026-12-01-h200-quality-8192-tokens-seed130): the budgets hardly vary with the level
there, and the kept mass sets how close sparse samples come to dense ones (PSNR 24 dB at the trained budgets,
37 dB at 0.965 of the mass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from dsv.ops import head_sparsity, index_recall, keep_blocks_from_sparsity
from dsv.ops.measure import jittered_query_rows

CALIBRATION_LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""Default noise levels: a sampling step takes the nearest one (25 Euler steps run at t = 1.0, 0.96, …, 0.04)."""


@dataclasses.dataclass
class NoiseLevelBudgets:
    """Calibrated budgets by noise level (t of x_t = (1 - t) x0 + t noise; sampling runs from 1 to 0)."""

    levels: list[float]  # ascending
    keep: list[list[list[float]]]  # [level][layer][head]: kept fraction of the key blocks
    sparse: list[list[bool]]  # [level][layer]
    mass: list[list[float]]  # [level][layer]: attention mass kept at `keep`, mean over heads (measured)
    missed_heads: list[int]  # [level]: heads of sparse layers whose widest measured budget kept less than `kept_mass`
    kept_mass: float  # the calibration's target
    clips: int
    seconds: float  # the calibration's forwards

    def level_index(self, t: float) -> int:
        """The calibrated level nearest to `t` (the lower one where two are as near)."""
        return min(range(len(self.levels)), key=lambda i: abs(self.levels[i] - t))

    def at_level(self, i: int) -> "NoiseLevelBudgets":
        """These budgets with level `i`'s alone, which every step then takes."""
        return dataclasses.replace(self, levels=[self.levels[i]], keep=[self.keep[i]], sparse=[self.sparse[i]],
                                   mass=[self.mass[i]], missed_heads=[self.missed_heads[i]])

    def apply(self, layers: list, t: float) -> None:
        """Set every layer's budget for a step at noise level `t` (`set_step_budget`)."""
        i = self.level_index(t)
        for layer, keep, sparse in zip(layers, self.keep[i], self.sparse[i]):
            layer.set_step_budget(keep, sparse)

    def summary(self) -> list[dict]:
        """Per level: the sparse layers, their mean kept fraction and the mean mass their selections keep."""
        rows = []
        for t, keeps, sparse, mass in zip(self.levels, self.keep, self.sparse, self.mass):
            chosen = [i for i, s in enumerate(sparse) if s]
            rows.append({"t": t, "sparse_layers": chosen,
                         "mean_keep": (sum(sum(keeps[i]) / len(keeps[i]) for i in chosen) / len(chosen)
                                       if chosen else None),
                         "mean_mass": sum(mass[i] for i in chosen) / len(chosen) if chosen else None})
        for row, missed in zip(rows, self.missed_heads):
            row["missed_heads"] = missed
        return rows


def check_budgets_fit(budgets: NoiseLevelBudgets, layers: list) -> None:
    """ValueError unless `budgets` has, at every level, one row per layer of as many heads, one sparse flag and
    one kept mass per layer."""
    tables = {"keep": budgets.keep, "sparse": budgets.sparse, "mass": budgets.mass,
              "missed_heads": budgets.missed_heads}
    lengths = {name: len(table) for name, table in tables.items()}
    if any(length != len(budgets.levels) for length in lengths.values()):
        raise ValueError(f"noise-level budgets hold {len(budgets.levels)} levels but tables of {lengths} rows")
    for level, keeps, sparse, mass in zip(budgets.levels, budgets.keep, budgets.sparse, budgets.mass):
        if (len(keeps) != len(layers) or len(sparse) != len(layers) or len(mass) != len(layers)
                or any(len(k) != layer.heads for k, layer in zip(keeps, layers))):
            raise ValueError(f"noise-level budgets at t={level} hold {[len(k) for k in keeps]} heads per layer "
                             f"({len(sparse)} sparse flags, {len(mass)} masses); the model has "
                             f"{[layer.heads for layer in layers]}: calibrated for another model")


@contextlib.contextmanager
def noise_level_budgets(model, budgets: NoiseLevelBudgets) -> Iterator[Callable[[float], None]]:
    """Yields `before_step(t)` for `sample_euler`, which sets every layer's budget for that step's level; on exit
    every layer returns to its dispatched state."""
    layers = model.controller.layers
    check_budgets_fit(budgets, layers)
    try:
        yield lambda t: budgets.apply(layers, t)
    finally:
        for layer in layers:
            layer.set_step_budget(None)


class _BudgetProbe:
    """Observer: per layer, the sparsity on sampled query rows and the mass kept by the layer's own selection at
    `keep = 1 - sparsity + keep_margin + boost` per head (whole key blocks, at least the floor)."""

    def __init__(self, theta: float, stride: int, boosts: list[torch.Tensor], generator: torch.Generator):
        self.theta, self.stride, self.boosts, self.generator = theta, stride, boosts, generator
        self.measured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer, hidden, q, k, grid) -> None:
        rows = jittered_query_rows(q.shape[2], self.stride, self.generator, device=q.device)
        sparsity = head_sparsity(q, k, rows, self.theta, scale=layer.scale).double().cpu()
        num_blocks = -(-q.shape[2] // layer.cfg.key_block)
        keep_blocks = keep_blocks_from_sparsity(sparsity, num_blocks, layer.cfg.keep_floor_blocks,
                                                layer.cfg.keep_margin + self.boosts[layer.layer_index])
        index = layer.compute_index(hidden, q, k, grid, keep_blocks=keep_blocks)
        mass = index_recall(q, k, index, rows, scale=layer.scale).mean(0).double().cpu()
        self.measured[layer.layer_index] = (keep_blocks.double() / num_blocks, mass)


# What the calibration's dense forwards change on a layer: the step budget, the observer, the last shape and
# backend (which the speed model reads) and the path and reason the trainer and `dsv sample` report.
_MEASURING_RESTORES = ("_step_budget", "observer", "_last_shape", "_last_backend", "backend_reason", "last_path")


@contextlib.contextmanager
def _measuring(layers: list) -> Iterator[None]:
    """Every layer dense (`set_step_budget`) while the calibration measures; afterwards each layer's
    `_MEASURING_RESTORES` as they were."""
    saved = [{name: getattr(layer, name) for name in _MEASURING_RESTORES} for layer in layers]
    try:
        for layer in layers:
            layer.set_step_budget([1.0] * layer.heads, sparse=False)
        yield
    finally:
        for layer, attributes in zip(layers, saved):
            for name, value in attributes.items():
                setattr(layer, name, value)


@torch.no_grad()
def calibrate_noise_level_budgets(model, clips: torch.Tensor, kept_mass: float, sampling_batch: int | None = None,
                                  levels: tuple[float, ...] = CALIBRATION_LEVELS, iterations: int = 8,
                                  stride: int = 16, seed: int = 0, bf16: bool = False) -> NoiseLevelBudgets:
    """Budgets of a stage-2 DSV `model` for sampling `sampling_batch` videos at a time (default: as many as
    `clips`), from `clips` `[N, C, T, H, W]` (in [-1, 1]) noised to each level with one fixed noise; statistics on
    about one query row in `stride`; `bf16`: forwards under bf16 autocast on CUDA, as the run trained and samples.

    Each layer is measured in a dense forward (every layer at full attention), so its kept mass is of exact
    attention on inputs that the other layers' budgets do not move. Per level, `iterations` forwards, each
    measuring every head's kept mass at its current budget: from the trained budget (its recall boost) at the
    first level and the previous level's result after it, steps that double until the target is bracketed, then
    bisection; each head takes the smallest measured budget whose selection kept `kept_mass`, or where none did
    (counted in `missed_heads`, with a warning) the widest measured one. A layer runs sparse at a level where the
    kernel-speed model (training's, fwd+bwd) predicts its mean budget faster than dense at `sampling_batch`, or
    without a model where its mean budget keeps at most `1 - sparse_threshold` of the keys."""
    layers = model.controller.layers
    if model.controller.current_stage != 2:
        raise ValueError("calibrate_noise_level_budgets: the model is in stage 1 (dense attention while its "
                         "predictors learn); sparse sampling has nothing to calibrate")
    modes = {layer.cfg.mode for layer in layers}
    if modes - {"dsv", "oracle"}:
        raise ValueError(f"calibrate_noise_level_budgets: the model's attention modes are {sorted(modes)}; "
                         "noise-level budgets take dsv or oracle layers")
    if not 0.0 < kept_mass <= 1.0:
        raise ValueError(f"kept_mass must be a share of the attention mass in (0, 1], got {kept_mass!r}")
    if not levels or any(not 0.0 <= t <= 1.0 for t in levels):
        raise ValueError(f"levels must be noise levels in [0, 1], got {levels!r}")
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if clips.dim() != 5:
        raise ValueError(f"clips must be [N, C, T, H, W], got {tuple(clips.shape)}")
    sampling_batch = clips.shape[0] if sampling_batch is None else sampling_batch
    if isinstance(sampling_batch, bool) or not isinstance(sampling_batch, int) or sampling_batch < 1:
        raise ValueError(f"sampling_batch must be an integer >= 1 (videos sampled at a time), got {sampling_batch!r}")
    theta = layers[0].cfg.theta  # the critical mass the sparsity is measured at
    dev = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    x0 = clips.to(dev)
    noise = torch.randn(x0.shape, generator=gen).to(dev)
    levels = tuple(sorted(float(t) for t in levels))
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    keep_table, sparse_table, mass_table, missed_table = [], [], [], []
    boosts = [layer.keep_boost.double().cpu() for layer in layers]
    try:
        with _measuring(layers):
            for t in levels:
                searches = [_BudgetSearch(boost) for boost in boosts]
                tried: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in layers]
                for _ in range(iterations):
                    probe = _BudgetProbe(theta, stride, [search.boost for search in searches], gen)
                    for layer in layers:
                        layer.observer = probe
                    tb = torch.full((x0.shape[0],), t, device=dev)
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16 and dev.type == "cuda"):
                        model((1 - t) * x0 + t * noise, tb)
                    for i, (keep, mass) in probe.measured.items():
                        tried[i].append((keep, mass))
                        searches[i].step(mass >= kept_mass)
                keeps, sparse, masses, missed = [], [], [], 0
                for i, layer in enumerate(layers):
                    keep, mass = _smallest_meeting(tried[i], kept_mass)
                    mean_keep = float(keep.mean())
                    pays, _ = layer.sparse_pays(keep, batch=sampling_batch)
                    keeps.append(keep.tolist())
                    # Without a speed model, the dispatch's threshold read as a budget: a block at the threshold
                    # keeps 1 - threshold of the keys, and a wider budget (a high kept mass) is not worth the kernels.
                    sparse.append(bool(mean_keep <= 1.0 - layer.cfg.sparse_threshold if pays is None else pays))
                    masses.append(float(mass.mean()))
                    # A dense layer keeps every key whatever its budget: only sparse layers' heads can fall short.
                    missed += int((mass < kept_mass).sum()) if sparse[-1] else 0
                boosts = [search.solution() for search in searches]
                keep_table.append(keeps)
                sparse_table.append(sparse)
                mass_table.append(masses)
                missed_table.append(missed)
    finally:
        model.train(was_training)
    if any(missed_table):
        warnings.warn(f"noise-level budgets: at some levels heads of sparse layers kept less than "
                      f"kept_mass={kept_mass} at the widest budget measured in {iterations} iterations (missed heads "
                      f"by level {dict(zip(levels, missed_table))}); calibrate_noise_level_budgets(iterations=...) "
                      "searches further", stacklevel=2)
    return NoiseLevelBudgets(list(levels), keep_table, sparse_table, mass_table, missed_table, kept_mass,
                             int(x0.shape[0]), time.perf_counter() - start)


class _BudgetSearch:
    """Per head, the boost on top of `1 - sparsity` that just keeps the target mass (which grows with the boost):
    from `start`, steps of 0.05 that double away from the last result until one boost met the target and one did
    not, then bisection between the closest such pair. Boosts stay in [-1, 1]: at 1 every key is kept."""

    FIRST_STEP = 0.05

    def __init__(self, start: torch.Tensor):
        self.boost = start.clone()
        self.met_at = torch.full_like(start, math.inf)  # the smallest boost that met
        self.missed_at = torch.full_like(start, -math.inf)  # the largest boost that missed
        self.stride = torch.full_like(start, self.FIRST_STEP)

    def step(self, met: torch.Tensor) -> None:
        self.met_at = torch.where(met, torch.minimum(self.met_at, self.boost), self.met_at)
        self.missed_at = torch.where(met, self.missed_at, torch.maximum(self.missed_at, self.boost))
        bracketed = torch.isfinite(self.met_at) & torch.isfinite(self.missed_at)
        outward = torch.where(met, self.boost - self.stride, self.boost + self.stride)
        self.boost = torch.where(bracketed, (self.met_at + self.missed_at) / 2, outward).clamp(-1.0, 1.0)
        self.stride = self.stride * 2

    def solution(self) -> torch.Tensor:
        """The smallest boost that met, or where none did the current one: the start of the next level's search."""
        return torch.where(torch.isfinite(self.met_at), self.met_at, self.boost)


def _smallest_meeting(tried: list[tuple[torch.Tensor, torch.Tensor]], wanted: float) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """Per head, of the measured `(keep [H], kept mass [H])` pairs: the smallest keep whose mass met `wanted`, else
    the largest keep; returns that keep and its mass, `[H]` each."""
    keeps = torch.stack([k for k, _ in tried])  # [tries, H]
    masses = torch.stack([m for _, m in tried])
    met = masses >= wanted
    ranked = torch.where(met, keeps, math.inf)  # met: the smallest keep wins
    best = torch.where(met.any(0), ranked.argmin(0), keeps.argmax(0))
    heads = torch.arange(keeps.shape[1])
    return keeps[best, heads], masses[best, heads]
