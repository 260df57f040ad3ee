"""`dsv` command line: train, sample, profile, bench."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dsv.modules.config import FIXED_MODES
from dsv.train.checkpoint import CheckpointError, checkpoint_step

EXIT_UNFINISHED = 3
"""Exit status of `dsv train` stopped by `train.max_minutes` (and of `dsv bench quality` whose runs did not all
finish): a job script can tell it from a finished run and requeue with `--resume`."""


def _train(args) -> int:
    from dsv.train.config import apply_overrides
    from dsv.train.recipes import get_recipe
    from dsv.train.trainer import Trainer

    cfg = apply_overrides(get_recipe(args.recipe), args.set or [])
    # Checked before the trainer starts: resuming drops the log records after the checkpoint's step.
    start = checkpoint_step(cfg.train.out_dir) if args.resume else 0
    if start is not None and cfg.train.steps <= start:
        where = f"the checkpoint in {cfg.train.out_dir} is at step {start}" if args.resume else "a new run"
        raise ValueError(f"train.steps={cfg.train.steps} leaves nothing to train ({where}); set train.steps above "
                         f"{start} (nothing was changed)")
    trainer = Trainer(cfg, resume=args.resume)
    result = trainer.run()
    if trainer.rank == 0:
        ended = (f"stopped at step {trainer.step} of {cfg.train.steps} (train.max_minutes); continue with --resume"
                 if result["stopped_at_time_limit"] else f"done: step {trainer.step}")
        mode = cfg.attention.mode
        switch = (f"no stage switch (attention.mode={mode})" if mode in FIXED_MODES else
                  f"switch step {result['switch_step']}" + (" (still in stage 1)" if result["switch_step"] < 0 else ""))
        print(f"{ended}, final loss {result.get('loss', float('nan')):.4f}, "
              f"held-out loss {result.get('heldout_loss', float('nan')):.4f}, {switch}, "
              f"sparse blocks {result['sparse_blocks_list']}")
    if torch.distributed.is_initialized():  # started by the trainer under torchrun
        torch.distributed.destroy_process_group()
    return EXIT_UNFINISHED if result["stopped_at_time_limit"] else 0


def _sample(args) -> int:
    from dsv.analysis.sample import sample_videos

    if args.noise_level_budgets and args.kept_mass is None:
        raise ValueError("--noise-level-budgets needs --kept-mass: the share of the attention mass each selection "
                         "keeps (e.g. 0.97; the trained budgets keep about attention.recall_target * theta)")
    if not args.noise_level_budgets and (args.kept_mass is not None or args.calibration_clips is not None):
        raise ValueError("--kept-mass and --calibration-clips set the calibration of --noise-level-budgets; "
                         "add --noise-level-budgets")
    result = sample_videos(args.checkpoint, args.out, num=args.num, steps=args.steps, seed=args.seed,
                           device=args.device, attention_mode=args.attention_mode, compare_dense=args.compare_dense,
                           average_weights=args.average_weights,
                           calibration=({"kept_mass": args.kept_mass, "clips": args.calibration_clips or 8}
                                        if args.noise_level_budgets else None))
    print(json.dumps(result, indent=1, allow_nan=False))
    return 0


def _profile(args) -> int:
    from dsv.analysis.profile import profile_checkpoint

    result = profile_checkpoint(args.checkpoint, args.out, device=args.device, clips=args.clips, theta=args.theta,
                                granularity_keep=tuple(args.granularity), noise_levels=tuple(args.noise_levels),
                                window=args.window)
    print(result["table"])
    print("wrote: " + ", ".join(result["files"]))
    return 0


def _bench(args) -> int:
    if args.what == "kernels":
        from dsv.bench.kernels import run

        return run(args)
    if args.what == "train":
        from dsv.bench.train import run

        return run(args)
    if args.what == "quality":
        from dsv.bench.quality import run

        return run(args)
    if args.what == "quality-seeds":
        from dsv.bench.quality_seeds import run

        return run(args)
    raise AssertionError(args.what)


def _int_at_least(minimum: int, maximum: int | None = None):
    expected = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
"""argparse type: an int >= 1."""
non_negative_int = _int_at_least(0)
"""argparse type: an int >= 0."""
sampling_seed = _int_at_least(0, 2**64 - 2)
"""argparse type: a noise seed that torch.Generator takes, with one more after it (calibration noise: seed + 1)."""


def float_where(expected: str, accepts):
    """argparse type: a float that `accepts`, else an error saying `expected`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


positive_float = float_where("a finite number > 0", lambda value: 0 < value < float("inf"))
"""argparse type: a finite float > 0."""
fraction = float_where("a fraction in (0, 1]", lambda value: 0.0 < value <= 1.0)
"""argparse type: a fraction in (0, 1] (of the keys kept, say)."""
kept_mass = float_where("a share of the attention mass in (0, 1]", lambda value: 0.0 < value <= 1.0)
"""argparse type: a share of the attention mass in (0, 1]."""


