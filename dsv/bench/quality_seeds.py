"""`dsv bench quality-seeds`: the quality targets judged over the training seeds of several `dsv bench quality`
reports of one setting. One H200 trains one seed's dense, DSV and window runs in a command or two, so the seeds of
a comparison accumulate report by report; a seed's gap to dense swings by a few percent (loss) to ten (FVD), so
the targets are judged on the means over seeds, with the spread of the per-seed gaps saying whether the count of
seeds resolves them.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
from pathlib import Path

from dsv.bench.quality import FVD_TOLERANCE, LOSS_TOLERANCE, MODES, TOLERANCE_RULE, fvd_seeds, meets_tolerance

# What two reports must share to be one comparison: the training setting and the FVD's sampling.
COMPARED = ("recipe", "overrides", "model", "steps", "batch_size", "videos", "sample_steps")
# A target is resolved where the 95% t-interval of the mean per-seed gap lies on one side of its bound.
CONFIDENCE = 0.95


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, nargs="+", required=True, metavar="REPORT",
                        help="folders (or results.json files) written by `dsv bench quality` of one setting")
    parser.add_argument("--out", type=Path, required=True, help="output folder for report.md and results.json")


def load_reports(paths: list[Path]) -> list[tuple[str, dict]]:
    """`(name, results)` of each `dsv bench quality` results.json (a folder's or the file)."""
    reports = []
    for path in paths:
        file = path / "results.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"--results {path}: no results.json of `dsv bench quality` there")
        results = json.loads(file.read_text())
        missing = [key for key in (*COMPARED, "command", "seeds", "late_means", "fvd") if key not in results]
        if missing:
            raise ValueError(f"--results {path}: not a `dsv bench quality` results.json (no {', '.join(missing)})")
        reports.append((file.parent.name, results))
    return reports


def sampling_seed(results: dict) -> int:
    """The seed of the FVD's sampling noise: the report's `--seed` (its command's; 0, the default, if absent)."""
    words = shlex.split(results["command"])
    return int(words[words.index("--seed") + 1]) if "--seed" in words else 0


def check_comparable(reports: list[tuple[str, dict]]) -> None:
    """ValueError unless every report has the first one's setting (`COMPARED`, and the sampling seed) and no
    training seed is in two reports."""
    first_name, first = reports[0]
    for name, results in reports[1:]:
        for key, value, expected in [*((key, results[key], first[key]) for key in COMPARED),
                                     ("sampling seed (--seed)", sampling_seed(results), sampling_seed(first))]:
            if value != expected:
                raise ValueError(f"{name} and {first_name} are not one comparison: {key} {value!r} against "
                                 f"{expected!r}")
    seen: dict[str, str] = {}
    for name, results in reports:
        for seed in map(str, results["seeds"]):
            if seed in seen:
                raise ValueError(f"training seed {seed} is in both {seen[seed]} and {name}: each seed once")
            seen[seed] = name


def seed_rows(reports: list[tuple[str, dict]]) -> dict[str, dict]:
    """Per training seed: the report it is in, each mode's late-run mean held-out loss and, where its models were
    sampled, each set's FVD (None where they were not: reports before the FVD covered every seed scored the first
    seed's models only)."""
    rows = {}
    for name, results in reports:
        scored = fvd_seeds(results)
        for seed, late in results["late_means"]["per_seed"].items():
            if seed not in scored:
                fvd = None
            elif results.get("fvd_by_seed"):
                fvd = {s: entry["fvd"] for s, entry in results["fvd_by_seed"][seed].items()}
            else:
                fvd = {s: entry["fvd"] for s, entry in results["fvd"].items()}
            rows[seed] = {"report": name, "loss": {mode: late[mode] for mode in MODES}, "fvd": fvd}
    return rows


def over_seeds(per_seed: dict[str, dict[str, float]]) -> dict:
    """Means over seeds of each mode and the gaps to dense: of the means (what the targets judge), and the mean
    and standard error of the per-seed gaps (None with one seed)."""
    modes = [mode for mode in next(iter(per_seed.values())) if all(mode in values for values in per_seed.values())]
    means = {mode: statistics.fmean(values[mode] for values in per_seed.values()) for mode in modes}
    gaps = {}
    for mode in modes:
        if mode == "dense":
            continue
        per = [values[mode] / values["dense"] - 1 for values in per_seed.values()]
        gaps[mode] = {"of_means": means[mode] / means["dense"] - 1, "per_seed": per,
                      "mean_of_gaps": statistics.fmean(per),
                      "standard_error": statistics.stdev(per) / math.sqrt(len(per)) if len(per) > 1 else None}
    return {"seeds": list(per_seed), "means": means, "gaps": gaps}


def resolution(gap: float, standard_error: float | None, tolerance: float, seeds: int) -> str:
    """Whether the `CONFIDENCE` t-interval `gap ± t · standard_error` (the mean of `seeds` per-seed gaps and its
    standard error) lies at or under the bound `+tolerance` (resolved: met), above it (resolved: missed) or across
    it (not resolved); lower is better, so the bound is one-sided (`TOLERANCE_RULE`)."""
    from scipy.stats import t as student_t

    if standard_error is None or seeds < 2:
        return "not resolved (one seed)"
    half_width = float(student_t.ppf(0.5 + CONFIDENCE / 2, seeds - 1)) * standard_error
    low, high = gap - half_width, gap + half_width
    if meets_tolerance(high, tolerance):
        return f"resolved: met ({low:+.1%}…{high:+.1%})"
    if not meets_tolerance(low, tolerance):
        return f"resolved: missed ({low:+.1%}…{high:+.1%})"
    return f"not resolved: {low:+.1%}…{high:+.1%} crosses +{tolerance:.0%}"


def targets(loss: dict, fvd: dict | None) -> list[dict]:
    """The loss, FVD and window targets on the means over seeds, each with the per-seed spread."""

    def gap_row(what: str, stats: dict, mode: str, tolerance: float) -> dict:
        gap = stats["gaps"][mode]
        error = gap["standard_error"]
        return {"target": f"DSV {what} within {tolerance:.0%} of dense",
                "measured": f"{gap['of_means']:+.2%} over {len(stats['seeds'])} seeds (per seed "
                            + ", ".join(f"{g:+.2%}" for g in gap["per_seed"]) + ")",
                "met": bool(meets_tolerance(gap["of_means"], tolerance)),
                "spread": "-" if error is None else f"mean of the per-seed gaps {gap['mean_of_gaps']:+.2%} ± "
                                                    f"{error:.2%} (standard error)",
                "resolution": resolution(gap["mean_of_gaps"], error, tolerance, len(stats["seeds"]))}

    rows = [gap_row("held-out loss", loss, "dsv", LOSS_TOLERANCE)]
    if fvd is not None:
        rows.append(gap_row("FVD", fvd, "dsv", FVD_TOLERANCE))
    worse = {"loss": loss["means"]["window"] > max(loss["means"]["dense"], loss["means"]["dsv"])}
    if fvd is not None:
        worse["FVD"] = fvd["means"]["window"] > max(fvd["means"]["dense"], fvd["means"]["dsv"])
    window_seeds = {"loss": loss, "FVD": fvd}
    rows.append({"target": "window worse than both (held-out loss and FVD)",
                 "measured": "; ".join(
                     f"{what}: window {window_seeds[what]['gaps']['window']['of_means']:+.2%}, DSV "
                     f"{window_seeds[what]['gaps']['dsv']['of_means']:+.2%} against dense" for what in worse),
                 "met": all(worse.values()),
                 "spread": "; ".join(f"{what}: window worst in {_worst_count(window_seeds[what])} of "
                                     f"{len(window_seeds[what]['seeds'])} seeds" for what in worse),
                 "resolution": "-"})
    return rows


def _worst_count(stats: dict) -> int:
    """Seeds where window is above both dense and DSV (its per-seed gap above 0 and above DSV's)."""
    window, dsv = stats["gaps"]["window"]["per_seed"], stats["gaps"]["dsv"]["per_seed"]
    return sum(w > max(0.0, d) for w, d in zip(window, dsv))


def render(reports: list[tuple[str, dict]], rows: dict[str, dict], loss: dict, fvd: dict | None,
           judged: list[dict], command: str) -> str:
    first = reports[0][1]
    lines = [f"# Quality over training seeds: {len(rows)} seeds from {len(reports)} reports", "",
             "```", command, "```", "",
             f"Recipe `{first['recipe']}` with {' '.join(first['overrides']) or 'no overrides'}: {first['model']}; "
             f"{first['steps']} steps of batch {first['batch_size']}. FVD: {first['videos']} samples per run "
             f"({first['sample_steps']} Euler steps, sampling seed {sampling_seed(first)}) against the same "
             f"{first['videos']} held-out clips in every report. Loss: each seed's mean held-out loss over its "
             "late evaluations, as in each report.", "",
             "| report | date | machine | training seeds | FVD of seeds |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {results.get('date', '-')} | {results.get('machine', '-')} | "
              f"{', '.join(map(str, results['seeds']))} | {', '.join(fvd_seeds(results))} |"
              for name, results in reports]
    lines += ["", "## Targets on the means over seeds", "",
              "| target | measured | result | spread over seeds | resolved by this many seeds? |",
              "|---|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {'met' if t['met'] else '**missed**'} | {t['spread']} | "
              f"{t['resolution']} |" for t in judged]
    lines += ["", f"Judged on the gap of the means over seeds (as `dsv bench quality`); resolved: the {CONFIDENCE:.0%} "
              "t-interval of the mean of the per-seed gaps lies on one side of the bound. " + TOLERANCE_RULE, "",
              "## Held-out loss per seed", "",
              "| seed | report | dense | DSV | window | DSV vs dense | window vs dense |",
              "|---|---|---|---|---|---|---|"]
    for seed, row in rows.items():
        values = row["loss"]
        lines.append(f"| {seed} | {row['report']} | {values['dense']:.4f} | {values['dsv']:.4f} | "
                     f"{values['window']:.4f} | {values['dsv'] / values['dense'] - 1:+.2%} | "
                     f"{values['window'] / values['dense'] - 1:+.2%} |")
    means = loss["means"]
    lines.append(f"| mean over seeds | | {means['dense']:.4f} | {means['dsv']:.4f} | {means['window']:.4f} | "
                 f"{loss['gaps']['dsv']['of_means']:+.2%} | {loss['gaps']['window']['of_means']:+.2%} |")
    if fvd is not None:
        sets = list(fvd["means"])
        lines += ["", "## FVD per seed", "", "| seed | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        lines += [f"| {seed} | " + " | ".join(f"{rows[seed]['fvd'][s]:.1f}" for s in sets) + " |"
                  for seed in fvd["seeds"]]
        lines.append("| mean over seeds | " + " | ".join(f"{fvd['means'][s]:.1f}" for s in sets) + " |")
        lines.append("| mean vs dense | " + " | ".join(
            "-" if s == "dense" else f"{fvd['gaps'][s]['of_means']:+.1%}" for s in sets) + " |")
        partial = sorted({s for seed in fvd["seeds"] for s in rows[seed]["fvd"]} - set(sets))
        if partial:
            lines += ["", f"FVD sets not in every seed's report (left out of the means): {', '.join(partial)}."]
        unscored = [seed for seed, row in rows.items() if row["fvd"] is None]
        if unscored:
            lines += ["", "Seeds whose models no report sampled (the FVD's seeds exclude them): "
                      f"{', '.join(unscored)}."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    reports = load_reports(args.results)
    check_comparable(reports)
    rows = seed_rows(reports)
    loss = over_seeds({seed: row["loss"] for seed, row in rows.items()})
    scored = {seed: row["fvd"] for seed, row in rows.items() if row["fvd"] is not None}
    fvd = over_seeds(scored) if scored else None
    judged = targets(loss, fvd)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"reports": [name for name, _ in reports], "seeds": rows, "loss": loss, "fvd": fvd, "targets": judged},
        indent=1))
    command = shlex.join(["dsv", "bench", "quality-seeds", "--results", *map(str, args.results), "--out", "OUT"])
    report = render(reports, rows, loss, fvd, judged, command)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0
