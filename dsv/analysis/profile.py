"""`dsv profile`: per-layer × per-head sparsity and recall of a checkpoint, as heatmaps and a table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from dsv.analysis.checkpointed_model import load_model, run_precision  # noqa: E402
from dsv.analysis.figures import save_figure  # noqa: E402
from dsv.ops import head_sparsity, index_recall, keep_blocks_from_sparsity, oracle_index, window_index  # noqa: E402
from dsv.ops.measure import check_theta, jittered_query_rows, recall_at_equal_keep  # noqa: E402
from dsv.train.checkpoint import write_text_atomic  # noqa: E402
from dsv.train.data import build_dataset  # noqa: E402
from dsv.train.durable import check_folder_possible  # noqa: E402


class _Recorder:
    """Observer for every DSVAttention: exact sparsity and the recall of the layer's own selection, at a budget
    from this measurement (comparable across layers whatever their state) or, with `own_budgets`, at the
    layer's dispatched budget (what it keeps when it runs sparse, as in sampling); with `granularity_keep`,
    also the oracle recall of token-level vs block-level selection at equal kept fractions; with `window`, in
    every layer the attention mass inside the window baseline's boxes (`attention.window_frac`) beside the mass
    the exact top key blocks and (DSV layers) the layer's own selection keep at the window's budget. Every
    statistic of a call uses the same ``jittered_query_rows`` (about one row in ``stride``), drawn afresh per
    call from a generator seeded with ``seed``."""

    def __init__(self, theta: float, stride: int, granularity_keep: tuple[float, ...] = (), seed: int = 0,
                 own_budgets: bool = False, window: bool = False):
        self.theta, self.stride = theta, stride
        self.granularity_keep = granularity_keep
        self.own_budgets = own_budgets
        self.window = window
        self.generator = torch.Generator().manual_seed(seed)
        self.sparsity: dict[int, list[torch.Tensor]] = {}
        self.recall: dict[int, list[torch.Tensor]] = {}
        self.granularity: dict[tuple[float, int], list[float]] = {}
        # {"window" | "oracle" | "selection": {layer: [[H] recall per call]]}, and the window's kept fraction.
        self.at_window_budget: dict[str, dict[int, list[torch.Tensor]]] = {}
        self.window_kept: float | None = None

    def __call__(self, layer, hidden, q, k, grid) -> None:
        rows = jittered_query_rows(q.shape[2], self.stride, self.generator, device=q.device)
        for keep in self.granularity_keep:
            kv_blocks = (1, layer.cfg.group_size)
            by_block = recall_at_equal_keep(q, k, keep, layer.cfg.group_size, kv_blocks, rows, layer.scale)
            for kv_block, recall in by_block.items():
                self.granularity.setdefault((keep, kv_block), []).append(float(recall.mean()))
        sparsity = head_sparsity(q, k, rows, self.theta, scale=layer.scale)
        self.sparsity.setdefault(layer.layer_index, []).append(sparsity.float().cpu())
        if self.window:
            self._record_window_budget(layer, hidden, q, k, grid, rows)
        if layer.cfg.mode == "dense":
            return
        # Budget from this measurement (and the layer's recall boost), so that recall is comparable across
        # layers whatever their state; None: the layer's dispatched budget.
        keep_blocks = None if self.own_budgets else keep_blocks_from_sparsity(
            sparsity, -(-q.shape[2] // layer.cfg.key_block), layer.cfg.keep_floor_blocks,
            layer.budget_margin(layer.keep_boost))
        index = layer.compute_index(hidden, q, k, grid, keep_blocks=keep_blocks)
        recall = index_recall(q, k, index, rows, scale=layer.scale).mean(0)
        self.recall.setdefault(layer.layer_index, []).append(recall.float().cpu())

    def _record_window_budget(self, layer, hidden, q, k, grid, rows) -> None:
        """Why a fixed local pattern does or does not lose against a learned one on this model: the mass the
        window's boxes hold against the most any selection of as many key blocks can hold (the exact top
        blocks per query cube) and what the layer's predictor picks with that many blocks."""
        cfg = layer.cfg
        batch, heads, seq_len = q.shape[:3]
        window = window_index(tuple(grid), cfg.cube, cfg.key_block, batch, heads, cfg.window_frac)
        window = dataclasses.replace(window, indices=window.indices.to(q.device), counts=window.counts.to(q.device))
        blocks = window.indices.shape[-1]  # every cube's box holds the same number of key blocks
        self.window_kept = blocks / -(-seq_len // cfg.key_block)
        keep = torch.full((heads,), blocks, dtype=torch.int32)
        indices = {"window": window,
                   "oracle": oracle_index(q, k, keep.to(q.device), cfg.group_size, cfg.key_block, scale=layer.scale)}
        if cfg.mode == "dsv":
            indices["selection"] = layer.compute_index(hidden, q, k, grid, keep_blocks=keep)
        for name, index in indices.items():
            recall = index_recall(q, k, index, rows, scale=layer.scale).mean(0)
            self.at_window_budget.setdefault(name, {}).setdefault(layer.layer_index, []).append(recall.float().cpu())


def heatmap(matrix: torch.Tensor, title: str, path: Path, vmin: float, vmax: float) -> None:
    fig, ax = plt.subplots(figsize=(1.0 + 0.5 * matrix.shape[1], 1.0 + 0.4 * matrix.shape[0]))
    image = ax.imshow(matrix.numpy(), cmap="viridis", vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("block")
    ax.set_title(title)
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_yticks(range(matrix.shape[0]))
    for i in range(matrix.shape[0]):
        for j in range(matrix.shape[1]):
            ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(image, ax=ax)
    save_figure(fig, path, dpi=120)


def _mean_by_layer(recorded: dict[int, list[torch.Tensor]]) -> torch.Tensor | None:
    """[layers, heads]: each layer's recorded statistic averaged over calls (None if nothing was recorded)."""
    return torch.stack([torch.stack(v).mean(0) for _, v in sorted(recorded.items())]) if recorded else None


def _plot_by_noise_level(by_level: list[dict], sparse_blocks: list[int], path: Path) -> None:
    """Recall of each sparse block's own selection, and each block's sparsity, against the noise level."""
    levels = [entry["t"] for entry in by_level]
    fig, (recall_ax, sparsity_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for block in sparse_blocks:
        recall_ax.plot(levels, [entry["recall"][block] for entry in by_level], marker="o", ms=3, label=f"block {block}")
    for block in range(len(by_level[0]["sparsity"])):
        sparsity_ax.plot(levels, [entry["sparsity"][block] for entry in by_level], marker="o", ms=3,
                         label=f"block {block}")
    for ax, title in ((recall_ax, "recall of the sparse blocks' own selection"), (sparsity_ax, "sparsity")):
        ax.set_xlabel("noise level t (1: pure noise; sampling runs 1 → 0)")
        ax.set_ylim(0, 1)
        ax.set_title(title)
        if ax.lines:
            ax.legend(fontsize=6, ncol=2)
    save_figure(fig, path, dpi=120)


WINDOW_BUDGET_COLUMNS = {"window": "window's boxes", "oracle": "exact top blocks",
                         "selection": "predictor's selection"}


def remove_stale_outputs(out: Path, optional: tuple[str, ...], written: list[str]) -> None:
    """Delete the optional files of `out` that this call did not write: left from an earlier call into the same
    folder, a plot would contradict the JSON beside it."""
    for name in set(optional) - set(written):
        (out / name).unlink(missing_ok=True)


def window_budget_lines(window_budget: dict, theta: float) -> list[str]:
    """Markdown: per block the attention mass that the window baseline's boxes, the exact top key blocks and (DSV
    runs) the layer's own selection keep, all with the window's number of key blocks per query cube."""
    names = [name for name in WINDOW_BUDGET_COLUMNS if name in window_budget]
    means = {name: sum(window_budget[name]) / len(window_budget[name]) for name in names}
    lines = ["", f"Attention mass kept at the window baseline's budget ({window_budget['kept_fraction']:.0%} of the "
             f"key blocks per query cube, window_frac {window_budget['window_frac']:.3g}), mean over heads; θ = "
             f"{theta}. Mean over blocks: " + ", ".join(f"{WINDOW_BUDGET_COLUMNS[n]} {means[n]:.3f}" for n in names)
             + ".", "", "| block | " + " | ".join(WINDOW_BUDGET_COLUMNS[n] for n in names) + " |",
             "|---|" + "---|" * len(names)]
    lines += [f"| {i} | " + " | ".join(f"{window_budget[n][i]:.3f}" for n in names) + " |"
              for i in range(len(window_budget["window"]))]
    return lines


def check_clips_and_theta(clips: int, theta: float | None) -> None:
    """ValueError unless ``clips >= 1`` and ``theta`` is None (the run's) or a critical mass in (0, 1)."""
    if isinstance(clips, bool) or not isinstance(clips, int) or clips < 1:
        raise ValueError(f"clips must be an integer >= 1, got {clips!r}")
    if theta is not None:
        check_theta(theta)


def heldout_clips(cfg, clips: int) -> torch.Tensor:
    """The first ``clips`` clips of the run's held-out batch; ValueError when it holds fewer."""
    x0 = build_dataset(cfg.data).heldout_batch()
    if clips > x0.shape[0]:
        raise ValueError(f"clips={clips}, but the checkpoint's run holds out {x0.shape[0]} clips "
                         f"(data.heldout_clips={cfg.data.heldout_clips}); pass at most {x0.shape[0]}")
    return x0[:clips]


@torch.no_grad()
def profile_checkpoint(checkpoint: str, out_dir: str, device: str = "auto", clips: int = 8,
                       theta: float | None = None, stride: int = 4,
                       granularity_keep: tuple[float, ...] = (), noise_levels: tuple[float, ...] = (),
                       window: bool = False) -> dict:
    """Sparsity and recall of every layer of a checkpoint on ``clips`` held-out clips, each at a random noise
    level; with ``window``, also every layer's attention mass inside the window baseline's boxes against the
    exact top key blocks and (DSV runs) the layer's own selection at the window's budget; with ``noise_levels``,
    also per level (every clip noised to that t) each layer's sparsity and, for
    the layers that run sparse, the recall of their selection at their dispatched budget: the keys sparse
    sampling keeps at its step of that t (approximately: sampling's inputs are the model's own trajectory,
    these are held-out clips noised to t, the same distribution at t = 1 only)."""
    check_clips_and_theta(clips, theta)
    if any(not 0.0 <= level <= 1.0 for level in noise_levels):
        raise ValueError(f"noise_levels (--noise-levels) must lie in [0, 1] (t of x_t = (1 - t) x0 + t noise), "
                         f"got {noise_levels}")
    check_folder_possible(out_dir, "--out")  # before the model runs, not after
    model, cfg, step = load_model(checkpoint, device)
    dev = next(model.parameters()).device
    theta = cfg.attention.theta if theta is None else theta
    x0 = heldout_clips(cfg, clips).to(dev)
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(x0.shape[0], generator=gen).to(dev)
    noise = torch.randn(x0.shape, generator=gen).to(dev)

    def observed_forward(t: torch.Tensor, recorder: _Recorder) -> None:
        for layer in model.controller.layers:
            layer.observer = recorder
        tb = t.view(-1, 1, 1, 1, 1)
        with run_precision(cfg, dev):
            model((1 - tb) * x0 + tb * noise, t)
        for layer in model.controller.layers:
            layer.observer = None

    recorder = _Recorder(theta, stride, granularity_keep, window=window)
    observed_forward(t, recorder)
    sparse_blocks = [i for i, layer in enumerate(model.controller.layers) if layer.runs_sparse()]
    by_level = []
    for level in noise_levels:
        at_level = _Recorder(theta, stride, own_budgets=True)
        observed_forward(torch.full_like(t, level), at_level)
        level_recall = _mean_by_layer(at_level.recall)
        # Recall only where the layer runs sparse: a dense-dispatched layer keeps every key when sampling.
        by_level.append({"t": level, "sparsity": _mean_by_layer(at_level.sparsity).mean(1).tolist(),
                         "recall": [float(level_recall[i].mean()) if i in sparse_blocks else None
                                    for i in range(len(model.controller.layers))]})

    sparsity = _mean_by_layer(recorder.sparsity)
    recall = _mean_by_layer(recorder.recall)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    heatmap(sparsity, f"sparsity at θ={theta} (step {step})", out / "sparsity.png", 0.0, 1.0)
    files = ["sparsity.png"]
    if recall is not None:
        heatmap(recall, f"recall of the {cfg.attention.mode} selection (step {step})", out / "recall.png", 0.0, 1.0)
        files.append("recall.png")
    # Sparsity depends on the noise level: say which, since a training log's profile saw other clips and levels.
    lines = [f"# Attention profile, checkpoint step {step}, mode {cfg.attention.mode}, θ = {theta}, "
             f"{x0.shape[0]} held-out clips", "",
             "Each clip at its own random noise level (x_t = (1 - t) x0 + t noise), t = "
             + ", ".join(f"{level:.2f}" for level in t.tolist()) + ".", "",
             "| block | path | sparse | mean sparsity | per-head sparsity | mean recall |",
             "|---|---|---|---|---|---|"]
    for i, layer in enumerate(model.controller.layers):
        heads = " ".join(f"{s:.2f}" for s in sparsity[i].tolist())
        mean_recall = "-" if recall is None else f"{recall[i].mean():.3f}"
        lines.append(f"| {i} | {layer.last_path} | {layer.runs_sparse()} | {sparsity[i].mean():.3f} | {heads} | "
                     f"{mean_recall} |")
    granularity = []
    if recorder.granularity:
        lines += ["", "Oracle recall (exact per-group top mass) at equal kept fraction, mean over blocks and heads: "
                  "token-level selection vs whole key cubes.", "",
                  "| kept fraction | token-level (kv_block 1) | key cubes (kv_block = cube) |", "|---|---|---|"]
        group = cfg.attention.group_size
        for keep in granularity_keep:
            token = sum(recorder.granularity[(keep, 1)]) / len(recorder.granularity[(keep, 1)])
            cube = sum(recorder.granularity[(keep, group)]) / len(recorder.granularity[(keep, group)])
            lines.append(f"| {keep:.2f} | {token:.3f} | {cube:.3f} |")
            granularity.append({"kept_fraction": keep, "token_level": token, "key_cubes": cube, "cube_tokens": group})
    at_window = {name: _mean_by_layer(by_layer).mean(1).tolist()
                 for name, by_layer in recorder.at_window_budget.items()}
    window_budget = None
    if at_window:
        window_budget = {"kept_fraction": recorder.window_kept, "window_frac": cfg.attention.window_frac, **at_window}
        lines += window_budget_lines(window_budget, theta)
    if by_level:
        lines += ["", "By noise level (every clip noised to t; t = 1 is pure noise, sampling runs from 1 to 0): mean "
                  "sparsity, and the attention mass kept by each sparse block's selection at its dispatched budget "
                  "(what sparse sampling keeps at its step of that t)"
                  + ("." if sparse_blocks else "; no block runs sparse."), ""]
        head = ["t", "mean sparsity", *(f"recall block {b}" for b in sparse_blocks)]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join([f"{entry['t']:.2f}", f"{sum(entry['sparsity']) / len(entry['sparsity']):.3f}",
                                     *(f"{entry['recall'][b]:.3f}" for b in sparse_blocks)]) + " |"
                  for entry in by_level]
        _plot_by_noise_level(by_level, sparse_blocks, out / "by_noise_level.png")
        files.append("by_noise_level.png")
    write_text_atomic(out / "profile.md", "\n".join(lines) + "\n")
    result = {"step": step, "theta": theta, "clips": x0.shape[0], "noise_levels": t.tolist(),
              "sparsity": sparsity.tolist(),
              "recall": None if recall is None else recall.tolist(), "granularity": granularity,
              "sparse_blocks": sparse_blocks, "by_noise_level": by_level, "window_budget": window_budget}
    write_text_atomic(out / "profile.json", json.dumps(result, indent=1))
    files += ["profile.md", "profile.json"]
    remove_stale_outputs(out, ("recall.png", "by_noise_level.png"), files)
    return {**result, "files": [str(out / f) for f in files], "table": "\n".join(lines)}
