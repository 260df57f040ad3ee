"""`dsv bench quality-seeds`: reports of one setting combine by training seed, the targets are judged on the means
over seeds with the per-seed spread, and reports of different settings or a seed counted twice are refused."""

import json
import math
import statistics

import pytest

from dsv.bench.quality_seeds import (
    check_comparable,
    over_seeds,
    resolution,
    seed_rows,
    seeds_to_resolve,
    targets,
    window_margins,
    window_resolution,
)
from dsv.cli import main

COMMAND = "dsv bench quality --recipe quality_gpu --set data.frames=32 --out OUT --seed 0"
# A resolved config (`config_to_dict`'s form) cut to the fields the tests change.
CONFIG = {"attention": {"cube": [4, 4, 4], "dispatch_margin": 0.1}, "train": {"seed": 1, "out_dir": "runs/a"}}


def _report(seeds: dict[str, tuple[float, float, float]], fvd: dict[str, tuple[float, float, float]] | None,
            all_seeds_sampled: bool = True, without_sparse_block: tuple[str, ...] = (), **changes) -> dict:
    """A results.json of `dsv bench quality`: per seed (dense, dsv, window) late-mean losses and FVDs; without
    `all_seeds_sampled`, the form written before the FVD covered every seed (the first seed's FVD alone). Every
    seed's DSV run had 3 of 12 blocks sparse in stage 2, but those of `without_sparse_block`: 0.04 on average and
    none at the end (no sparse block)."""
    per_seed = {seed: dict(zip(("dense", "dsv", "window"), losses)) for seed, losses in seeds.items()}
    fvd_by_seed = {seed: {set_name: {"fvd": value} for set_name, value in zip(("dense", "dsv", "window"), values)}
                   for seed, values in (fvd or {}).items()}
    results = {"recipe": "quality_gpu", "overrides": ["data.frames=32"], "model": "12 blocks", "steps": 1000,
               "batch_size": 8, "videos": 64, "sample_steps": 25, "command": COMMAND, "date": "2026-12-01",
               "machine": "NVIDIA H200", "seeds": [int(s) for s in seeds], "late_means": {"per_seed": per_seed},
               "fvd": next(iter(fvd_by_seed.values())), "dsv": {"final_sparsity": [0.5] * 12},
               "switch_step_by_seed": dict.fromkeys(seeds, 100),
               "mean_sparse_blocks_in_stage2_by_seed": {s: 0.04 if s in without_sparse_block else 3.0 for s in seeds},
               "final_sparse_blocks_by_seed": {s: [] if s in without_sparse_block else [0, 1, 2] for s in seeds}}
    if all_seeds_sampled:
        results["fvd_by_seed"] = fvd_by_seed
    results.update(changes)
    return results


def _with_config(**fields) -> dict:
    """`CONFIG` with ``fields`` (`section={field: value}`) replaced."""
    return {section: {**CONFIG.get(section, {}), **fields.get(section, {})} for section in {**CONFIG, **fields}}


def _quality_seeds(tmp_path, reports: dict[str, dict]) -> tuple[str, dict]:
    """`dsv bench quality-seeds` over ``reports`` (folder name → results.json) written under ``tmp_path``:
    its report.md and results.json."""
    for name, results in reports.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results))
    out = tmp_path / "out"
    assert main(["bench", "quality-seeds", "--results", *(str(tmp_path / name) for name in reports),
                 "--out", str(out)]) == 0
    return (out / "report.md").read_text(), json.loads((out / "results.json").read_text())


