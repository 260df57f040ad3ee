"""`dsv sample`: generate videos from a checkpoint and write them as one mp4 or GIF grid."""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dsv.analysis.checkpointed_model import load_model, run_precision
from dsv.analysis.noise_budgets import NoiseLevelBudgets, calibrate_noise_level_budgets, noise_level_budgets
from dsv.modules.dit import VideoDiT, sample_euler
from dsv.train.config import Config
from dsv.train.video_io import check_fps, check_writable, write_video


def to_uint8_grid(videos: torch.Tensor, columns: int, even: bool = False) -> torch.Tensor:
    """`[N, 3, T, H, W]` in [-1, 1] → one uint8 video `[T, rows*H, columns*W, 3]` tiling the samples; with
    `even`, a black last row and column are added where the grid's height or width is odd (an .mp4's 4:2:0
    chroma needs even sizes, and its writer would refuse the grid only after all the sampling)."""
    n, c, t, h, w = videos.shape
    rows = -(-n // columns)
    pad = rows * columns - n
    if pad:
        videos = torch.cat([videos, videos.new_full((pad, c, t, h, w), -1.0)])
    grid = videos.view(rows, columns, c, t, h, w).permute(3, 0, 4, 1, 5, 2).reshape(t, rows * h, columns * w, c)
    if even:
        grid = torch.nn.functional.pad(grid, (0, 0, 0, grid.shape[2] % 2, 0, grid.shape[1] % 2), value=-1.0)
    return ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def generate(model: VideoDiT, cfg: Config, num: int, steps: int, seed: int,
             budgets: NoiseLevelBudgets | None = None) -> tuple[torch.Tensor, float]:
    """`(videos [N, C, T, H, W] float32 on the CPU, seconds)`: `num` samples of a loaded model from the noise
    of `seed` (the same noise for any model of this data shape), in the run's precision; with `budgets`, each
    step's attention at the budgets of its noise level. The time covers the Euler steps alone,
    CUDA-synchronised at both ends."""
    dev = next(model.parameters()).device
    shape = (num, cfg.model.in_channels, cfg.data.frames, cfg.data.size, cfg.data.size)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    per_level = noise_level_budgets(model, budgets) if budgets is not None else contextlib.nullcontext()
    with run_precision(cfg, dev), per_level as before_step:
        videos = sample_euler(model, noise, steps, before_step=before_step)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return videos.float().cpu(), time.perf_counter() - start


def warm_up(model: VideoDiT, cfg: Config, num: int, seed: int, budgets: NoiseLevelBudgets | None = None) -> None:
    """Untimed forwards before a timed pass, so that kernel compilation, autotuning and one-time device setup do
    not land in its timing (of whichever model samples first): one Euler step, and with `budgets` one at each
    calibrated level's budgets (whose widest key lists can compile kernel variants of their own)."""
    generate(model, cfg, num, 1, seed)
    for i in range(len(budgets.levels) if budgets is not None else 0):
        generate(model, cfg, num, 1, seed, budgets.at_level(i))


def calibrate_for_sampling(model: VideoDiT, cfg: Config, kept_mass: float, sampling_batch: int, clips: int = 8,
                           seed: int = 0) -> NoiseLevelBudgets:
    """`calibrate_noise_level_budgets` at `kept_mass` for sampling `sampling_batch` videos at a time, on `clips`
    clips of the run's training data (drawn with `seed`), in the run's precision."""
    from dsv.train.data import build_dataset

    if isinstance(clips, bool) or not isinstance(clips, int) or clips < 1:
        raise ValueError(f"calibration clips must be an integer >= 1, got {clips!r}")
    data = build_dataset(cfg.data).sample(clips, torch.Generator().manual_seed(seed))
    dev = next(model.parameters()).device
    # Noise of its own (seed + 1): with the sampling seed, its first noises would be the first sampled ones.
    return calibrate_noise_level_budgets(model, data, kept_mass, sampling_batch, seed=seed + 1,
                                         bf16=dev.type == "cuda" and cfg.train.bf16)


# Wang et al.'s SSIM window: a Gaussian of sigma 1.5 truncated at 3.5 sigma, 11 taps.
SSIM_WINDOW = 11


def _generate(checkpoint: str, num: int, steps: int, seed: int, device: str, attention_mode: str | None,
              calibration: dict | None = None, average_weights: bool = False) -> tuple[torch.Tensor, float, dict]:
    """`(videos [N, C, T, H, W] float32 on the CPU, sampling seconds, facts)` from one checkpoint (its weights'
    moving average with `average_weights`); with `calibration` (`kept_mass` and `clips` of
    `calibrate_for_sampling`; its clips and noise derive from the sampling seed), at noise-level budgets."""
    model, cfg, step = load_model(checkpoint, device, attention_mode, average_weights)
    budgets = None if calibration is None else calibrate_for_sampling(model, cfg, sampling_batch=num, seed=seed,
                                                                       **calibration)
    warm_up(model, cfg, num, seed, budgets)
    videos, seconds = generate(model, cfg, num, steps, seed, budgets)
    # With budgets, `sparse_blocks` are the dispatched ones; the blocks each level ran sparse are in the summary.
    facts = {"checkpoint_step": step, "mode": cfg.attention.mode, "average_weights": average_weights,
             "attention_paths": attention_paths(model),
             "sparse_blocks": model.controller.sparse_layers()}
    if budgets is not None:
        facts["noise_level_budgets"] = budgets.summary()
        facts["calibration_seconds"] = budgets.seconds
        facts["ran_sparse"] = any(level["sparse_layers"] for level in facts["noise_level_budgets"])
    else:
        facts["ran_sparse"] = any(not path.startswith("dense:") for path in facts["attention_paths"])
    if not facts["ran_sparse"] and cfg.attention.mode != "dense":
        why = ("at no noise level did a block's calibrated budget pay against dense" if budgets is not None
               else "no block is dispatched sparse (a checkpoint from before the stage switch?)")
        warnings.warn(f"sampling a {cfg.attention.mode} checkpoint ran every block densely: {why}; its time and "
                      "samples are dense attention's", stacklevel=2)
    return videos, seconds, facts


def attention_paths(model: VideoDiT) -> list[str]:
    """The implementations the model's attention layers ran last (e.g. `dense:sdpa`, `sparse:triton`)."""
    return sorted({layer.last_path for layer in model.controller.layers})


def similarity(videos: torch.Tensor, reference: torch.Tensor) -> dict:
    """Mean PSNR (dB) and SSIM over the frames of `videos` against `reference`, both `[N, 3, T, H, W]` in
    [-1, 1].

    SSIM is Wang et al.'s (2004; 11-tap Gaussian window, sigma 1.5), on pixels mapped to [0, 1]: its luminance
    term assumes non-negative intensities, and on [-1, 1] a mid-grey frame 1% brighter than its reference
    scored 0.5. Frames smaller than 11 pixels are filtered with the same Gaussian (borders reflected) and its
    map is averaged over the centre left after cropping half the largest odd window that fits (`ssim_window`)
    from each side, skimage's border crop; below 3 pixels SSIM is None. A frame equal to its reference has
    infinite PSNR: such frames are counted in `identical_frames` and left out of the PSNR mean, which is None
    when every frame is identical (so the result stays valid JSON)."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    def frames(x: torch.Tensor):  # [N·T, H, W, 3] in [0, 1]
        return ((x.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).reshape(-1, *x.shape[-2:], x.shape[1]).numpy()

    a, b = frames(videos), frames(reference)
    differing = [(x, y) for x, y in zip(a, b) if (x != y).any()]
    psnr = [peak_signal_noise_ratio(y, x, data_range=1.0) for x, y in differing]
    side = min(a.shape[1:3])
    window = min(SSIM_WINDOW, side if side % 2 else side - 1)
    ssim = None
    if window >= 3:
        ssim = float(np.mean([structural_similarity(y, x, data_range=1.0, channel_axis=-1, gaussian_weights=True,
                                                    sigma=1.5, use_sample_covariance=False, win_size=window)
                              for x, y in zip(a, b)]))
    return {"psnr_db": float(sum(psnr) / len(psnr)) if psnr else None, "ssim": ssim, "ssim_window": window,
            "identical_frames": len(a) - len(differing), "frames": len(a)}


def sample_videos(checkpoint: str, out: str, num: int = 4, steps: int = 25, seed: int = 0,
                  device: str = "auto", attention_mode: str | None = None, fps: int = 8,
                  compare_dense: bool = False, calibration: dict | None = None, average_weights: bool = False) -> dict:
    """Write `num` samples as one video grid. With `compare_dense`, also sample the same noise with dense
    attention and report both sampling times and the PSNR/SSIM of these samples against the dense ones. With
    `calibration` (`{"kept_mass": ..., "clips": ...}`), each step runs at budgets calibrated for its noise level
    (`dsv.analysis.noise_budgets`), summarised in the result. With `average_weights`, the run's moving average of
    its weights (`train.ema_decay`) samples, the dense comparison's too.
    Bad arguments (`num` or `steps` below 1, an `fps` not above 0, an `out` the writer cannot write here: another
    suffix, or .mp4 without PyAV) raise ValueError before any sampling."""
    if num < 1:
        raise ValueError(f"num must be >= 1 (samples to write), got {num}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (Euler steps; 0 would write the initial noise), got {steps}")
    check_writable(out)
    check_fps(fps)
    videos, seconds, facts = _generate(checkpoint, num, steps, seed, device, attention_mode, calibration,
                                       average_weights)
    write_video(to_uint8_grid(videos, columns=min(num, 4), even=Path(out).suffix.lower() == ".mp4"), Path(out),
                fps=fps)
    result = {"out": out, "seconds": seconds, **facts}
    if compare_dense:
        dense, dense_seconds, _ = _generate(checkpoint, num, steps, seed, device, "dense",
                                            average_weights=average_weights)
        result.update({"dense_seconds": dense_seconds, "speedup_vs_dense": dense_seconds / seconds,
                       **similarity(videos, dense)})
    return result
