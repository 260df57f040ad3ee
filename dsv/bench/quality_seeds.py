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
import warnings
from pathlib import Path

import numpy as np

from dsv.analysis.figures import save_figure
from dsv.bench.quality import (
    AVERAGE_SUFFIX,
    CONTROL,
    FVD_TOLERANCE,
    LOSS_TOLERANCE,
    MODES,
    TOLERANCE_RULE,
    average_set,
    dense_reference,
    fvd_seeds,
    meets_tolerance,
    no_sparse_block_text,
    result_mark,
    seeds_without_sparse_block,
)
from dsv.train.checkpoint import write_text_atomic

# What two reports must share to be one comparison: the training setting and the FVD's sampling (and the overrides
# that change what a run learns, `learning_overrides`).
COMPARED = ("recipe", "model", "steps", "batch_size", "videos", "sample_steps")
# Resolved-config fields that do not change what a run learns: the training seed (each report trains its own),
# where and how often it logs, checkpoints and which device and threads it runs on, and whether it evaluates a
# moving average of its weights beside them (the weights are the same with and without: tests/train).
CONFIG_FIELDS_NOT_COMPARED = ("train.seed", "train.device", "train.out_dir", "train.log_every", "train.ckpt_every",
                              "train.keep_checkpoints", "train.tensorboard", "train.threads", "train.max_minutes",
                              "train.ema_decay")
# What `seeds_without_sparse_block` reads: reports written before the bench recorded them per seed lack them.
SPARSE_BLOCK_RECORDS = ("mean_sparse_blocks_in_stage2_by_seed", "final_sparse_blocks_by_seed")
# A target is resolved where the 95% t-interval of the mean per-seed gap lies on one side of its bound.
CONFIDENCE = 0.95
# The most seeds a planning estimate counts to (`seeds_to_resolve`): beyond it, the gap sits on the bound.
MOST_SEEDS = 100


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
        required = (*COMPARED, "overrides", "command", "seeds", "late_means", "fvd")
        missing = [key for key in required if key not in results]
        if missing:
            raise ValueError(f"--results {path}: not a `dsv bench quality` results.json (no {', '.join(missing)})")
        name = file.parent.name
        same = [other for other, _ in reports if other == name]
        if same:  # the name keys the notes and the checks: two of one name would merge there
            raise ValueError(f"--results {path}: another report's folder is also named {name!r}; a report is named "
                             "by its folder, so give the folders distinct names (e.g. dated and hardware-named)")
        reports.append((name, results))
    return reports


def sampling_seed(results: dict) -> int:
    """The seed of the FVD's sampling noise: the report's `--seed` (its command's; 0, the default, if absent)."""
    words = shlex.split(results["command"])
    return int(words[words.index("--seed") + 1]) if "--seed" in words else 0


def flat_config(config: dict) -> dict:
    """A resolved config (`dsv.train.config.config_to_dict`'s form: sections of plain fields, `{"attention":
    {"cube": (4, 4, 4), ...}, ...}`) by dotted key: `{"attention.cube": (4, 4, 4), ...}`."""
    return {f"{section}.{field}": value for section, fields in config.items() for field, value in fields.items()}


def learning_overrides(overrides: list[str]) -> list[str]:
    """A report's `--set key=value` overrides less those of `CONFIG_FIELDS_NOT_COMPARED` (how often a run saves,
    for one): two reports whose overrides differ only there trained the same runs."""
    return [override for override in overrides if override.split("=", 1)[0] not in CONFIG_FIELDS_NOT_COMPARED]


def config_difference(config: dict, expected: dict) -> tuple[str, str, str] | None:
    """The first dotted key (in the configs' field order) where ``config`` differs from ``expected`` in value, not
    counting `CONFIG_FIELDS_NOT_COMPARED`, with both values as text; None where they agree. Both are read as the
    trainer reads a stored config (`config_from_dict`): a field a config lacks (written before it existed) takes
    the value its run had (`VALUES_BEFORE_FIELDS`, today's default otherwise), and a field this code does not know
    raises ValueError."""
    from dsv.train.config import config_from_dict, config_to_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # config_from_dict's note on fields filled in: the comparison says it
        values, expected_values = (flat_config(config_to_dict(config_from_dict(c))) for c in (config, expected))
    for key, expected_value in expected_values.items():
        if key not in CONFIG_FIELDS_NOT_COMPARED and values[key] != expected_value:
            return key, repr(values[key]), repr(expected_value)
    return None