def test_the_targets_are_judged_on_the_means_over_seeds_with_the_per_seed_spread():
    reports = [("a", _report({"1": (1.0, 1.02, 1.01), "2": (2.0, 1.98, 2.04)}, {"1": (100, 90, 120)},
                             all_seeds_sampled=False)),
               ("b", _report({"3": (1.0, 1.01, 0.99)}, {"3": (200, 210, 190)}))]
    check_comparable(reports)
    rows = seed_rows(reports)
    assert [rows[s]["report"] for s in "123"] == ["a", "a", "b"]
    assert rows["2"]["fvd"] is None and rows["3"]["fvd"] == {"dense": 200, "dsv": 210, "window": 190}
    loss = over_seeds({seed: row["loss"] for seed, row in rows.items()})
    fvd = over_seeds({seed: row["fvd"] for seed, row in rows.items() if row["fvd"] is not None})
    assert loss["means"]["dsv"] == pytest.approx((1.02 + 1.98 + 1.01) / 3)
    assert loss["gaps"]["dsv"]["of_means"] == pytest.approx((1.02 + 1.98 + 1.01) / 4.0 - 1)
    per_seed = [0.02, -0.01, 0.01]
    assert loss["gaps"]["dsv"]["per_seed"] == pytest.approx(per_seed)
    assert loss["gaps"]["dsv"]["standard_error"] == pytest.approx(statistics.stdev(per_seed) / math.sqrt(3))
    assert fvd["seeds"] == ["1", "3"] and fvd["gaps"]["dsv"]["of_means"] == pytest.approx(300 / 300 - 1)

    loss_row, fvd_row, window_row = targets(loss, fvd, rows)
    assert loss_row["met"] and "+0.25% over 3 seeds" in loss_row["measured"]
    assert fvd_row["met"] and "per seed -10.00%, +5.00%" in fvd_row["measured"]
    # Window: loss +1.0% (worse than both), FVD +3.3% against DSV's 0%: worse in both on the means.
    assert window_row["met"] and "loss: window worst in 1 of 3 seeds; FVD: window worst in 1 of 2 seeds" == \
        window_row["spread"]
    # Met on the means, yet paired by seed the window's margins are -1%, +2%, -2% (loss): not resolved.
    assert window_margins(loss) == pytest.approx([-0.01, 0.02, -0.02])
    assert window_row["resolution"].startswith("loss: not resolved (mean per-seed margin over the worse of dense "
                                               "and DSV -0.33%")
    assert "; FVD: not resolved (" in window_row["resolution"]


def test_window_resolution_pairs_the_window_with_the_worse_of_dense_and_dsv_per_seed():
    # 95% t-quantile with 4 seeds: 3.18.
    def stats(per_seed: dict[str, tuple[float, float, float]]) -> dict:
        return over_seeds({seed: dict(zip(("dense", "dsv", "window"), v)) for seed, v in per_seed.items()})

    # The window 3-5% above dense, DSV at most +1%: margins +2, +4, +3, +5% (mean 3.5%, s.d. 1.29%, ±2.05%).
    worse = stats({"1": (1.0, 1.01, 1.03), "2": (1.0, 0.99, 1.04), "3": (1.0, 1.0, 1.03), "4": (1.0, 1.0, 1.05)})
    assert window_margins(worse) == pytest.approx([0.02, 0.04, 0.03, 0.05])
    assert window_resolution(worse) == ("resolved: worse than both (mean per-seed margin over the worse of dense "
                                        "and DSV +3.50%, +1.4%…+5.6%)")
    # Below dense in every seed: resolved the other way.
    better = stats({s: (1.0, 1.0, 0.97 - 0.01 * int(s)) for s in "1234"})
    assert window_resolution(better).startswith("resolved: not worse than both (mean per-seed margin over the "
                                                "worse of dense and DSV -5.50%")
    # Worse than dense where DSV is worse still: no margin in that seed, though the means may say "worse".
    assert window_margins(stats({"1": (1.0, 1.06, 1.05)})) == pytest.approx([-0.01])
    assert window_resolution(stats({"1": (1.0, 1.0, 1.05)})) == "not resolved (one seed)"


def test_dsv_below_dense_by_more_than_the_tolerance_meets_the_targets_over_seeds():
    reports = [("a", _report({"1": (1.0, 0.95, 1.0), "2": (1.0, 0.96, 1.0)},
                             {"1": (100, 80, 110), "2": (100, 85, 90)}))]
    rows = seed_rows(reports)
    loss = over_seeds({seed: row["loss"] for seed, row in rows.items()})
    fvd = over_seeds({seed: row["fvd"] for seed, row in rows.items()})
    loss_row, fvd_row, _ = targets(loss, fvd, rows)
    # -4.5% in loss and -17.5% in FVD: beyond the tolerances on the better side, so met.
    assert loss_row["met"] is True and loss_row["measured"].startswith("-4.50% over 2 seeds")
    assert fvd_row["met"] is True and fvd_row["measured"].startswith("-17.50% over 2 seeds")


