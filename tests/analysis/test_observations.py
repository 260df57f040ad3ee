"""The observation statistics on inputs with known answers, and one end-to-end run on a freshly trained tiny model."""

import argparse
import json
import math

import pytest
import torch

import dsv.analysis.observations
import dsv.ops.index
from dsv.analysis.observations import (
    add_arguments,
    critical_distances,
    cube_overlap,
    grid_coords,
    observe_checkpoint,
    power_law_slope,
    recommend_cube,
    recommend_selection_cube,
    run,
    selection_mass,
    sparsity_history,
    to_raster,
    top_mass,
    uniform_distances,
)
from dsv.ops.grouping import cube_permutation
from dsv.train.trainer import Trainer
from tests.train.test_training import tiny_config


def from_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[1, 1, S, S]`` whose scores at scale 1 are ``logits [S, S]`` (q one-hot, so q_i·k_j = k_j[i])."""
    seq_len = logits.shape[0]
    q = torch.eye(seq_len, dtype=torch.float64)
    return q.view(1, 1, seq_len, seq_len), logits.T.contiguous().view(1, 1, seq_len, seq_len)


def chebyshev(grid):
    coords = grid_coords(grid)
    return (coords[:, None] - coords[None]).abs().amax(-1)


def test_grid_coords_and_to_raster_invert_the_grouping():
    grid, cube = (2, 4, 6), (1, 2, 3)
    coords = grid_coords(grid)
    assert coords[(1 * 4 + 2) * 6 + 5].tolist() == [1, 2, 5]
    raster = torch.randn(2, 3, 48, 5)
    perm, _ = cube_permutation(grid, cube)
    assert torch.equal(to_raster(raster.index_select(2, perm), grid, cube), raster)


def test_power_law_row_mass_curve_and_slope():
    seq_len, alpha = 200, 1.5
    weights = torch.arange(1, seq_len + 1, dtype=torch.float64) ** -alpha
    weights /= weights.sum()
    # Every row is the same power law, its ranks scattered over the keys.
    order = torch.stack([torch.randperm(seq_len) for _ in range(seq_len)])
    logits = torch.log(weights)[order]
    q, k = from_logits(logits)
    rows = torch.tensor([0, 17, 199])
    mass, curve = top_mass(q, k, rows, top_fraction=0.1, scale=1.0)
    assert mass.shape == (1, 1, 3)
    torch.testing.assert_close(mass, torch.full_like(mass, float(weights[:20].sum())))
    torch.testing.assert_close(curve[0].double(), weights, rtol=1e-5, atol=1e-9)
    assert power_law_slope(curve[0]) == pytest.approx(-alpha, abs=1e-4)
    flat_mass, _ = top_mass(q, torch.zeros_like(k), rows, top_fraction=0.1, scale=1.0)
    torch.testing.assert_close(flat_mass, torch.full_like(flat_mass, 0.1))


def test_local_keys_lie_near_and_antipodes_far():
    grid = (4, 4, 4)
    dist = chebyshev(grid)
    rows = torch.arange(64)
    q, k = from_logits(20.0 * (dist <= 1).double())
    hist = critical_distances(q, k, rows, grid, theta=0.9, scale=1.0)
    assert hist.shape == (1, 1, 64, 4)
    torch.testing.assert_close(hist.sum(-1), torch.ones(1, 1, 64))
    assert torch.all(hist[..., 2:] == 0)  # every critical key is a neighbour
    coords = grid_coords(grid)
    antipode = ((3 - coords[:, 0]) * 4 + (3 - coords[:, 1])) * 4 + (3 - coords[:, 2])
    q, k = from_logits(20.0 * torch.nn.functional.one_hot(antipode, 64).double())
    hist = critical_distances(q, k, rows, grid, theta=0.9, scale=1.0)
    far = dist[rows, antipode]  # one critical key each, at this distance
    assert torch.equal(hist[0, 0], torch.nn.functional.one_hot(far, 4).float())
    assert far.max() == 3


def test_uniform_baseline_on_a_line():
    # Row 0 of a 1×1×3 grid is 0, 1, 2 from the keys; row 1 is 1, 0, 1.
    baseline = uniform_distances(torch.tensor([0, 1]), (1, 1, 3))
    torch.testing.assert_close(baseline, torch.tensor([1 / 3, 1 / 2, 1 / 6]))


def test_identical_queries_in_a_cube_share_everything():
    grid, cube = (4, 4, 4), (2, 2, 2)
    base = torch.randn(2, 3, 8, 16) * 3.0
    q = to_raster(base.repeat_interleave(8, dim=2), grid, cube)  # one query per cube, copied to its tokens
    k = torch.randn(2, 3, 64, 16)
    overlap, jaccard = cube_overlap(q, k, grid, cube, theta=0.9)
    torch.testing.assert_close(overlap, torch.ones(2, 3))
    torch.testing.assert_close(jaccard, torch.ones(2, 3))
    # A larger cube mixes different queries, so it shares less.
    wider, _ = cube_overlap(q, k, grid, (4, 4, 4), theta=0.9)
    assert bool((wider < 0.99).all())


def test_overlap_of_self_attending_and_of_nested_sets():
    grid = (4, 4, 4)
    q, k = from_logits(20.0 * torch.eye(64, dtype=torch.float64))
    overlap, jaccard = cube_overlap(q, k, grid, (2, 2, 2), theta=0.9, scale=1.0)
    assert float(overlap) == 0.0 and float(jaccard) == 0.0
    # Query 0 needs keys {0, 1}, query 1 only {1}: overlaps 1/2 and 1/1, Jaccard 1/2 both ways.
    q, k = from_logits(torch.tensor([[0.0, 0.0], [0.0, 20.0]], dtype=torch.float64))
    overlap, jaccard = cube_overlap(q, k, (1, 1, 2), (1, 1, 2), theta=0.9, scale=1.0)
    assert float(overlap) == pytest.approx(0.75)
    assert float(jaccard) == pytest.approx(0.5)


def test_chunked_results_equal_one_chunk(monkeypatch):
    grid = (2, 4, 4)
    q, k = torch.randn(2, 2, 32, 8) * 2, torch.randn(2, 2, 32, 8)
    rows = torch.arange(0, 32, 3)
    whole = critical_distances(q, k, rows, grid), cube_overlap(q, k, grid, (2, 2, 2)), top_mass(q, k, rows)
    # A budget of about one row per chunk (cube_overlap still takes whole cubes).
    monkeypatch.setattr(dsv.ops.index, "DEFAULT_CHUNK_BYTES", 2 * 2 * 32 * 48)
    chunked = critical_distances(q, k, rows, grid), cube_overlap(q, k, grid, (2, 2, 2)), top_mass(q, k, rows)
    torch.testing.assert_close(chunked[0], whole[0])
    torch.testing.assert_close(chunked[1], whole[1])
    torch.testing.assert_close(chunked[2], whole[2])


def test_recommend_cube_and_argument_errors():
    overlaps = {(1, 2, 2): 0.95, (2, 2, 2): 0.85, (2, 4, 4): 0.7}
    assert recommend_cube(overlaps, 0.8) == (2, 2, 2)
    assert recommend_cube(overlaps, 0.6) == (2, 4, 4)
    assert recommend_cube(overlaps, 0.99) is None
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="theta"):
        critical_distances(q, q, torch.arange(8), (2, 2, 2), theta=1.5)
    with pytest.raises(ValueError, match="one token"):
        cube_overlap(q, q, (2, 2, 2), (1, 1, 1))
    with pytest.raises(ValueError, match="divisible"):
        cube_overlap(q, q, (2, 2, 2), (1, 1, 3))
    with pytest.raises(ValueError, match="max_cubes"):
        cube_overlap(q, q, (2, 2, 2), (2, 2, 2), max_cubes=0)


def brute_force_selection_mass(q, k, grid, cube, blocks_kept: int, rows, scale):
    """The selection mass written out: dense softmax, each cube's queries sum their probabilities per key cube
    (cubes by raster coordinates), keep the top ``blocks_kept``, average each sampled row's mass inside them."""
    probs = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)  # [B, H, S, S], raster order
    coords = grid_coords(grid)
    per_axis = torch.tensor(grid) // torch.tensor(cube)
    cell = coords // torch.tensor(cube)
    cube_id = (cell[:, 0] * per_axis[1] + cell[:, 1]) * per_axis[2] + cell[:, 2]  # [S]
    members = torch.nn.functional.one_hot(cube_id).to(probs.dtype)  # [S, cubes]
    block_scores = members.T @ probs @ members  # [B, H, query cube, key cube]
    chosen = block_scores.topk(blocks_kept, dim=-1).indices  # [B, H, cubes, n]
    kept = torch.zeros_like(block_scores).scatter_(-1, chosen, 1.0)[:, :, cube_id]  # [B, H, S, key cubes]
    mass = (probs @ members * kept).sum(-1)  # [B, H, S]
    return mass[:, :, rows].mean(-1)


