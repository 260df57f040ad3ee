"""Noise-level budgets for sparse sampling: the calibration's budgets keep the mass it reports at each level, a
sampler's step attends with its level's budgets (sparse or dense), and the layers return to their dispatched
state after sampling."""

import dataclasses
import json
import warnings

import pytest
import torch

from dsv.analysis.checkpointed_model import load_model
from dsv.analysis.noise_budgets import (
    NoiseLevelBudgets,
    _BudgetSearch,
    _smallest_meeting,
    calibrate_noise_level_budgets,
    noise_level_budgets,
)
from dsv.analysis.sample import generate
from dsv.cli import main
from dsv.modules.dit import sample_euler
from dsv.ops import index_recall
from dsv.ops.measure import jittered_query_rows
from dsv.train.data import build_dataset
from dsv.train.trainer import Trainer
from tests.train.test_training import tiny_config

LEVELS = (0.2, 0.6, 1.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny DSV run in stage 2 (switched after its first step, both blocks sparse) and one still in stage 1."""
    root = tmp_path_factory.mktemp("runs")
    for name, switch in (("stage2", 1), ("stage1", 100)):
        Trainer(tiny_config(root / name, "train.steps=2", "train.ckpt_every=2",
                            f"attention.max_stage1_steps={switch}"), quiet=True).run()
    return root


def _clips(cfg, count=2):
    return build_dataset(cfg.data).sample(count, torch.Generator().manual_seed(1))


def test_smallest_meeting_takes_per_head_the_least_budget_that_met_else_the_widest():
    pairs = [([0.2, 0.2, 0.2], [0.70, 0.90, 0.50]), ([0.4, 0.1, 0.3], [0.86, 0.75, 0.60]),
             ([0.3, 0.5, 0.6], [0.84, 0.95, 0.70])]
    tried = [(torch.tensor(k, dtype=torch.float64), torch.tensor(m, dtype=torch.float64)) for k, m in pairs]
    keep, recall = _smallest_meeting(tried, 0.8)
    # Head 0: 0.4 and 0.3 met, 0.3 is smaller; head 1: 0.2 and 0.5 met (0.1 did not); head 2: none met, widest 0.6.
    assert keep.tolist() == [0.3, 0.2, 0.6] and recall.tolist() == [0.84, 0.90, 0.70]


def test_budget_search_brackets_then_bisects_to_the_least_boost_that_meets():
    thresholds = torch.tensor([0.3137, -0.2, 2.0], dtype=torch.float64)  # the last head never meets
    search = _BudgetSearch(torch.zeros(3, dtype=torch.float64))
    for _ in range(9):
        search.step(search.boost >= thresholds)
    # Head 0: misses at 0, 0.05, 0.15, meets at 0.35, then five halvings of the 0.2 bracket: within 0.00625.
    assert 0.0 <= float(search.met_at[0] - thresholds[0]) <= 0.2 / 2**5
    assert 0.0 <= float(search.met_at[1] - thresholds[1]) <= 0.2 / 2**5
    assert float(search.boost[2]) == 1.0 and search.met_at[2] == float("inf")  # widened to every key


def test_calibrated_budgets_keep_the_mass_they_report_at_each_level(runs):
    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    layers = model.controller.layers
    clips = _clips(cfg)
    low = calibrate_noise_level_budgets(model, clips, 0.5, levels=LEVELS, stride=2)
    high = calibrate_noise_level_budgets(model, clips, 0.95, levels=LEVELS, stride=2)
    assert low.levels == list(LEVELS) and len(low.keep) == len(LEVELS)
    assert all(layer._step_budget is None and layer.observer is None for layer in layers)  # left as dispatched
    for i in range(len(LEVELS)):
        for j, layer in enumerate(layers):
            assert len(low.keep[i][j]) == layer.heads
            # Every head meets each target (searched up to every key, which keeps the whole mass).
            assert low.mass[i][j] >= 0.5 and high.mass[i][j] >= 0.95
            # A higher target never takes a smaller budget.
            assert all(h >= lo for h, lo in zip(high.keep[i][j], low.keep[i][j]))

    # Re-measured with the layers set to a level's budgets, in the calibration's dense forward (all rows, this
    # time): the selection of each layer keeps about the mass the calibration reported for it.
    level = 1
    remeasured = {}

    def measure(layer, hidden, q, k, grid):
        index = layer.compute_index(hidden, q, k, grid)
        expected = torch.tensor(low.keep[level][layer.layer_index]) * index.num_kv_blocks
        assert torch.equal(index.counts.amax(dim=(0, 2)).double(), expected.round())
        rows = jittered_query_rows(q.shape[2], 1, torch.Generator().manual_seed(0))
        remeasured[layer.layer_index] = float(index_recall(q, k, index, rows, scale=layer.scale).mean())

    for j, layer in enumerate(layers):
        layer.set_step_budget(low.keep[level][j], sparse=False)
        layer.observer = measure
    t = LEVELS[level]
    noise = torch.randn(clips.shape, generator=torch.Generator().manual_seed(0))  # the calibration's (seed 0)
    with torch.no_grad():
        model((1 - t) * clips + t * noise, torch.full((clips.shape[0],), t))
    # Tolerance: the calibration averaged over one row in two; these numbers use every row.
    assert remeasured == pytest.approx(dict(enumerate(low.mass[level])), abs=0.03)


def test_each_sampling_step_attends_with_its_levels_budget_sparse_or_dense(runs):
    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    layers = model.controller.layers
    heads = layers[0].heads
    # Hand-made budgets: layer 0 sparse at high noise only, with one key block more per head than at t = 0.
    budgets = NoiseLevelBudgets(
        levels=[0.0, 1.0],
        keep=[[[0.25] * heads, [0.5] * heads], [[0.375] * heads, [0.5] * heads]],
        sparse=[[False, True], [True, True]], mass=[[0.9, 0.9], [0.9, 0.9]], missed_heads=[0, 0], kept_mass=0.9,
        clips=1, seconds=0.0)
    seen = []
    for layer in layers:
        attend = layer.attend

        def record(q, k, v, index, layer=layer, attend=attend):
            seen.append((layer.layer_index, None if index is None else int(index.counts.max()), index.num_kv_blocks
                         if index is not None else None))
            return attend(q, k, v, index)

        layer.attend = record
    noise = torch.randn(1, cfg.model.in_channels, cfg.data.frames, cfg.data.size, cfg.data.size,
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), noise_level_budgets(model, budgets) as before_step:
        sample_euler(model, noise, 4, before_step=before_step)  # t = 1, 0.75, 0.5, 0.25
    blocks = seen[0][2] or seen[1][2]
    by_step = [seen[2 * i:2 * i + 2] for i in range(4)]
    for step, ((_, counts0, _), (_, counts1, _)) in enumerate(by_step):
        high_noise = step < 2  # t = 1.0 and 0.75 take level 1.0; 0.5 ties to the first level, 0.25 takes 0.0
        assert counts0 == (round(0.375 * blocks) if high_noise else None), step
        assert counts1 == round(0.5 * blocks), step
    assert all(layer._step_budget is None for layer in layers)
    # Back to the dispatched state: the same samples as sampling without budgets, before and after.
    plain = generate(model, cfg, 1, 2, seed=0)[0]
    with_and_back = generate(model, cfg, 1, 2, seed=0, budgets=budgets)[0]
    assert not torch.equal(plain, with_and_back)
    assert torch.equal(plain, generate(model, cfg, 1, 2, seed=0)[0])


def test_budgets_are_refused_where_they_cannot_apply(runs):
    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    layer = model.controller.layers[0]
    for keep in ([0.5], [0.0] * layer.heads, [1.5] * layer.heads):
        with pytest.raises(ValueError, match=f"keep_fraction must hold {layer.heads} kept fractions"):
            layer.set_step_budget(keep)
    wrong = NoiseLevelBudgets([1.0], [[[0.5] * (layer.heads + 1)] * 2], [[True, True]], [[0.9, 0.9]], [0], 0.9, 1, 0.0)
    with pytest.raises(ValueError, match="calibrated for another model"):
        with noise_level_budgets(model, wrong):
            pass
    short = NoiseLevelBudgets([1.0], [[[0.5] * layer.heads] * 2], [[True]], [[0.9, 0.9]], [0], 0.9, 1, 0.0)
    with pytest.raises(ValueError, match=r"\(1 sparse flags, 2 masses\)"):
        with noise_level_budgets(model, short):
            pass
    with pytest.raises(ValueError, match=r"2 levels but tables of \{'keep': 1"):
        with noise_level_budgets(model, dataclasses.replace(short, levels=[0.5, 1.0])):
            pass
    for kept_mass in (0.0, 1.2):
        with pytest.raises(ValueError, match="kept_mass must be a share of the attention mass"):
            calibrate_noise_level_budgets(model, _clips(cfg), kept_mass, levels=LEVELS)
    stage1, cfg1, _ = load_model(str(runs / "stage1"), "cpu")
    with pytest.raises(ValueError, match="in stage 1"):
        calibrate_noise_level_budgets(stage1, _clips(cfg1), 0.95, levels=LEVELS)
    dense, _, _ = load_model(str(runs / "stage2"), "cpu", attention_mode="dense")
    with pytest.raises(ValueError, match="has no per-head budget"):
        dense.controller.layers[0].set_step_budget([0.5] * layer.heads)


def test_sample_cli_calibrates_and_reports_the_budgets(runs, tmp_path, capsys):
    checkpoint = str(runs / "stage2")
    out = tmp_path / "s.gif"
    for extra, message in ((["--kept-mass", "0.9"], "add --noise-level-budgets"),
                           (["--noise-level-budgets"], "needs --kept-mass")):
        assert main(["sample", "--checkpoint", checkpoint, "--out", str(out), "--num", "1", "--steps", "2",
                     "--device", "cpu", *extra]) == 2
        assert message in capsys.readouterr().err and not out.exists()
    assert main(["sample", "--checkpoint", checkpoint, "--out", str(out), "--num", "1", "--steps", "2",
                 "--device", "cpu", "--noise-level-budgets", "--kept-mass", "0.9", "--calibration-clips",
                 "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    levels = result["noise_level_budgets"]
    assert [row["t"] for row in levels] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    for row in levels:
        assert set(row["sparse_layers"]) <= {0, 1}
        assert row["mean_keep"] is None or 0 < row["mean_keep"] <= 1
        assert row["mean_mass"] is None or row["mean_mass"] >= 0.9
    assert out.stat().st_size > 0


def test_the_speed_model_decides_sparse_at_the_sampling_batch(runs):
    """Where a speed model applies (the Triton backend on a GPU), a level runs a layer sparse as the model predicts
    for the sampling batch, not the calibration's."""
    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    asked = []
    for layer in model.controller.layers:
        def pays(keep, margin=0.0, batch=None, index=layer.layer_index):
            asked.append(batch)
            return (index == 0 and float(keep.mean()) < 0.99), "speed model"
        layer.sparse_pays = pays
    budgets = calibrate_noise_level_budgets(model, _clips(cfg), 0.5, sampling_batch=64, levels=LEVELS, stride=2)
    assert set(asked) == {64} and len(asked) == len(LEVELS) * len(model.controller.layers)
    assert budgets.sparse == [[True, False]] * len(LEVELS)


def test_the_layers_are_restored_when_calibration_or_sampling_fails(runs, monkeypatch):
    import dsv.analysis.noise_budgets as noise_budgets

    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    layers = model.controller.layers
    layers[0].set_step_budget([0.5] * layers[0].heads, sparse=True)
    observer = object()
    layers[1].observer = observer
    for layer in layers:  # as after a sparse sampling step: the calibration's dense forwards would overwrite it
        layer.last_path = "sparse:reference"

    def state():
        return [{name: getattr(layer, name) for name in noise_budgets._MEASURING_RESTORES} for layer in layers]

    before = state()
    assert {"last_path", "_last_backend", "_last_shape", "_step_budget", "observer"} <= set(before[0])
    model.train()
    calibrate_noise_level_budgets(model, _clips(cfg), 0.5, levels=LEVELS, iterations=2)
    assert state() == before and model.training

    def fail(self, layer, hidden, q, k, grid):
        raise RuntimeError("probe failed")

    monkeypatch.setattr(noise_budgets._BudgetProbe, "__call__", fail)
    with pytest.raises(RuntimeError, match="probe failed"):
        calibrate_noise_level_budgets(model, _clips(cfg), 0.5, levels=LEVELS)
    assert state() == before
    assert model.training
    layers[1].observer = None
    heads = layers[0].heads
    budgets = NoiseLevelBudgets([1.0], [[[0.25] * heads] * 2], [[True, True]], [[0.9, 0.9]], [0], 0.9, 1, 0.0)
    with pytest.raises(RuntimeError, match="sampling failed"):
        with noise_level_budgets(model, budgets) as before_step:
            before_step(1.0)
            raise RuntimeError("sampling failed")
    assert all(layer._step_budget is None for layer in layers)


def test_heads_short_of_the_target_are_counted_and_warned_about(runs):
    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # One measurement per level at the trained budget: a mass this close to all of it is out of its reach.
        budgets = calibrate_noise_level_budgets(model, _clips(cfg), 0.99999, levels=(0.5,), iterations=1, stride=2)
    assert budgets.missed_heads[0] > 0 and budgets.summary()[0]["missed_heads"] == budgets.missed_heads[0]
    assert any("heads of sparse layers kept less than kept_mass=0.99999" in str(w.message) for w in caught)


def test_the_quality_bench_samples_no_budgets_for_a_dsv_run_still_in_stage_1(runs, tmp_path):
    """A DSV run that never switched ran dense attention: the bench samples it as trained and densely, and has no
    budgets to calibrate (the report then has no budgets section)."""
    import argparse

    from dsv.bench.quality import budget_lines, sample_runs
    from dsv.bench.sample_store import SampleStore

    args = argparse.Namespace(timing_repeats=1, sample_steps=1, seed=0, sampling_kept_mass=[0.97])
    store = SampleStore(tmp_path, {"videos": 1, "sample_steps": 1, "seed": 0, "machine": "cpu", "source_sha256": "x"})
    samples, sampling = sample_runs({"dsv": runs / "stage1"}, 1, args, torch.device("cpu"), True, store)
    assert list(samples) == ["dsv", "dsv, dense sampling"] and sampling["budgets"] == []
    assert budget_lines(sampling) == ["", "No sampling at noise-level budgets: the DSV run is still in stage 1 (dense "
                                          "attention), nothing to calibrate."]


def test_without_a_speed_model_a_budget_wider_than_the_threshold_runs_dense(runs):
    model, cfg, _ = load_model(str(runs / "stage2"), "cpu")
    for layer in model.controller.layers:  # the tiny runs dispatch at threshold 0; a block at 0.6 keeps 40%
        layer.cfg = dataclasses.replace(layer.cfg, sparse_threshold=0.6)
    narrow = calibrate_noise_level_budgets(model, _clips(cfg), 0.3, levels=(0.5,), stride=2)
    wide = calibrate_noise_level_budgets(model, _clips(cfg), 0.999, levels=(0.5,), stride=2)
    assert all(sum(keep) / len(keep) <= 0.4 for keep in narrow.keep[0]) and narrow.sparse == [[True, True]]
    assert all(sum(keep) / len(keep) > 0.4 for keep in wide.keep[0]) and wide.sparse == [[False, False]]