def test_resolution_says_whether_the_seeds_decide_the_tolerance():
    # 95% t-quantiles: 12.71 with 2 seeds, 2.78 with 5.
    assert resolution(0.002, 0.0025, 0.01, 5) == "resolved: met (-0.5%…+0.9%)"  # ±0.69%
    # Not resolved: how many seeds would resolve it at this mean and spread (s.d. 0.0025·√2 = 0.35%; 95%
    # half-widths 0.88% with 3 seeds, 0.56% with 4, against the 0.8% between the gap and the bound).
    assert resolution(0.002, 0.0025, 0.01, 2) == (
        "not resolved: -3.0%…+3.4% crosses +1%; at this mean and spread the interval's edge reaches the bound at "
        "about 4 seeds (about even odds of resolving it there)")  # ±3.2%
    assert seeds_to_resolve(0.002, 0.0025 * math.sqrt(2), 0.01, 2) == 4
    assert seeds_to_resolve(0.0099, 0.01, 0.01, 2) is None  # 0.01% from the bound: not within 100 seeds
    assert resolution(0.0099, 0.005, 0.01, 4).endswith("more than 100 seeds would not resolve it")
    assert resolution(0.03, 0.005, 0.01, 5) == "resolved: missed (+1.6%…+4.4%)"
    # Lower is better: DSV resolved below dense by more than the tolerance meets the bound.
    assert resolution(-0.03, 0.005, 0.01, 5) == "resolved: met (-4.4%…-1.6%)"
    assert resolution(0.0, None, 0.01, 1) == "not resolved (one seed)"


def test_reports_of_other_settings_or_a_seed_twice_are_refused():
    base = ("a", _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}))
    for changes, message in (({"overrides": ["data.frames=16"]}, "overrides"),
                             ({"sample_steps": 50}, "sample_steps"),
                             ({"command": COMMAND.replace("--seed 0", "--seed 3")}, r"sampling seed \(--seed\) 3")):
        with pytest.raises(ValueError, match=f"b and a are not one comparison: {message}"):
            check_comparable([base, ("b", _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)}, **changes))])
    with pytest.raises(ValueError, match="training seed 1 is in both a and b"):
        check_comparable([base, ("b", _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}))])


def test_the_weights_moving_average_is_judged_over_the_seeds_that_kept_one(tmp_path):
    """A report from before `train.ema_decay` joins the weights' reading only; the average's row uses the others."""
    averaged = {"per_seed": {"2": {"dense": 1.0, "dsv": 1.004, "window": 1.02},
                             "3": {"dense": 1.0, "dsv": 0.998, "window": 1.01}}}
    report, written = _quality_seeds(tmp_path, {
        "a": _report({"1": (1.0, 1.03, 1.0)}, {"1": (1, 1, 1)}),
        "b": _report({"2": (1.0, 1.01, 1.0), "3": (1.0, 0.99, 1.0)}, {"2": (1, 1, 1), "3": (1, 1, 1)},
                     late_means_ema=averaged, config=_with_config(train={"ema_decay": 0.99})),
        # Another decay averages over other steps: not pooled with the first one's.
        "c": _report({"4": (1.0, 1.0, 1.0)}, {"4": (1, 1, 1)}, config=_with_config(train={"ema_decay": 0.9}),
                     late_means_ema={"per_seed": {"4": {"dense": 1.0, "dsv": 1.5, "window": 1.0}}})})
    rows = {t["target"]: t for t in written["targets"]}
    weights = rows["DSV held-out loss within 1% of dense"]
    average = rows["DSV held-out loss of the weights' moving average (train.ema_decay=0.99) within 1% of dense"]
    assert weights["measured"].startswith("+0.75% over 4 seeds")
    assert average["measured"].startswith("+0.10% over 2 seeds (per seed +0.40%, -0.20%)") and average["met"]
    assert written["loss_ema"]["seeds"] == ["2", "3"] and written["seeds"]["1"]["loss_ema"] is None
    assert written["loss_ema"]["other_decays"] == ["4"] and "(not seeds 4, whose runs averaged with another" in report
    assert "| mean over seeds | 1.0000 | 1.0010 | 1.0150 | +0.10% | +1.50% |" in report
    assert written["fvd_ema"] is None  # no report sampled the averages