def first_with_config(reports: list[tuple[str, dict]]) -> tuple[str, dict] | None:
    """The first report that records its resolved config: the one the others' configs are compared with."""
    return next(((name, results) for name, results in reports if "config" in results), None)


def checked_without_config(reports: list[tuple[str, dict]]) -> list[str]:
    """The reports whose setting `check_comparable` checked by recipe and overrides only, not by the resolved
    config: those without a "config" (written before results.json recorded it)."""
    return [name for name, results in reports if "config" not in results]


def check_comparable(reports: list[tuple[str, dict]]) -> None:
    """ValueError unless every report has the first one's setting (`COMPARED`, `learning_overrides` and the
    sampling seed), every report that records its resolved config has the first such report's
    (`config_difference`), and no training seed is in two reports."""
    first_name, first = reports[0]
    for name, results in reports[1:]:
        for key, value, expected in [*((key, results[key], first[key]) for key in COMPARED),
                                     ("overrides", learning_overrides(results["overrides"]),
                                      learning_overrides(first["overrides"])),
                                     ("sampling seed (--seed)", sampling_seed(results), sampling_seed(first))]:
            if value != expected:
                raise ValueError(f"{name} and {first_name} are not one comparison: {key} {value!r} against "
                                 f"{expected!r}")
    # The recipe and overrides name a setting only within one code version: a recipe default changed between
    # versions shows in the resolved config alone.
    reference = first_with_config(reports)
    for name, results in reports:
        if reference is None or "config" not in results or results is reference[1]:
            continue
        try:
            difference = config_difference(results["config"], reference[1]["config"])
        except ValueError as err:
            raise ValueError(f"{name} and {reference[0]}: their configs do not read as this code's ({err})") from err
        if difference is not None:
            key, value, expected = difference
            raise ValueError(f"{name} and {reference[0]} are not one comparison: config {key} {value} against "
                             f"{expected}")
    seen: dict[str, str] = {}
    for name, results in reports:
        for seed in map(str, results["seeds"]):
            if seed in seen:
                raise ValueError(f"training seed {seed} is in both {seen[seed]} and {name}: each seed once")
            seen[seed] = name


def seed_rows(reports: list[tuple[str, dict]]) -> dict[str, dict]:
    """Per training seed: the report it is in, each mode's late-run mean held-out loss, where its models were
    sampled each set's FVD (None where they were not: reports before the FVD covered every seed scored the first
    seed's models only), and whether its DSV run had no sparse block (`seeds_without_sparse_block`: it trained
    dense attention; None where the report did not record it per seed)."""
    rows = {}
    for name, results in reports:
        scored = fvd_seeds(results)
        recorded = all(key in results for key in SPARSE_BLOCK_RECORDS)
        dense_only = seeds_without_sparse_block(results) if recorded else []
        for seed, late in results["late_means"]["per_seed"].items():
            if seed not in scored:
                fvd = None
            elif results.get("fvd_by_seed"):
                fvd = {s: entry["fvd"] for s, entry in results["fvd_by_seed"][seed].items()}
            else:
                fvd = {s: entry["fvd"] for s, entry in results["fvd"].items()}
            late_ema = (results.get("late_means_ema") or {}).get("per_seed", {}).get(seed)
            rows[seed] = {"report": name, "loss": {mode: late[mode] for mode in MODES}, "fvd": fvd,
                          "loss_ema": None if late_ema is None else {mode: late_ema[mode] for mode in MODES},
                          # "unknown" where a report lacks its config: not pooled with a known decay.
                          "ema_decay": None if late_ema is None else (results.get("config") or {}).get(
                              "train", {}).get("ema_decay", "unknown"),
                          "no_sparse_block": seed in dense_only if recorded else None,
                          "heldout": results.get("heldout_by_seed", {}).get(seed),
                          "heldout_ema": results.get("heldout_ema_by_seed", {}).get(seed),
                          "control": control_readings(late, late_ema, fvd) if CONTROL in late else None}
    return rows


