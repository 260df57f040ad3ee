"""`dsv bench quality` end to end on a tiny CPU setting: three runs, FVD on the real I3D, sparse sampling,
observations, and one report whose numbers are all present and finite."""

import json
import math
import sys
import time

import pytest

from dsv.bench.quality import (
    late_run_means,
    loss_target,
    resolve_train_seeds,
    seed_late_means,
    train_all,
    training_commands,
)
from dsv.cli import main
from tests.eval.test_fvd import needs_i3d

# 10 frames (the I3D needs >= 9) of 16×16 pixels, 1×4×4 patches → a 10×4×4 grid of 160 tokens; DSV switches
# at step 2 and, with threshold 0, runs every block sparse from then on.
TINY = [
    "model.hidden=32", "model.depth=2", "model.heads=2",
    "data.frames=10", "data.size=16", "data.load_short_side=24", "data.heldout_clips=2",
    "attention.cube=2,2,2", "attention.rank=4", "attention.sample_stride=4",
    "attention.profile_every_stage1=2", "attention.profile_every_stage2=2", "attention.sparse_threshold=0.0",
    "attention.min_stage1_steps=0", "attention.max_stage1_steps=2",
    "train.steps=6", "train.batch_size=2", "train.log_every=2", "train.eval_every=3", "train.ckpt_every=6",
    "train.tensorboard=false", "optim.warmup_steps=0", "optim.lr=2e-3",
]