def test_the_fvd_of_the_weights_moving_average_is_judged_over_the_seeds_that_sampled_it(tmp_path):
    averaged = {"per_seed": {seed: {"dense": 1.0, "dsv": 1.0, "window": 1.0} for seed in ("1", "2")}}
    report = _report({"1": (1.0, 1.0, 1.0), "2": (1.0, 1.0, 1.0)}, {"1": (100, 104, 110), "2": (100, 90, 95)},
                     late_means_ema=averaged, config=_with_config(train={"ema_decay": 0.99}))
    for seed, values in (("1", (100, 120, 100)), ("2", (100, 100, 100))):  # seed 1's averages: DSV +20%
        report["fvd_by_seed"][seed].update({f"{mode}, average of the weights": {"fvd": value}
                                            for mode, value in zip(("dense", "dsv", "window"), values)})
    _, written = _quality_seeds(tmp_path, {"a": report})
    rows = {t["target"]: t for t in written["targets"]}
    assert rows["DSV FVD within 5% of dense"]["measured"].startswith("-3.00% over 2 seeds")
    average = rows["DSV FVD of the weights' moving average (train.ema_decay=0.99) within 5% of dense"]
    assert average["measured"].startswith("+10.00% over 2 seeds (per seed +20.00%, +0.00%)") and not average["met"]
    report_md = (tmp_path / "out" / "report.md").read_text()
    assert "| mean over seeds | 100.0 | 110.0 | 100.0 | +10.0% |" in report_md
    # The weights' FVD table keeps to the weights' sets.
    assert not any(name.endswith("average of the weights") for name in written["fvd"]["means"])


def test_an_average_from_a_report_without_its_config_is_not_pooled_with_a_known_decay(tmp_path):
    averaged = {"per_seed": {"2": {"dense": 1.0, "dsv": 1.0, "window": 1.0}}}
    _, written = _quality_seeds(tmp_path, {
        "a": _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}, config=_with_config(train={"ema_decay": 0.99}),
                     late_means_ema={"per_seed": {"1": {"dense": 1.0, "dsv": 1.0, "window": 1.0}}}),
        "b": _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)}, late_means_ema=averaged)})
    assert written["loss_ema"]["seeds"] == ["1"] and written["loss_ema"]["other_decays"] == ["2"]
    assert written["seeds"]["2"]["ema_decay"] == "unknown"


def test_overrides_that_do_not_change_what_a_run_learns_are_one_comparison():
    """Saving more often is not another setting; a learning override beside it still is."""
    base = ("a", _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}))
    saving = ["data.frames=32", "train.ckpt_every=250", "train.keep_checkpoints=5"]
    check_comparable([base, ("b", _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)}, overrides=saving))])
    with pytest.raises(ValueError, match="b and a are not one comparison: overrides"):
        check_comparable([base, ("b", _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)},
                                               overrides=[*saving, "optim.lr=0.001"]))])


def test_the_command_writes_the_report_and_refuses_a_folder_without_results(tmp_path, capsys):
    for name, report in (("a", _report({"1": (1.0, 1.02, 1.03), "2": (1.0, 0.99, 1.01)},
                                       {"1": (100, 104, 110), "2": (100, 97, 108)})),
                         ("b", _report({"3": (1.0, 1.0, 1.02)}, {"3": (100, 101, 103)}))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(report))
    out = tmp_path / "out"
    assert main(["bench", "quality-seeds", "--results", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert report == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "# Quality over training seeds: 3 seeds from 2 reports" in report
    assert f"dsv bench quality-seeds --results {tmp_path / 'a'} {tmp_path / 'b'} --out OUT" in report
    assert "| mean over seeds | | 1.0000 | 1.0033 | 1.0200 | +0.33% | +2.00% |" in report
    assert "| mean over seeds | 100.0 | 100.7 | 107.0 |" in report
    written = json.loads((out / "results.json").read_text())
    assert [t["met"] for t in written["targets"]] == [True, True, True]
    assert written["loss_gaps_by_step"] == [] and not (out / "gaps_by_step.png").exists()  # no held-out tables
    assert main(["bench", "quality-seeds", "--results", str(tmp_path), "--out", str(out)]) == 2
    assert "no results.json of `dsv bench quality` there" in capsys.readouterr().err
    # Two folders of one name (h200/quality, h100/quality): the second's config was never compared with the first's
    # (its name was taken for the first's), and the notes merged them.
    (tmp_path / "h100" / "a").mkdir(parents=True)
    (tmp_path / "h100" / "a" / "results.json").write_text((tmp_path / "a" / "results.json").read_text())
    assert main(["bench", "quality-seeds", "--results", str(tmp_path / "a"), str(tmp_path / "h100" / "a"),
                 "--out", str(out)]) == 2
    assert "another report's folder is also named 'a'" in capsys.readouterr().err


def test_reports_whose_resolved_configs_differ_are_refused_by_the_first_key_that_differs(tmp_path):
    """The recipe and overrides alike, the configs not: a recipe default changed between code versions."""
    base = ("a", _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}, config=CONFIG))
    # Written by a code version before the field existed: absent from its config, read as the value its run had.
    before_the_field = {**CONFIG, "attention": {"cube": [4, 4, 4]}}
    for config, message in ((_with_config(attention={"dispatch_margin": 0.0}),
                             "attention.dispatch_margin 0.0 against 0.1"),
                            (before_the_field, "attention.dispatch_margin 0.0 against 0.1"),
                            (_with_config(attention={"cube": [2, 2, 2]}, train={"seed": 5}),
                             r"attention.cube \(2, 2, 2\) against \(4, 4, 4\)")):
        with pytest.raises(ValueError, match=f"b and a are not one comparison: config {message}$"):
            check_comparable([base, ("b", _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)}, config=config))])
    # A field this code does not know (a newer version's): refused, not compared field by field.
    with pytest.raises(ValueError, match=r"b and a: their configs do not read as this code's .*unknown fields"):
        check_comparable([base, ("b", _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)},
                                               config=_with_config(attention={"new_knob": 1})))])
    # Values compare as values (a recipe literal 0 against 0.0); each report's own training seed, folder and
    # logging are not the setting.
    other_run = _with_config(train={"seed": 2, "out_dir": "runs/b", "log_every": 7}, optim={"weight_decay": 0.0})
    report, written = _quality_seeds(tmp_path, {
        "a": _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}, config=_with_config(optim={"weight_decay": 0})),
        "b": _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)}, config=other_run)})
    assert "Every report's resolved config is the first's (but for train.seed, train.device, train.out_dir" in report
    assert "Checked by recipe and overrides only" not in report
    assert written["checked_by_recipe_and_overrides_only"] == []


