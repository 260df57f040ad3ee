"""Named recipes: each returns a complete `Config`; variations are `--set` overrides, not copies."""

from __future__ import annotations

import dataclasses
from typing import Callable

from dsv.modules.config import AttentionConfig
from dsv.modules.dit import ModelConfig
from dsv.train.config import Config, OptimConfig, TrainConfig
from dsv.train.data import DataConfig

RECIPES: dict[str, Callable[[], Config]] = {}


def recipe(fn: Callable[[], Config]) -> Callable[[], Config]:
    RECIPES[fn.__name__] = fn
    return fn


def get_recipe(name: str) -> Config:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; available: {sorted(RECIPES)}")
    return RECIPES[name]()


@recipe
def debug_cpu() -> Config:
    """A tiny DiT on the bundled real video that trains on 2 CPU cores in under 3 minutes and goes
    through both stages: 8 frames of 32×32 pixels, 1×4×4 patches → an 8×8×8 grid of 512 tokens.

    At this size and training length attention is still diffuse (head sparsity ~0.3–0.45 at θ = 0.9,
    against 0.8–0.99 in the paper's trained 2.7B model), so the dispatch threshold is 0.35 and the
    switch threshold 0.2 to show the whole method within the time budget.
    """
    return Config(
        model=ModelConfig(in_channels=3, patch=(1, 4, 4), hidden=96, depth=4, heads=4),
        attention=AttentionConfig(
            mode="dsv", cube=(2, 2, 2), predictor_lr=3e-3, sample_stride=4,
            profile_every_stage1=10, profile_every_stage2=20,
            switch_loss_threshold=0.2, min_stage1_steps=60, max_stage1_steps=150,
            sparse_threshold=0.35, keep_floor_blocks=4,
        ),
        data=DataConfig(frames=8, size=32, load_short_side=48),
        optim=OptimConfig(lr=1e-3, warmup_steps=20),
        train=TrainConfig(steps=240, batch_size=4, out_dir="runs/debug_cpu", log_every=20, eval_every=80,
                          ckpt_every=120, threads=2),
    )


@recipe
def wan_debug_cpu() -> Config:
    """debug_cpu's schedule on a small randomly initialised diffusers Wan transformer (4 layers, 4 heads × 24,
    1×4×4 patches) with DSV installed on its self-attention; needs `pip install -e '.[integrations]'`."""
    cfg = debug_cpu()
    cfg.model = ModelConfig(arch="wan", in_channels=3, patch=(1, 4, 4), hidden=96, depth=4, heads=4)
    cfg.train.out_dir = "runs/wan_debug_cpu"
    return cfg


@recipe
def small_gpu() -> Config:
    """A 12-block DiT at 16×64×64 pixels (patch 1×4×4 → 4096 tokens) for quick runs on one GPU. 4×4×4 query
    cubes: the kernels' 64-token blocks cost 1.30× dense per kept key on an H200, 32-token ones 3.95× (which
    the dispatch would keep dense below ~90% sparsity at this size; benchmarks/NOTES.md)."""
    return Config(
        model=ModelConfig(in_channels=3, patch=(1, 4, 4), hidden=384, depth=12, heads=6,
                          activation_checkpointing=False),
        attention=AttentionConfig(mode="dsv", cube=(4, 4, 4), profile_every_stage1=25, profile_every_stage2=100,
                                  switch_loss_threshold=0.05, min_stage1_steps=500, max_stage1_steps=3000),
        data=DataConfig(frames=16, size=64, load_short_side=96),
        optim=OptimConfig(lr=2e-4, warmup_steps=200),
        train=TrainConfig(steps=6000, batch_size=8, out_dir="runs/small_gpu", log_every=50, eval_every=500,
                          ckpt_every=1000),
    )