def finite_numbers(value, path="results"):
    """Every number inside a JSON value, with its path; None is allowed (never measured), NaN is not."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from finite_numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from finite_numbers(item, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        assert math.isfinite(value), path
        yield path, value


@needs_i3d
def test_quality_bench_writes_a_complete_report(tmp_path, capsys):
    out = tmp_path / "quality"
    overrides = [item for o in TINY for item in ("--set", o)]
    assert main(["bench", "quality", "--recipe", "debug_cpu", *overrides, "--out", str(out), "--sample-steps", "2",
                 "--bootstrap", "3", "--timing-repeats", "1", "--observe-clips", "1"]) == 0
    capsys.readouterr()

    top = sorted(p.name for p in out.iterdir() if p.is_file())
    assert top == sorted(["report.md", "results.json", "training.json", "losses.png", "sparsity.png",
                          "samples.png", "observations.png", "speed.png"])
    for name in top:
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    numbers = dict(finite_numbers(results))
    assert len(numbers) > 100
    # Written when training ends, before the evaluation: the same held-out table as the final results.
    assert json.loads((out / "training.json").read_text())["heldout"] == results["heldout"]
    # Token-level vs key-cube selection on the trained model: recall grows with the kept fraction.
    granularity = results["granularity"]
    assert [g["kept_fraction"] for g in granularity] == [0.1, 0.25, 0.5]
    for level in ("token_level", "key_cubes"):
        values = [g[level] for g in granularity]
        assert all(0 < v <= 1 for v in values) and values == sorted(values), (level, values)
    assert "## Selection granularity" in (out / "report.md").read_text()

    # Equal budgets: every run evaluated at the same steps, the last one the final step.
    assert [row["step"] for row in results["heldout"]] == [3, 6]
    assert all(0 < row[mode] < 10 for row in results["heldout"] for mode in ("dense", "dsv", "window"))
    assert ({mode: c["steps"] for mode, c in results["curves"].items()}
            == {m: [2, 4, 6] for m in ("dense", "dsv", "window")})
    # DSV went sparse in every block and its recall was measured there.
    assert results["dsv"]["final_sparse_blocks"] == [0, 1]
    assert 0 < results["dsv"]["recall_in_sparse_blocks"] <= 1
    assert (results["sampling"]["dsv_paths"] == ["sparse:reference"]
            and results["sampling"]["dense_paths"] == ["dense:sdpa"])
    assert results["sampling"]["dsv_seconds"] > 0 and 0 < results["sampling"]["ssim"] <= 1
    # FVD: every set measured with a spread; after 6 steps the samples are far from real video, real clips are not.
    fvd = results["fvd"]
    assert set(fvd) == {"dense", "dsv", "dsv, dense sampling", "window", "real training clips"}
    assert all(entry["fvd"] >= 0 and entry["std"] >= 0 for entry in fvd.values())
    assert fvd["real training clips"]["fvd"] < min(fvd[m]["fvd"] for m in ("dense", "dsv", "window"))
    # The real Kinetics-400 I3D sees the cyclist of bikes.mp4 as cycling.
    assert results["i3d_check"][0]["top3"][0][0] in {"riding mountain bike", "riding a bike"}
    assert [t["met"] in (True, False) for t in results["targets"]] == [True] * 4

    report = (out / "report.md").read_text()
    assert "dsv bench quality --recipe debug_cpu" in report and "attention.mode=window" in report
    assert report.count("| met |") + report.count("| **missed** |") == 4


def test_late_run_means_average_the_second_half_of_the_run():
    heldout = [{"step": step, "dense": 1.0 / step, "dsv": 2.0 / step} for step in (100, 200, 300, 400)]
    late = late_run_means(heldout, steps=400)
    assert (late["first"], late["last"], late["count"]) == (300, 400, 2)
    assert math.isclose(late["dense"], (1 / 300 + 1 / 400) / 2) and math.isclose(late["dsv"], 2 * late["dense"])
    # A run evaluated only at its end: the last row alone.
    assert late_run_means(heldout[:1], steps=400) == {"first": 100, "last": 100, "count": 1, "dense": 0.01,
                                                      "dsv": 0.02}


def _heldout(rows):
    return [{"step": step, "dense": dense, "dsv": dsv, "window": window} for step, dense, dsv, window in rows]


def test_loss_target_is_judged_on_the_mean_over_seeds_and_lists_each_seed():
    # Seed 0: DSV +5% over dense in the second half, seed 1: -2% at a dense loss three times higher. The gap
    # of the seed means is -0.25% (met); seed 0 alone (+5%) or the mean of the two gaps (+1.5%) would miss.
    # Steps 100 and 200 lie outside the late window and carry other gaps: the stage-1 noise.
    tables = {"0": _heldout([(100, 2.0, 2.02, 2.2), (200, 1.5, 1.47, 1.6), (300, 1.0, 1.05, 1.2),
                             (400, 1.0, 1.05, 1.2)]),
              "1": _heldout([(100, 4.0, 4.4, 4.4), (200, 3.5, 3.5, 3.9), (300, 3.0, 2.94, 3.3),
                             (400, 3.0, 2.94, 3.3)])}
    late = seed_late_means(tables, steps=400)
    assert (late["first"], late["last"], late["count"]) == (300, 400, 2)
    assert math.isclose(late["dense"], 2.0) and math.isclose(late["dsv"], 1.995) and math.isclose(late["window"], 2.25)
    assert math.isclose(late["dsv_gap"], -0.0025) and math.isclose(late["window_gap"], 0.125)
    per_seed = late["per_seed"]
    assert math.isclose(per_seed["0"]["dsv_gap"], 0.05) and math.isclose(per_seed["1"]["dsv_gap"], -0.02)
    assert math.isclose(per_seed["0"]["window_gap"], 0.2) and math.isclose(per_seed["1"]["window_gap"], 0.1)

    target = loss_target(late, tables, {"0": 100, "1": 200}, "what DSV ran")
    assert target["met"] is True
    assert "then over 2 training seeds" in target["target"]
    assert target["measured"] == ("means over 2 seeds: DSV 1.9950, dense 2.0000: -0.25% (at step 400 alone: -0.25%); "
                                  "per seed: seed 0 +5.00%, seed 1 -2.00% (min -2.00%, max +5.00%)")
    # Each seed's gaps up to its own switch: seed 0 at step 100 only, seed 1 at steps 100 and 200.
    assert target["context"] == ("what DSV ran; in stage 1 (DSV attention dense) the same comparison ranged "
                                 "+1.00%…+1.00% (seed 0, steps ≤ 100), +0.00%…+10.00% (seed 1, steps ≤ 200): "
                                 "the noise of one evaluation")

    # Seed 1 at +2% instead: the seed means are +2.75% apart, missed.
    tables["1"] = [{**row, "dsv": row["dense"] * 1.02} for row in tables["1"]]
    assert loss_target(seed_late_means(tables, steps=400), tables, {"0": 100, "1": None}, "")["met"] is False

    # One seed: the measured text of a one-seed bench, no per-seed list; a run that never switched has no
    # stage-1 comparison.
    one = {"0": tables["0"]}
    target = loss_target(seed_late_means(one, steps=400), one, {"0": None}, "what DSV ran")
    assert target["measured"] == "DSV 1.0500, dense 1.0000: +5.00% (at step 400 alone: +5.00%)"
    assert target["met"] is False and target["context"] == "what DSV ran"
    assert target["target"] == "DSV held-out loss within 1% of dense (mean of the 2 evaluations of steps 300–400)"


def test_each_seed_trains_every_mode_with_its_seed_in_its_own_folder(tmp_path):
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe

    # A train.seed among the overrides is overridden by each run's own seed.
    commands = training_commands("debug_cpu", ["train.steps=6", "train.seed=7"], tmp_path, [3, 1])
    assert list(commands) == ["dense", "dsv", "window", "dense-seed1", "dsv-seed1", "window-seed1"]
    for name, command in commands.items():
        cfg = apply_overrides(get_recipe("debug_cpu"),
                              [command[i + 1] for i, arg in enumerate(command) if arg == "--set"])
        mode, _, seed = name.partition("-seed")
        assert (cfg.train.seed, cfg.attention.mode, cfg.train.steps) == (int(seed or 3), mode, 6), name
        assert cfg.train.out_dir == str(tmp_path / name)


def test_train_seeds_must_be_distinct_and_non_negative(tmp_path, capsys):
    assert resolve_train_seeds(None, recipe_seed=5) == [5]
    assert resolve_train_seeds([2, 0], recipe_seed=5) == [2, 0]
    for seeds, problem in ((["0", "1", "0"], "0 listed more than once"), (["1", "-2"], "got -2")):
        out = tmp_path / f"quality-{'-'.join(seeds)}"
        assert main(["bench", "quality", "--out", str(out), "--train-seeds", *seeds]) == 2
        err = capsys.readouterr().err
        assert f"--train-seeds {' '.join(seeds)}: expected distinct non-negative integers" in err and problem in err
        assert not (out / "runs").exists()  # refused before any training


def test_clips_too_short_for_the_i3d_are_refused_before_training(tmp_path, capsys):
    assert main(["bench", "quality", "--recipe", "debug_cpu", "--out", str(tmp_path / "quality")]) == 2
    assert "the FVD's I3D needs clips of at least 9 frames" in capsys.readouterr().err
    runs = tmp_path / "quality" / "runs"
    assert not runs.exists() or not any(runs.iterdir())  # refused before any training


def test_runs_share_a_gpu_in_waves_of_runs_per_gpu(tmp_path):
    # Three runs that each sleep 1 s: together they end in about 1 s, one after another in about 3 s.
    sleeper = [sys.executable, "-c", "import time; time.sleep(1)"]
    commands = {mode: sleeper for mode in ("dense", "dsv", "window")}
    start = time.perf_counter()
    seconds = train_all(commands, tmp_path, gpus=["0"], runs_per_gpu=3)
    assert sorted(seconds) == ["dense", "dsv", "window"]
    assert time.perf_counter() - start < 2.5  # concurrent: well under the 3 s of a sequential wave
    with pytest.raises(ValueError, match="runs_per_gpu"):
        train_all(commands, tmp_path, gpus=["0"], runs_per_gpu=0)
    with pytest.raises(SystemExit):  # refused by the command line before anything runs
        main(["bench", "quality", "--out", str(tmp_path / "q"), "--runs-per-gpu", "0"])
    assert not (tmp_path / "q").exists()