@pytest.mark.parametrize("cube", [(2, 2, 2), (2, 1, 4), (1, 2, 2), (2, 2, 4)])
def test_selection_mass_against_the_written_out_selection_and_interpolated(cube):
    grid = (2, 4, 8)
    perm, inv = cube_permutation(grid, cube)
    assert not torch.equal(perm, inv)  # so that mapping the raster rows the wrong way round fails
    q, k = torch.randn(2, 3, 64, 8, dtype=torch.float64) * 1.5, torch.randn(2, 3, 64, 8, dtype=torch.float64)
    rows, scale = torch.tensor([0, 5, 9, 18, 31, 40, 63]), 8 ** -0.5
    num_blocks = 64 // math.prod(cube)  # 4 to 16
    for kept in (1, 2, 3):  # whole numbers of key cubes: the exact selection
        sparsity = torch.full((3,), 1.0 - kept / num_blocks, dtype=torch.float64)
        expected = brute_force_selection_mass(q, k, grid, cube, kept, rows, scale)
        # float64 throughout: only summation order differs.
        torch.testing.assert_close(selection_mass(q, k, grid, cube, sparsity, rows, scale).double(), expected,
                                   rtol=1e-6, atol=1e-6)  # the result is float32
    # Between whole numbers: the straight line between them, per head.
    sparsity = torch.tensor([1.0 - 1.25 / num_blocks, 1.0 - 2.5 / num_blocks, 1.0 - 0.5 / num_blocks])
    one, two, three = (brute_force_selection_mass(q, k, grid, cube, n, rows, scale) for n in (1, 2, 3))
    expected = torch.stack([one[:, 0] + 0.25 * (two[:, 0] - one[:, 0]), two[:, 1] + 0.5 * (three[:, 1] - two[:, 1]),
                            0.5 * one[:, 2]], dim=1)  # half a key cube: half of one cube's mass (none below it)
    torch.testing.assert_close(selection_mass(q, k, grid, cube, sparsity, rows, scale).double(), expected,
                               rtol=1e-6, atol=1e-6)


