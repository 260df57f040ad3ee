"""`dsv sample`: generate videos from a checkpoint and write them as one mp4 or GIF grid."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dsv.analysis.checkpointed_model import load_model
from dsv.modules.dit import sample_euler
from dsv.train.video_io import write_video


def to_uint8_grid(videos: torch.Tensor, columns: int) -> torch.Tensor:
    """`[N, 3, T, H, W]` in [-1, 1] → one uint8 video `[T, rows*H, columns*W, 3]` tiling the samples."""
    n, c, t, h, w = videos.shape
    rows = -(-n // columns)
    pad = rows * columns - n
    if pad:
        videos = torch.cat([videos, videos.new_full((pad, c, t, h, w), -1.0)])
    grid = videos.view(rows, columns, c, t, h, w).permute(3, 0, 4, 1, 5, 2).reshape(t, rows * h, columns * w, c)
    return ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def sample_videos(checkpoint: str, out: str, num: int = 4, steps: int = 25, seed: int = 0,
                  device: str = "auto", attention_mode: str | None = None, fps: int = 8) -> dict:
    model, cfg, step = load_model(checkpoint, device, attention_mode)
    dev = next(model.parameters()).device
    shape = (num, cfg.model.in_channels, cfg.data.frames, cfg.data.size, cfg.data.size)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" and cfg.train.bf16):
        videos = sample_euler(model, noise, steps)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    frames = to_uint8_grid(videos.float().cpu(), columns=min(num, 4))
    write_video(frames, Path(out), fps=fps)
    paths = sorted({layer.last_path for layer in model.controller.layers})
    return {"out": out, "checkpoint_step": step, "seconds": seconds, "attention_paths": paths,
            "mode": cfg.attention.mode}