def test_reports_without_a_config_are_checked_by_recipe_and_overrides_only(tmp_path):
    # Written before results.json held the config: accepted, the report names them.
    with_config = _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}, config=CONFIG)
    without = _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)})
    check_comparable([("a", with_config), ("b", without)])
    (tmp_path / "one").mkdir()
    report, written = _quality_seeds(tmp_path / "one", {"a": with_config, "b": without})
    assert "Checked by recipe and overrides only (no resolved config to compare: written before `dsv bench " \
           "quality` recorded it, so a recipe default changed between code versions would go unseen): b." in report
    assert written["checked_by_recipe_and_overrides_only"] == ["b"]
    # The first report without a config: the others that have one are compared with the first of them.
    (tmp_path / "two").mkdir()
    report, _ = _quality_seeds(tmp_path / "two", {"b": without, "a": with_config})
    assert "would go unseen): b." in report
    other = _report({"3": (1.0, 1.0, 1.0)}, {"3": (1, 1, 1)}, config=_with_config(attention={"cube": [2, 2, 2]}))
    with pytest.raises(ValueError, match="c and a are not one comparison: config attention.cube"):
        check_comparable([("b", without), ("a", with_config), ("c", other)])


def test_a_seed_whose_dsv_run_had_no_sparse_block_leaves_the_targets_that_include_it_unjudged(tmp_path):
    """Seed 2's DSV run trained dense attention: the loss and window targets, whose means include it, are n/a
    with their numbers kept; the FVD, which sampled seeds 1 and 3 only, is judged."""
    a = _report({"1": (1.0, 1.02, 1.01), "2": (2.0, 1.98, 2.04)}, {"1": (100, 90, 120)}, all_seeds_sampled=False,
                without_sparse_block=("2",))
    b = _report({"3": (1.0, 1.01, 0.99)}, {"3": (200, 210, 190)})
    rows = seed_rows([("a", a), ("b", b)])
    assert [rows[seed]["no_sparse_block"] for seed in "123"] == [False, True, False]
    loss = over_seeds({seed: row["loss"] for seed, row in rows.items()})
    fvd = over_seeds({seed: row["fvd"] for seed, row in rows.items() if row["fvd"] is not None})
    loss_row, fvd_row, window_row = targets(loss, fvd, rows)
    assert (loss_row["met"], fvd_row["met"], window_row["met"]) == (None, True, None)
    not_judged = ("; not judged: DSV ran no sparse block in seed 2, so the means compare dense attention with dense "
                  "attention there (run-to-run noise)")
    assert loss_row["measured"] == "+0.25% over 3 seeds (per seed +2.00%, -1.00%, +1.00%)" + not_judged
    assert loss_row["resolution"] == "-" and loss_row["spread"].startswith("mean of the per-seed gaps +0.67% ± ")
    assert window_row["measured"].endswith(not_judged) and "not judged" not in fvd_row["measured"]
    # Among the FVD's seeds too: every target n/a.
    sampled = _report({"1": (1.0, 1.02, 1.01), "2": (2.0, 1.98, 2.04)}, {"1": (100, 90, 120), "2": (100, 95, 99)},
                      without_sparse_block=("2",))
    report, written = _quality_seeds(tmp_path, {"a": sampled, "b": b})
    assert [t["met"] for t in written["targets"]] == [None] * 3 and written["seeds"]["2"]["no_sparse_block"]
    assert report.count("| n/a |") == 3 and "| met |" not in report and "| **missed** |" not in report
    assert ("Seeds whose DSV run trained dense attention (the targets whose means include them say n/a): a: DSV ran "
            "no sparse block in seed 2 (on average 0.04 of 12 blocks sparse in stage 2).") in report