def test_selection_mass_favours_the_cube_whose_queries_need_the_same_keys():
    """Every query attends to the frame two ahead of its own: queries of one frame need one frame of keys, so a
    one-frame cube keeps almost all of it with a quarter of the keys, a cube across the four frames a quarter."""
    grid = (4, 4, 4)
    frame = grid_coords(grid)[:, 0]
    logits = 12.0 * (frame[None, :] == (frame[:, None] + 2) % 4).double()
    q, k = from_logits(logits)
    sparsity, rows = torch.tensor([0.75], dtype=torch.float64), torch.arange(64)
    flat = float(selection_mass(q, k, grid, (1, 2, 2), sparsity, rows, scale=1.0))
    across = float(selection_mass(q, k, grid, (4, 1, 1), sparsity, rows, scale=1.0))
    assert flat > 0.99 and across < 0.26
    # The ends: no key kept holds no mass, every key kept all of it.
    for sparsity, mass in ((1.0, 0.0), (0.0, 1.0)):
        kept = selection_mass(q, k, grid, (1, 2, 2), torch.tensor([sparsity], dtype=torch.float64), rows, scale=1.0)
        assert float(kept) == pytest.approx(mass, abs=1e-6)


def test_recommend_selection_cube():
    masses = {(2, 4, 4): 0.95, (4, 4, 4): 0.80, (1, 8, 8): 0.85, (2, 8, 8): 0.85}
    assert recommend_selection_cube(masses) == (2, 8, 8)  # 32 tokens are too few; the tie goes to the larger
    assert recommend_selection_cube(masses, min_tokens=32) == (2, 4, 4)
    assert recommend_selection_cube({(1, 2, 2): 0.9, (2, 2, 2): 0.7}) == (1, 2, 2)  # none large enough: all
    assert recommend_selection_cube({}) is None


def test_sparsity_history_stops_at_the_checkpoint_step(tmp_path):
    """An earlier checkpoint of a run that trained on: its dynamics plot showed steps after it."""
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": step, "layers": [{"sparsity": [0.1 * step, 0.3 * step]}]} for step in (2, 4, 6)]
    metrics.write_text("\n".join(json.dumps(r) for r in [{"step": 3, "loss": 1.0}, *records]) + "\n")
    steps, history = sparsity_history(metrics, up_to_step=4)
    assert steps == [2, 4]
    assert history.flatten().tolist() == pytest.approx([0.4, 0.8])  # per-layer means over heads


