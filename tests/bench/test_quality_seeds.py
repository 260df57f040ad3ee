"""`dsv bench quality-seeds`: reports of one setting combine by training seed, the targets are judged on the means
over seeds with the per-seed spread, and reports of different settings or a seed counted twice are refused."""

import json
import math
import statistics

import pytest

from dsv.bench.quality_seeds import check_comparable, over_seeds, resolution, seed_rows, targets
from dsv.cli import main

COMMAND = "dsv bench quality --recipe quality_gpu --set data.frames=32 --out OUT --seed 0"


def _report(seeds: dict[str, tuple[float, float, float]], fvd: dict[str, tuple[float, float, float]] | None,
            all_seeds_sampled: bool = True, **changes) -> dict:
    """A results.json of `dsv bench quality`: per seed (dense, dsv, window) late-mean losses and FVDs; without
    `all_seeds_sampled`, the form written before the FVD covered every seed (the first seed's FVD alone)."""
    per_seed = {seed: dict(zip(("dense", "dsv", "window"), losses)) for seed, losses in seeds.items()}
    fvd_by_seed = {seed: {set_name: {"fvd": value} for set_name, value in zip(("dense", "dsv", "window"), values)}
                   for seed, values in (fvd or {}).items()}
    results = {"recipe": "quality_gpu", "overrides": ["data.frames=32"], "model": "12 blocks", "steps": 1000,
               "batch_size": 8, "videos": 64, "sample_steps": 25, "command": COMMAND, "date": "2026-12-01",
               "machine": "NVIDIA H200", "seeds": [int(s) for s in seeds], "late_means": {"per_seed": per_seed},
               "fvd": next(iter(fvd_by_seed.values()))}
    if all_seeds_sampled:
        results["fvd_by_seed"] = fvd_by_seed
    results.update(changes)
    return results


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

    loss_row, fvd_row, window_row = targets(loss, fvd)
    assert loss_row["met"] and "+0.25% over 3 seeds" in loss_row["measured"]
    assert fvd_row["met"] and "per seed -10.00%, +5.00%" in fvd_row["measured"]
    # Window: loss +1.0% (worse than both), FVD +3.3% against DSV's 0%: worse in both on the means.
    assert window_row["met"] and "loss: window worst in 1 of 3 seeds; FVD: window worst in 1 of 2 seeds" == \
        window_row["spread"]


def test_resolution_says_whether_the_seeds_decide_the_tolerance():
    # 95% t-quantiles: 12.71 with 2 seeds, 2.78 with 5.
    assert resolution(0.002, 0.0025, 0.01, 5) == "resolved: met (-0.5%…+0.9%)"  # ±0.69%
    assert resolution(0.002, 0.0025, 0.01, 2) == "not resolved: -3.0%…+3.4% crosses +1%"  # ±3.2%
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
    assert main(["bench", "quality-seeds", "--results", str(tmp_path), "--out", str(out)]) == 2
    assert "no results.json of `dsv bench quality` there" in capsys.readouterr().err