def test_reports_without_the_sparse_blocks_per_seed_are_judged_and_named(tmp_path):
    # Results written before the bench recorded each seed's sparse blocks (the 2026-11-29 two-seed reports).
    old = _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)})
    for key in ("mean_sparse_blocks_in_stage2_by_seed", "final_sparse_blocks_by_seed"):
        del old[key]
    report, written = _quality_seeds(tmp_path, {"old": old, "new": _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)})})
    assert written["seeds"]["1"]["no_sparse_block"] is None and written["seeds"]["2"]["no_sparse_block"] is False
    assert [t["met"] for t in written["targets"]] == [True, True, False]
    assert ("Reports that do not record per seed whether DSV ran a sparse block (written before `dsv bench quality` "
            "recorded it), their seeds judged as if it did: old.") in report


def test_the_reports_table_names_each_reports_code_version(tmp_path):
    first, second = "0123456789" + "a" * 54, "fedcba9876" + "b" * 54
    reports = {"a": _report({"1": (1.0, 1.0, 1.0)}, {"1": (1, 1, 1)}, code={"dsv": "0.1.0", "source_sha256": first}),
               "b": _report({"2": (1.0, 1.0, 1.0)}, {"2": (1, 1, 1)}, code={"dsv": None, "source_sha256": first}),
               "c": _report({"3": (1.0, 1.0, 1.0)}, {"3": (1, 1, 1)})}
    (tmp_path / "same").mkdir()
    report, _ = _quality_seeds(tmp_path / "same", reports)
    assert "| report | date | machine | code | training seeds | FVD of seeds |" in report
    assert "| a | 2026-12-01 | NVIDIA H200 | 0123456789 | 1 | 1 |" in report
    assert "| c | 2026-12-01 | NVIDIA H200 | - | 3 | 3 |" in report
    assert "The reports come from" not in report  # one version where recorded
    reports["b"]["code"]["source_sha256"] = second
    (tmp_path / "two").mkdir()
    report, _ = _quality_seeds(tmp_path / "two", reports)
    assert "| b | 2026-12-01 | NVIDIA H200 | fedcba9876 | 2 | 2 |" in report
    assert ("The reports come from 2 code versions (the code column: the hash of the dsv sources, which any edit "
            "changes, a docstring's too): information, not a refusal.") in report