def control_readings(late: dict, late_ema: dict | None, fvd: dict | None) -> dict:
    """A seed's dense control (a second dense run of the same command) beside DSV, each as its gap to dense: the
    late-mean loss of the weights and of their average, and the FVD of both (None where the report lacks one)."""

    def gaps(values: dict | None, control: str, dsv: str) -> dict | None:
        if not values or control not in values or dsv not in values:
            return None
        return {"control": values[control] / values[dense_reference(control)] - 1,
                "dsv": values[dsv] / values[dense_reference(dsv)] - 1}

    return {"loss": gaps(late, CONTROL, "dsv"), "loss_ema": gaps(late_ema, CONTROL, "dsv"),
            "fvd": gaps(fvd, CONTROL, "dsv"), "fvd_ema": gaps(fvd, average_set(CONTROL), average_set("dsv"))}


def gaps_by_step(tables: dict[str, list[dict]]) -> list[dict]:
    """Per evaluation step that every seed's held-out table has (`tables`: seed → `[{"step", "dense", "dsv",
    "window", ...}]`), the mean and median over the seeds of DSV's and window's gap to dense: the late means average
    a run's last evaluations, this shows whether a gap opens or closes as training goes on."""
    steps = sorted(set.intersection(*({row["step"] for row in table} for table in tables.values()))) if tables else []
    by_step = []
    for step in steps:
        entry = {"step": step, "seeds": len(tables)}
        for mode in ("dsv", "window"):
            per = [row[mode] / row["dense"] - 1 for table in tables.values() for row in table if row["step"] == step]
            entry[mode] = {"mean": statistics.fmean(per), "median": statistics.median(per)}
        by_step.append(entry)
    return by_step