def device_name(text: str) -> str:
    """argparse type: "auto" or a device this machine has: "cpu", "cuda" or "cuda:N"."""
    from dsv.train.config import device_absence, parse_device

    try:
        device = parse_device(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    absent = None if device is None else device_absence(device)
    if absent is not None:
        raise argparse.ArgumentTypeError(f"{text!r}, but {absent}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv", description="DSV: dynamic sparse attention for video DiT training")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a video DiT with a named recipe")
    train.add_argument("--recipe", default="debug_cpu", help="recipe name (see dsv.train.recipes)")
    train.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="override a config field")
    train.add_argument("--resume", action="store_true", help="continue the run in train.out_dir exactly")
    train.set_defaults(func=_train)

    sample = sub.add_parser("sample", help="write generated videos (mp4 or gif) from a checkpoint")
    sample.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    sample.add_argument("--out", default="samples.mp4", help="output file (.mp4 or .gif)")
    sample.add_argument("--num", type=positive_int, default=4, help="samples to write")
    sample.add_argument("--steps", type=positive_int, default=25, help="Euler steps")
    sample.add_argument("--seed", type=sampling_seed, default=0)
    sample.add_argument("--device", type=device_name, default="auto")
    sample.add_argument("--attention-mode", default=None, help="override the attention mode (e.g. dense)")
    sample.add_argument("--average-weights", action="store_true",
                        help="sample the moving average of the trained weights (runs with train.ema_decay > 0)")
    sample.add_argument("--compare-dense", action="store_true",
                        help="also sample the same noise densely: times and PSNR/SSIM against dense")
    sample.add_argument("--noise-level-budgets", action="store_true",
                        help="calibrate each layer's per-head budget (and sparse or dense) by noise level on training "
                             "clips, so that every selection keeps --kept-mass of the attention mass at each step")
    sample.add_argument("--kept-mass", type=kept_mass, default=None,
                        help="with --noise-level-budgets: share of the attention mass in (0, 1] each selection keeps "
                             "(more: closer to dense samples, slower)")
    sample.add_argument("--calibration-clips", type=positive_int, default=None,
                        help="with --noise-level-budgets: training clips the calibration measures on (default 8)")
    sample.set_defaults(func=_sample)

    profile = sub.add_parser("profile", help="per-layer × per-head sparsity and recall heatmaps from a checkpoint")
    profile.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    profile.add_argument("--out", default="profile", help="output folder")
    profile.add_argument("--clips", type=positive_int, default=8, help="held-out clips to measure on")
    profile.add_argument("--theta", type=float, default=None, help="critical mass (default: the run's)")
    profile.add_argument("--device", type=device_name, default="auto")
    profile.add_argument("--granularity", type=fraction, nargs="*", default=[], metavar="KEPT",
                         help="also compare token-level vs key-cube selection recall at these kept fractions")
    profile.add_argument("--noise-levels", type=float, nargs="*", default=[], metavar="T",
                         help="also measure at each of these noise levels t in [0, 1] (1: pure noise) the sparsity and "
                              "the recall of each sparse block's selection at its dispatched budget, as sparse "
                              "sampling runs it")
    profile.add_argument("--window", action="store_true",
                         help="also the attention mass inside the window baseline's boxes (attention.window_frac) "
                              "against the exact top key blocks and the run's own selection at the same budget")
    profile.set_defaults(func=_profile)

    from dsv.analysis import observations

    observe = sub.add_parser("observe", help="the paper's attention observations on a checkpoint, as plots")
    observations.add_arguments(observe)
    observe.set_defaults(func=observations.run)

    plan = sub.add_parser("plan", help="context-parallel plan per block (HCP, SCP, hybrid) from a sparsity profile")
    from dsv.parallel import plan_cli

    plan_cli.add_arguments(plan)
    plan.set_defaults(func=plan_cli.run)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="what", required=True)
    from dsv.bench.kernels import add_arguments as add_kernel_arguments

    add_kernel_arguments(bench_sub.add_parser("kernels", help="sparse kernels vs dense cuDNN and FlexAttention (GPU)"))
    from dsv.bench.train import add_arguments as add_train_arguments

    add_train_arguments(bench_sub.add_parser("train", help="training-step time: dense vs window vs DSV stage 2"))
    from dsv.bench.quality import add_arguments as add_quality_arguments

    add_quality_arguments(bench_sub.add_parser(
        "quality", help="dense vs DSV vs window trained from scratch: held-out loss, FVD, sparse sampling, report"))
    from dsv.bench.quality_seeds import add_arguments as add_quality_seeds_arguments

    add_quality_seeds_arguments(bench_sub.add_parser(
        "quality-seeds", help="the quality targets over the training seeds of several `dsv bench quality` reports"))
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, CheckpointError, FloatingPointError) as err:
        # Errors about the user's input, config or files: one clear line. Anything else keeps its traceback.
        print(f"dsv {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