def test_a_seeds_dense_control_is_shown_beside_dsvs_gap_in_every_reading(tmp_path):
    """The control's gap is the per-seed noise floor: shown for the loss and FVD of the weights and of their
    averages (against dense's average), "-" where the report lacks a reading, and no section without controls."""
    per_seed = {"1": {"dense": 1.0, "dsv": 1.01, "window": 1.0, "dense-control": 1.04}}
    averaged = {"per_seed": {"1": {"dense": 0.5, "dsv": 0.49, "window": 0.5, "dense-control": 0.52}}}
    report = _report({"1": (1.0, 1.01, 1.0)}, {"1": (100, 110, 100)}, late_means={"per_seed": per_seed},
                     late_means_ema=averaged, config=_with_config(train={"ema_decay": 0.99}))
    report["fvd_by_seed"]["1"].update({"dense-control": {"fvd": 85.0}, "dense, average of the weights": {"fvd": 80.0},
                                       "dsv, average of the weights": {"fvd": 72.0},
                                       "dense-control, average of the weights": {"fvd": 88.0}})
    plain = _report({"2": (1.0, 0.99, 1.0)}, {"2": (100, 100, 100)})
    text, written = _quality_seeds(tmp_path, {"a": report, "b": plain})
    assert written["seeds"]["2"]["control"] is None
    control = written["seeds"]["1"]["control"]
    assert math.isclose(control["loss"]["control"], 0.04) and math.isclose(control["loss_ema"]["dsv"], -0.02)
    assert math.isclose(control["fvd"]["control"], -0.15) and math.isclose(control["fvd_ema"]["control"], 0.10)
    assert "| 1 | +1.00% / +4.00% | -2.00% / +4.00% | +10.00% / -15.00% | -10.00% / +10.00% |" in text
    # A report with a control but without averages or the control's FVD leaves those cells empty.
    bare = _report({"3": (1.0, 1.0, 1.0)}, {"3": (100, 100, 100)}, late_means={"per_seed": {"3": {
        "dense": 1.0, "dsv": 1.0, "window": 1.0, "dense-control": 0.98}}})
    (tmp_path / "out").rename(tmp_path / "first")
    text, _ = _quality_seeds(tmp_path, {"c": bare})
    assert "| 3 | +0.00% / -2.00% | - / - | - / - | - / - |" in text
    text, _ = _quality_seeds(tmp_path / "first", {"d": plain})
    assert "dense controls" not in text


def test_the_gaps_by_evaluation_step_are_the_mean_and_median_over_the_seeds_that_kept_every_evaluation(tmp_path):
    """Each step's gaps over the seeds with held-out tables (a report without them is counted out and said so);
    a step one seed lacks is left out; the averages' rows come from the seeds that kept one."""

    def table(*rows):
        return [{"step": step, "dense": 1.0, "dsv": dsv, "window": window} for step, dsv, window in rows]

    tables = {"1": table((100, 1.02, 0.90), (200, 1.00, 0.95)),
              "2": table((100, 1.00, 0.94), (200, 0.98, 0.99), (300, 1.0, 1.0)),
              "3": table((100, 1.06, 0.92), (200, 1.01, 0.97))}
    averages = {"2": table((100, 0.99, 0.96), (200, 1.0, 1.0)), "3": table((100, 1.01, 0.98), (200, 1.0, 1.02))}
    late = {"per_seed": {seed: {"dense": 1.0, "dsv": 1.0, "window": 1.0} for seed in ("2", "3")}}
    report, written = _quality_seeds(tmp_path, {
        "a": _report({"0": (1.0, 1.0, 1.0)}, {"0": (1, 1, 1)}),  # written before the reports kept every evaluation
        "b": _report({"1": (1.0, 1.0, 0.97)}, {"1": (1, 1, 1)}, heldout_by_seed={"1": tables["1"]}),
        "c": _report({"2": (1.0, 0.99, 0.99), "3": (1.0, 1.01, 0.97)}, {"2": (1, 1, 1), "3": (1, 1, 1)},
                     heldout_by_seed={"2": tables["2"], "3": tables["3"]}, heldout_ema_by_seed=averages,
                     late_means_ema=late, config=_with_config(train={"ema_decay": 0.99}))})
    by_step = written["loss_gaps_by_step"]
    assert [entry["step"] for entry in by_step] == [100, 200]  # seeds 1 and 3 have no step 300
    assert by_step[0]["seeds"] == 3
    assert by_step[0]["dsv"]["mean"] == pytest.approx(statistics.fmean([0.02, 0.0, 0.06]))
    assert by_step[0]["dsv"]["median"] == pytest.approx(0.02)
    assert by_step[1]["window"]["mean"] == pytest.approx(statistics.fmean([-0.05, -0.01, -0.03]))
    assert by_step[1]["window"]["median"] == pytest.approx(-0.03)
    ema = written["loss_ema_gaps_by_step"]
    assert [entry["seeds"] for entry in ema] == [2, 2] and ema[0]["window"]["mean"] == pytest.approx(-0.03)
    assert "mean / median over the 3 seeds whose reports kept every evaluation (of 4)" in report
    assert "| 100 | +2.67% / +2.00% | -8.00% / -8.00% | +0.00% / +0.00% | -3.00% / -3.00% |" in report
    assert (tmp_path / "out" / "gaps_by_step.png").stat().st_size > 0