def plot_gaps_by_step(tables: dict[str, list[dict]], tables_ema: dict[str, list[dict]], by_step: list[dict],
                      by_step_ema: list[dict], path: Path) -> None:
    """DSV's and window's held-out gap to dense at each evaluation step: each seed's faint, the median over seeds
    bold; the weights in one panel and, where seeds kept one, their moving averages in another; the loss
    target's bound dashed."""
    import matplotlib.pyplot as plt

    panels = [(tables, by_step, "the weights")] + ([(tables_ema, by_step_ema, "the weights' moving averages")]
                                                    if by_step_ema else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (per_seed, medians, title) in zip(axes[0], panels):
        every_gap = []
        for mode, color in (("dsv", "tab:orange"), ("window", "tab:green")):
            for table in per_seed.values():
                gaps = [100 * (r[mode] / r["dense"] - 1) for r in table]
                every_gap += gaps
                ax.plot([r["step"] for r in table], gaps, color=color, lw=0.8, alpha=0.3)
            ax.plot([e["step"] for e in medians], [100 * e[mode]["median"] for e in medians], color=color, lw=2,
                    marker="o", ms=3, label=f"{mode} vs dense, median over {medians[0]['seeds']} seeds")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.axhline(100 * LOSS_TOLERANCE, color="grey", ls="--", lw=0.8, label="loss target's bound")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss vs dense (%)")
        # One evaluation of one seed can swing by tens of percent: the axis ends at the 2nd/98th percentile of the
        # seeds' gaps (widened a little) so that the medians stay readable; the cut lines leave the plot.
        low, high = np.percentile(every_gap + [100 * LOSS_TOLERANCE, 0.0], [2, 98])
        ax.set_ylim(low - 0.15 * (high - low), high + 0.15 * (high - low))
        ax.set_title(f"held-out loss gap, {title}\n(axis cut at the 2nd/98th percentile of the seeds' gaps)",
                     fontsize=10)
        ax.legend(fontsize=8)
    save_figure(fig, path)


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


def half_width(standard_error: float, seeds: int) -> float:
    """Half the `CONFIDENCE` t-interval of a mean of ``seeds`` values with this standard error."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.5 + CONFIDENCE / 2, seeds - 1)) * standard_error


def resolution(gap: float, standard_error: float | None, tolerance: float, seeds: int) -> str:
    """Whether the `CONFIDENCE` t-interval `gap ± t · standard_error` (the mean of `seeds` per-seed gaps and its
    standard error) lies at or under the bound `+tolerance` (resolved: met), above it (resolved: missed) or across
    it (not resolved); lower is better, so the bound is one-sided (`TOLERANCE_RULE`)."""
    if standard_error is None or seeds < 2:
        return "not resolved (one seed)"
    low, high = gap - half_width(standard_error, seeds), gap + half_width(standard_error, seeds)
    if meets_tolerance(high, tolerance):
        return f"resolved: met ({low:+.1%}…{high:+.1%})"
    if not meets_tolerance(low, tolerance):
        return f"resolved: missed ({low:+.1%}…{high:+.1%})"
    needed = seeds_to_resolve(gap, standard_error * math.sqrt(seeds), tolerance, seeds)
    return (f"not resolved: {low:+.1%}…{high:+.1%} crosses +{tolerance:.0%}; at this mean and spread "
            + (f"the interval's edge reaches the bound at about {needed} seeds (about even odds of resolving it "
               "there)" if needed else f"more than {MOST_SEEDS} seeds would not resolve it"))


def seeds_to_resolve(gap: float, spread: float, tolerance: float, seeds: int) -> int | None:
    """The fewest seeds above ``seeds`` whose `CONFIDENCE` t-interval around ``gap`` would lie on one side of
    ``+tolerance`` if the mean of the per-seed gaps stayed ``gap`` and their standard deviation ``spread`` (a
    planning figure: both move as seeds are added, so where the true gap is ``gap`` that count resolves the target
    about half the time); None beyond `MOST_SEEDS`."""
    for count in range(seeds + 1, MOST_SEEDS + 1):
        if half_width(spread / math.sqrt(count), count) < abs(tolerance - gap):
            return count
    return None


def targets(loss: dict, fvd: dict | None, rows: dict[str, dict], loss_ema: dict | None = None,
            fvd_ema: dict | None = None) -> list[dict]:
    """The loss, FVD and window targets on the means over seeds, each with the per-seed spread. A seed whose DSV
    run had no sparse block (`seed_rows`' "no_sparse_block") trained dense attention: as in `dsv bench quality`,
    the targets whose means include it are n/a (met None), their numbers kept and the seeds named. ``loss_ema``
    and ``fvd_ema`` (the seeds whose runs kept a moving average of their weights, of one decay) add the loss and
    FVD targets' readings on it."""
    dense_only = [seed for seed in loss["seeds"] if rows[seed]["no_sparse_block"]]

    def not_judged(seeds: list[str]) -> str:
        return (f"; not judged: DSV ran no sparse block in seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}, "
                "so the means compare dense attention with dense attention there (run-to-run noise)") if seeds else ""

    def gap_row(what: str, stats: dict, mode: str, tolerance: float) -> dict:
        gap = stats["gaps"][mode]
        error = gap["standard_error"]
        unjudged = [seed for seed in stats["seeds"] if seed in dense_only]
        return {"target": f"DSV {what} within {tolerance:.0%} of dense",
                "measured": f"{gap['of_means']:+.2%} over {len(stats['seeds'])} seeds (per seed "
                            + ", ".join(f"{g:+.2%}" for g in gap["per_seed"]) + ")" + not_judged(unjudged),
                "met": None if unjudged else bool(meets_tolerance(gap["of_means"], tolerance)),
                "spread": "-" if error is None else f"mean of the per-seed gaps {gap['mean_of_gaps']:+.2%} ± "
                                                    f"{error:.2%} (standard error)",
                "resolution": "-" if unjudged else resolution(gap["mean_of_gaps"], error, tolerance,
                                                              len(stats["seeds"]))}

    judged = [gap_row("held-out loss", loss, "dsv", LOSS_TOLERANCE)]
    if loss_ema is not None:
        judged.append(gap_row(f"held-out loss of the weights' moving average (train.ema_decay={loss_ema['ema_decay']})",
                              loss_ema, "dsv", LOSS_TOLERANCE))
    if fvd is not None:
        judged.append(gap_row("FVD", fvd, "dsv", FVD_TOLERANCE))
    if fvd_ema is not None:
        judged.append(gap_row(f"FVD of the weights' moving average (train.ema_decay={fvd_ema['ema_decay']})",
                              fvd_ema, "dsv", FVD_TOLERANCE))
    worse = {"loss": loss["means"]["window"] > max(loss["means"]["dense"], loss["means"]["dsv"])}
    if fvd is not None:
        worse["FVD"] = fvd["means"]["window"] > max(fvd["means"]["dense"], fvd["means"]["dsv"])
    window_seeds = {"loss": loss, "FVD": fvd}
    # Its loss uses every seed's DSV run (the FVD a subset of them): judged only where that target is.
    judged.append({"target": "window worse than both (held-out loss and FVD)",
                   "measured": "; ".join(
                       f"{what}: window {window_seeds[what]['gaps']['window']['of_means']:+.2%}, DSV "
                       f"{window_seeds[what]['gaps']['dsv']['of_means']:+.2%} against dense" for what in worse)
                   + not_judged(dense_only),
                   "met": None if dense_only else all(worse.values()),
                   "spread": "; ".join(f"{what}: window worst in {_worst_count(window_seeds[what])} of "
                                       f"{len(window_seeds[what]['seeds'])} seeds" for what in worse),
                   "resolution": "-" if dense_only else "; ".join(
                       f"{what}: {window_resolution(window_seeds[what])}" for what in worse)})
    return judged


def window_margins(stats: dict) -> list[float]:
    """Per seed, how much worse the window is than the worse of dense and DSV: its gap to dense minus the larger
    of 0 (dense) and DSV's gap; above 0 where the window is worse than both in that seed."""
    window, dsv = stats["gaps"]["window"]["per_seed"], stats["gaps"]["dsv"]["per_seed"]
    return [w - max(0.0, d) for w, d in zip(window, dsv)]


def window_resolution(stats: dict) -> str:
    """Whether the `CONFIDENCE` t-interval of the mean per-seed margin (`window_margins`) lies above 0 (resolved:
    worse than both), under it (resolved: not worse than both) or across it. Paired by seed, so it is stricter than
    the comparison of the means: a window worse than dense in one seed and than DSV in another has no margin."""
    margins = window_margins(stats)
    if len(margins) < 2:
        return "not resolved (one seed)"
    mean = statistics.fmean(margins)
    width = half_width(statistics.stdev(margins) / math.sqrt(len(margins)), len(margins))
    interval = f"mean per-seed margin over the worse of dense and DSV {mean:+.2%}, {mean - width:+.1%}…" \
               f"{mean + width:+.1%}"
    if mean - width > 0:
        return f"resolved: worse than both ({interval})"
    if mean + width < 0:
        return f"resolved: not worse than both ({interval})"
    return f"not resolved ({interval} crosses 0)"


def _worst_count(stats: dict) -> int:
    """Seeds where window is above both dense and DSV (its per-seed gap above 0 and above DSV's)."""
    return sum(margin > 0 for margin in window_margins(stats))


def code_column(results: dict) -> str:
    """A report's code version in the reports table: the first 10 hex digits of its sources' hash, "-" where
    results.json predates recording it."""
    return results["code"]["source_sha256"][:10] if "code" in results else "-"


def render(reports: list[tuple[str, dict]], rows: dict[str, dict], loss: dict, fvd: dict | None,
           judged: list[dict], command: str, loss_ema: dict | None = None, fvd_ema: dict | None = None,
           by_step: list[dict] | None = None, by_step_ema: list[dict] | None = None) -> str:
    first = reports[0][1]
    lines = [f"# Quality over training seeds: {len(rows)} seeds from {len(reports)} reports", "",
             "```", command, "```", "",
             f"Recipe `{first['recipe']}` with {' '.join(first['overrides']) or 'no overrides'}: {first['model']}; "
             f"{first['steps']} steps of batch {first['batch_size']}. FVD: {first['videos']} samples per run "
             f"({first['sample_steps']} Euler steps, sampling seed {sampling_seed(first)}) against the same "
             f"{first['videos']} held-out clips in every report. Loss: each seed's mean held-out loss over its "
             "late evaluations, as in each report.", "",
             "| report | date | machine | code | training seeds | FVD of seeds |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {results.get('date', '-')} | {results.get('machine', '-')} | {code_column(results)} | "
              f"{', '.join(map(str, results['seeds']))} | {', '.join(fvd_seeds(results))} |"
              for name, results in reports]
    recipe_only = checked_without_config(reports)
    if recipe_only:
        lines += ["", "Checked by recipe and overrides only (no resolved config to compare: written before `dsv bench "
                  "quality` recorded it, so a recipe default changed between code versions would go unseen): "
                  f"{', '.join(recipe_only)}."]
    else:
        lines += ["", "Every report's resolved config is the first's (but for "
                  f"{', '.join(CONFIG_FIELDS_NOT_COMPARED)})."]
    hashes = {results["code"]["source_sha256"] for _, results in reports if "code" in results}
    if len(hashes) > 1:
        lines += ["", f"The reports come from {len(hashes)} code versions (the code column: the hash of the dsv "
                  "sources, which any edit changes, a docstring's too): information, not a refusal."]
    lines += ["", "## Targets on the means over seeds", "",
              "| target | measured | result | spread over seeds | resolved by this many seeds? |",
              "|---|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {result_mark(t['met'])} | {t['spread']} | {t['resolution']} |"
              for t in judged]
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
    if loss_ema is not None:
        others = (f" (not seeds {', '.join(loss_ema['other_decays'])}, whose runs averaged with another decay)"
                  if loss_ema["other_decays"] else "")
        lines += ["", f"The weights' moving average (train.ema_decay={loss_ema['ema_decay']}), at the same "
                  f"evaluations, in the seeds whose runs kept one{others}:", "",
                  "| seed | dense | DSV | window | DSV vs dense | window vs dense |",
                  "|---|---|---|---|---|---|"]
        for seed in loss_ema["seeds"]:
            values = rows[seed]["loss_ema"]
            lines.append(f"| {seed} | {values['dense']:.4f} | {values['dsv']:.4f} | {values['window']:.4f} | "
                         f"{values['dsv'] / values['dense'] - 1:+.2%} | "
                         f"{values['window'] / values['dense'] - 1:+.2%} |")
        means = loss_ema["means"]
        lines.append(f"| mean over seeds | {means['dense']:.4f} | {means['dsv']:.4f} | {means['window']:.4f} | "
                     f"{loss_ema['gaps']['dsv']['of_means']:+.2%} | {loss_ema['gaps']['window']['of_means']:+.2%} |")
    lines += by_step_section(by_step or [], by_step_ema or [], len(rows))
    dense_only = {name: [seed for seed, row in rows.items() if row["report"] == name and row["no_sparse_block"]]
                  for name, _ in reports}
    if any(dense_only.values()):
        lines += ["", "Seeds whose DSV run trained dense attention (the targets whose means include them say n/a): "
                  + "; ".join(f"{name}: {no_sparse_block_text(results, dense_only[name])}"
                              for name, results in reports if dense_only[name]) + "."]
    unrecorded = [name for name, _ in reports
                  if any(row["no_sparse_block"] is None for row in rows.values() if row["report"] == name)]
    if unrecorded:
        lines += ["", "Reports that do not record per seed whether DSV ran a sparse block (written before `dsv bench "
                  f"quality` recorded it), their seeds judged as if it did: {', '.join(unrecorded)}."]
    if fvd is not None:
        sets = list(fvd["means"])
        lines += ["", "## FVD per seed", "", "| seed | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        lines += [f"| {seed} | " + " | ".join(f"{rows[seed]['fvd'][s]:.1f}" for s in sets) + " |"
                  for seed in fvd["seeds"]]
        lines.append("| mean over seeds | " + " | ".join(f"{fvd['means'][s]:.1f}" for s in sets) + " |")
        lines.append("| mean vs dense | " + " | ".join(
            "-" if s == "dense" else f"{fvd['gaps'][s]['of_means']:+.1%}" for s in sets) + " |")
        partial = sorted({s for seed in fvd["seeds"] for s in rows[seed]["fvd"] if not s.endswith(AVERAGE_SUFFIX)}
                         - set(sets))
        if partial:
            lines += ["", f"FVD sets not in every seed's report (left out of the means): {', '.join(partial)}."]
        if fvd_ema is not None:
            lines += ["", f"The runs' moving averages of their weights (train.ema_decay={fvd_ema['ema_decay']}), "
                      "sampled from the same noise:", "", "| seed | dense | DSV | window | DSV vs dense |",
                      "|---|---|---|---|---|"]
            for seed in fvd_ema["seeds"]:
                f = rows[seed]["fvd"]
                lines.append(f"| {seed} | " + " | ".join(f"{f[average_set(m)]:.1f}" for m in MODES)
                             + f" | {f[average_set('dsv')] / f[average_set('dense')] - 1:+.1%} |")
            means = fvd_ema["means"]
            lines.append(f"| mean over seeds | {means['dense']:.1f} | {means['dsv']:.1f} | {means['window']:.1f} | "
                         f"{fvd_ema['gaps']['dsv']['of_means']:+.1%} |")
        unscored = [seed for seed, row in rows.items() if row["fvd"] is None]
        if unscored:
            lines += ["", "Seeds whose models no report sampled (the FVD's seeds exclude them): "
                      f"{', '.join(unscored)}."]
    lines += control_section(rows)
    return "\n".join(lines) + "\n"


def by_step_section(by_step: list[dict], by_step_ema: list[dict], num_seeds: int) -> list[str]:
    """The held-out gaps to dense at each evaluation step (`gaps_by_step`), of the weights and, where seeds kept
    one, of their moving average."""
    if not by_step:
        return []
    seeds = by_step[0]["seeds"]
    ema = {entry["step"]: entry for entry in by_step_ema}
    lines = ["", "## Held-out loss gap to dense by evaluation step (gaps_by_step.png)", "",
             f"At each evaluation, each mode's gap to dense: mean / median over the {seeds} seeds"
             + (f" whose reports kept every evaluation (of {num_seeds})" if seeds < num_seeds else "")
             + (f"; the weights' moving averages over the {by_step_ema[0]['seeds']} seeds that kept one" if ema
                else "") + ". The late means above average the last evaluations; this shows whether a gap opens "
             "or closes as training goes on.", "",
             "| step | DSV vs dense | window vs dense |" + (" DSV, averages | window, averages |" if ema else ""),
             "|---|---|---|" + ("---|---|" if ema else "")]

    def cell(entry: dict, mode: str) -> str:
        return f"{entry[mode]['mean']:+.2%} / {entry[mode]['median']:+.2%}"

    for entry in by_step:
        row = f"| {entry['step']} | {cell(entry, 'dsv')} | {cell(entry, 'window')} |"
        if ema:
            row += (f" {cell(ema[entry['step']], 'dsv')} | {cell(ema[entry['step']], 'window')} |"
                    if entry["step"] in ema else " - | - |")
        lines.append(row)
    return lines


def control_section(rows: dict[str, dict]) -> list[str]:
    """The seeds with a dense control: DSV's gap to dense beside the control's, for each reading. The control
    trains the dense command again, so its gap is what the runs' nondeterminism alone makes of one seed."""
    controlled = {seed: row["control"] for seed, row in rows.items() if row["control"]}
    if not controlled:
        return []
    readings = (("loss", "loss"), ("loss_ema", "loss of the average"), ("fvd", "FVD"),
                ("fvd_ema", "FVD of the averages"))

    def cell(gap: dict | None, who: str) -> str:
        return "-" if gap is None else f"{gap[who]:+.2%}"

    lines = ["", "## Run-to-run noise: dense controls", "",
             "A second dense run per seed from the same command (`--dense-control`): its gap to dense is what the "
             "runs' nondeterminism alone makes of one seed, the floor under any per-seed gap of DSV. "
             "Each reading as DSV vs dense / control vs dense (the averages against dense's average).", "",
             "| seed | " + " | ".join(name for _, name in readings) + " |", "|---|" + "---|" * len(readings)]
    lines += [f"| {seed} | " + " | ".join(f"{cell(c[key], 'dsv')} / {cell(c[key], 'control')}" for key, _ in readings)
              + " |" for seed, c in controlled.items()]
    return lines


def run(args) -> int:
    reports = load_reports(args.results)
    check_comparable(reports)
    rows = seed_rows(reports)
    loss = over_seeds({seed: row["loss"] for seed, row in rows.items()})
    # Averages of other decays measure other things: the seeds of the first decay found, the others named.
    decays = list(dict.fromkeys(row["ema_decay"] for row in rows.values() if row["ema_decay"] is not None))
    averaged = {seed: row["loss_ema"] for seed, row in rows.items() if decays and row["ema_decay"] == decays[0]}
    loss_ema = ({**over_seeds(averaged), "ema_decay": decays[0],
                 "other_decays": [seed for seed, row in rows.items() if row["ema_decay"] not in (None, decays[0])]}
                if averaged else None)
    # The averages' FVD has rows of its own (one decay, compared with dense's average): not in the weights' table.
    scored = {seed: {name: value for name, value in row["fvd"].items() if not name.endswith(AVERAGE_SUFFIX)}
              for seed, row in rows.items() if row["fvd"] is not None}
    fvd = over_seeds(scored) if scored else None
    # The FVD of the averages: the seeds of that decay whose report sampled every run's average.
    fvd_averaged = {seed: {mode: rows[seed]["fvd"][average_set(mode)] for mode in MODES} for seed in averaged
                    if rows[seed]["fvd"] and all(average_set(mode) in rows[seed]["fvd"] for mode in MODES)}
    fvd_ema = {**over_seeds(fvd_averaged), "ema_decay": decays[0]} if fvd_averaged else None
    judged = targets(loss, fvd, rows, loss_ema, fvd_ema)
    tables = {seed: row["heldout"] for seed, row in rows.items() if row["heldout"]}
    tables_ema = {seed: rows[seed]["heldout_ema"] for seed in averaged if rows[seed]["heldout_ema"]}
    by_step, by_step_ema = gaps_by_step(tables), gaps_by_step(tables_ema)
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "results.json", json.dumps(
        {"reports": [name for name, _ in reports],
         "checked_by_recipe_and_overrides_only": checked_without_config(reports), "seeds": rows, "loss": loss,
         "loss_ema": loss_ema, "fvd": fvd, "fvd_ema": fvd_ema, "targets": judged, "loss_gaps_by_step": by_step,
         "loss_ema_gaps_by_step": by_step_ema}, indent=1))
    if by_step:
        plot_gaps_by_step(tables, tables_ema, by_step, by_step_ema, args.out / "gaps_by_step.png")
    command = shlex.join(["dsv", "bench", "quality-seeds", "--results", *map(str, args.results), "--out", "OUT"])
    report = render(reports, rows, loss, fvd, judged, command, loss_ema, fvd_ema, by_step, by_step_ema)
    write_text_atomic(args.out / "report.md", report)
    print(report)
    return 0