def test_sparsity_history_averages_the_measured_heads_only(tmp_path):
    """A head logs None until its first measurement (or after a non-finite one): the layer's mean is that of its
    measured heads, NaN where none is (the sum of a None raised a TypeError)."""
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 2, "layers": [{"sparsity": [None, None]}, {"sparsity": [0.5, None]}]},
               {"step": 4, "layers": [{"sparsity": [0.2, 0.4]}, {"sparsity": [0.6, 0.8]}]}]
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    steps, history = sparsity_history(metrics, up_to_step=4)
    assert steps == [2, 4]
    assert math.isnan(history[0, 0]) and history[0, 1] == pytest.approx(0.5)
    assert history[1].tolist() == pytest.approx([0.3, 0.7])


def test_observe_a_freshly_trained_checkpoint(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, "train.steps=4", "train.ckpt_every=4"), quiet=True).run()
    checkpoint = next((run_dir / "checkpoints").glob("step_*"))  # a checkpoint folder: metrics are 2 levels up
    cubes = ((1, 2, 2), (2, 2, 2), (2, 4, 4), (4, 4, 4), (3, 1, 1))
    result = observe_checkpoint(str(checkpoint), str(tmp_path / "obs"), clips=2, cube_shapes=cubes, rows=64)
    names = {p.split("/")[-1] for p in result["files"]}
    assert names == {"power_law.png", "locality.png", "heterogeneity.png", "neighbours.png", "dynamics.png",
                     "observations.md", "observations.json"}
    assert all((tmp_path / "obs" / name).stat().st_size > 0 for name in names)
    assert result["grid"] == [4, 8, 8] and result["rows"] == 64
    nb = result["neighbours"]
    assert nb["skipped"] == [[3, 1, 1]]
    assert len(nb["overlap"]) == 2 and all(len(row) == 4 for row in nb["overlap"])
    assert all(0.0 < value <= 1.0 for row in nb["overlap"] for value in row)
    passing = [c for c, v in zip(nb["cubes"], nb["mean_overlap"]) if v >= 0.8]
    assert nb["recommended"] == (max(passing, key=math.prod) if passing else None)
    loc = result["locality"]
    assert all(0.0 <= f <= 1.0 for f in loc["near_fraction"])
    assert loc["far_fraction"] == [0.0, 0.0]  # no two tokens of a 4×8×8 grid are more than 7 apart
    assert len(result["dynamics"]["steps"]) == 2  # log_every=2 over 4 steps
    assert "Recommendation" in result["summary"]
    sel = result["selection"]
    assert sel["model_cube"] == [2, 2, 2] and sel["cubes"][0] == [2, 2, 2]  # the model's cube is compared first
    assert sel["skipped"] == [[8, 4, 4]]  # T = 4
    assert len(sel["mass"]) == 2 and all(len(row) == len(sel["cubes"]) for row in sel["mass"])
    assert all(0.0 < value <= 1.0 for row in sel["mass"] for value in row)
    large = [(m, math.prod(c), c) for c, m in zip(sel["cubes"], sel["mean_mass"]) if math.prod(c) >= 64]
    assert sel["recommended"] == max(large)[2]

    # The CLI helpers: a run folder, a single cube, an explicit θ.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(run_dir), "--out", str(tmp_path / "cli"), "--clips", "1",
                              "--cubes", "2,2,2", "--theta", "0.5", "--rows", "16", "--selection-cubes", "1,8,8"])
    assert run(args) == 0
    written = json.loads((tmp_path / "cli" / "observations.json").read_text())
    assert written["theta"] == 0.5 and written["neighbours"]["cubes"] == [[2, 2, 2]]
    assert written["selection"]["cubes"] == [[2, 2, 2], [1, 8, 8]]
    with pytest.raises(ValueError, match="--cubes"):
        run(parser.parse_args(["--checkpoint", str(run_dir), "--cubes", "2,2"]))
    with pytest.raises(ValueError, match="--selection-cubes"):
        run(parser.parse_args(["--checkpoint", str(run_dir), "--selection-cubes", "2,x,2"]))

    # The forward runs in the run's training precision (bf16 autocast on a GPU, where float32 attention would take
    # the PyTorch reference instead of the kernels): here a CPU bf16 autocast stands in for it.
    seen_dtypes = []
    original_call = dsv.analysis.observations._Collector.__call__

    def recording_call(self, layer, hidden, q, k, grid):
        seen_dtypes.append(q.dtype)
        return original_call(self, layer, hidden, q, k, grid)

    monkeypatch.setattr(dsv.analysis.observations._Collector, "__call__", recording_call)
    monkeypatch.setattr(dsv.analysis.observations, "run_precision",
                        lambda cfg, device: torch.autocast("cpu", dtype=torch.bfloat16))
    observe_checkpoint(str(checkpoint), str(tmp_path / "bf16"), clips=1, cube_shapes=((2, 2, 2),), rows=16)
    assert seen_dtypes and set(seen_dtypes) == {torch.bfloat16}