@recipe
def quality_gpu() -> Config:
    """The DiT of `dsv bench quality` (dense, DSV and window trained from scratch and compared): 12 blocks,
    hidden 384 (6 heads × 64, 23M parameters), 16 frames of 64×64 pixels with 1×4×4 patches → a 16×16×16
    grid of 4096 tokens (the paper's latent grid), 4×4×4 query cubes (64 tokens: the Triton kernels'
    64-token blocks), batch 8, bf16.

    On one H200, the three 1000-step trainings sharing the GPU took 340 s together
    (benchmarks/results/2026-11-29-h200-quality). DSV learns its predictors densely for 100–400 steps (at most
    a third of the run) and trains sparse from then on where a block's sparsity reaches 0.5 and the
    kernel-speed model says sparse pays. Profiling every 10 steps in stage 1 and every 25 in stage 2 lets the
    sparsity EMA (momentum 0.9) follow the rising sparsity of so short a run. 64 held-out clips give the
    held-out loss and the FVD's real set. The recall floor (`recall_target=0.95`) widens budgets until the
    selection keeps 95% of the critical mass. In the 1000-step runs of benchmarks/results/ (held-out loss over
    the second half against dense), a floor of 0.9 gave +2.2% with 22% of the keys kept in the sparse blocks
    and 83.4% of θ recalled on held-out clips (2026-11-29-h200-quality), this recipe's 0.95 gave +1.6% with
    25% kept and 90.3% of θ (2026-11-29-h200-quality-floor095; FVD +2.9% and +0.1%). Over eight training
    seeds at 0.95 (2026-11-29-h200-quality-two-seeds and -dense-control, 2026-11-30-h200-quality-seeds-40-50
    and -seeds-60-70) DSV's gap averaged +1.04% (per seed −1.86…+2.42%), while four comparisons of two
    dense-attention trainings from the same command differed by −1.87…+0.37% (2026-11-29-h200-quality-theta095
    and -dense-control): at this size the targets sit inside the run-to-run noise. Much of that noise is the
    weights' own: at the constant learning rate a run's held-out loss moves by 4.6% (median; up to 19%) from
    one evaluation to the next in steps 600–1000 (six 8192-token seeds, 2026-12-01), so the runs also
    evaluate a moving average of their weights (`train.ema_decay=0.99`, warmed up: about the last 80–100 steps
    at the late evaluations), which the bench reports beside the weights' loss.
    """
    return Config(
        model=ModelConfig(in_channels=3, patch=(1, 4, 4), hidden=384, depth=12, heads=6),
        attention=AttentionConfig(mode="dsv", cube=(4, 4, 4), predictor_lr=3e-3,
                                  profile_every_stage1=10, profile_every_stage2=25,
                                  switch_loss_threshold=0.05, min_stage1_steps=100, max_stage1_steps=400,
                                  sparse_threshold=0.5, recall_target=0.95),
        data=DataConfig(frames=16, size=64, load_short_side=96, heldout_clips=64),
        optim=OptimConfig(lr=5e-4, warmup_steps=100),
        train=TrainConfig(steps=1200, batch_size=8, out_dir="runs/quality_gpu", log_every=25, eval_every=100,
                          ckpt_every=1200, keep_checkpoints=1, tensorboard=False, ema_decay=0.99),
    )


def _paper_shape(depth: int, heads: int, head_dim: int) -> Config:
    # The DSV paper's transformer shapes. Without a bundled video VAE they train on pixels with 1×8×8
    # patches: 16 frames at 256×256 → a 16×32×32 grid of 16,384 tokens.
    # Dispatch from sparsity 0.5 (as `quality_gpu`): the kernel-speed model still keeps a block dense where
    # sparse would not pay, and the paper's block 4 (sparsity ~0.75) runs 3× faster sparse than dense.
    # 4096 sampled keys per predictor update: at 32k tokens it took the update from 186 to 51 ms per step on
    # one H200 (benchmarks/results/2026-11-29-h200-train-step.md); the quality run with 512 of 4096 keys
    # kept the predictors' recall (2026-11-29-h200-quality-predictor-keys).
    # DSV's per-layer state in host memory between uses: at 32k and 64k tokens on one H200 the 2.7B shape's
    # peak requested bytes equal dense's (+0.43 GiB without), the step time within noise (the train-step
    # reports of 2026-11-29 and -30).
    return Config(
        model=ModelConfig(in_channels=3, patch=(1, 8, 8), hidden=heads * head_dim, depth=depth, heads=heads,
                          activation_checkpointing=True),
        attention=AttentionConfig(mode="dsv", cube=(4, 4, 4), sparse_threshold=0.5, predictor_keys=4096,
                                  host_offload=True),
        data=DataConfig(frames=16, size=256, load_short_side=288),
        optim=OptimConfig(lr=1e-4, warmup_steps=1000),
        train=TrainConfig(steps=300_000, batch_size=1, out_dir="runs/paper", log_every=50, eval_every=2000,
                          ckpt_every=2000),
    )


@recipe
def dit_0p8b() -> Config:
    """The paper's 0.8B shape: 28 blocks, 12 heads × 96."""
    return _paper_shape(depth=28, heads=12, head_dim=96)


@recipe
def dit_2p7b() -> Config:
    """The paper's 2.7B shape: 32 blocks, 16 heads × 128, hidden 2048."""
    return _paper_shape(depth=32, heads=16, head_dim=128)


@recipe
def wan_1p3b() -> Config:
    """Wan 2.1 1.3B's transformer shape as a diffusers `WanTransformer3DModel` with DSV installed: 30 blocks, 12
    heads × 128, hidden 1536, FFN 8960, trained from scratch with the paper shapes' schedule. Like them it trains on
    pixels with 1×8×8 patches (no video VAE is bundled); `dsv bench train --recipe wan_1p3b --grids 21x30x52` times
    its step at the token grid of Wan's 480×832, 81-frame videos. Needs `pip install -e '.[integrations]'`."""
    cfg = _paper_shape(depth=30, heads=12, head_dim=128)
    cfg.model = dataclasses.replace(cfg.model, arch="wan", mlp_ratio=8960 / 1536)
    cfg.train.out_dir = "runs/wan_1p3b"
    return cfg
