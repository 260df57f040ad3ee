"""Load a trained model (and its config) from a checkpoint for sampling and analysis."""

from __future__ import annotations

import dataclasses

import torch

from dsv.modules.config import FIXED_MODES
from dsv.modules.dit import VideoDiT
from dsv.train.checkpoint import checkpoint_config, load_checkpoint, load_weights_into, resolve_checkpoint
from dsv.train.config import Config
from dsv.train.trainer import build_model, resolve_device


def load_model(path: str, device: str = "auto", attention_mode: str | None = None,
               average_weights: bool = False) -> tuple[VideoDiT, Config, int]:
    """Return `(model in eval mode, config, step)`. `attention_mode` swaps the attention mode (e.g. run a
    DSV-trained model densely); the predictors' weights are then left out when the new mode has none.
    `average_weights` puts the moving average of the trained weights (`train.ema_decay`) in their place (a
    DSV model keeps its own predictors and dispatch); a ValueError where the run kept none. The
    blocks run eager whatever `model.compile` the run trained with (the returned config says so): profiling
    and observations read attention through Python hooks, which a compiled block cannot run, and a few
    sampling steps do not repay a compile.

    A sparse `attention_mode` (anything but dense) is refused with a ValueError when no block of the loaded
    model would run sparse (a checkpoint still in stage 1, a dense-trained one, or one whose blocks were all
    dispatched dense), and `dsv` is refused for a checkpoint without trained predictors: the model would
    otherwise run densely under a sparse mode's name."""
    ckpt = resolve_checkpoint(path)
    weights, state, manifest = load_checkpoint(ckpt)
    cfg = checkpoint_config(manifest, ckpt)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=""))
    if average_weights:
        if not state.get("ema"):
            raise ValueError(f"average_weights: checkpoint {ckpt} keeps no moving average of its weights (trained "
                             f"with train.ema_decay={cfg.train.ema_decay}); load its trained weights instead")
        weights = {**weights, **state["ema"]}
    trained_mode = cfg.attention.mode
    if attention_mode == "dsv" and trained_mode != "dsv":
        others = "oracle, window or dense" if trained_mode == "oracle" else "window or dense"
        raise ValueError(f"--attention-mode dsv: checkpoint {ckpt} was trained with attention.mode={trained_mode} "
                         f"and has no trained predictors to select keys with; sample it with --attention-mode {others}")
    if attention_mode is not None and attention_mode != trained_mode:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, mode=attention_mode))
        reference = build_model(cfg, torch.device("cpu")).state_dict()
        weights = {k: v for k, v in weights.items() if k in reference}
    model = build_model(cfg, resolve_device(device, field="device"))
    load_weights_into(model, weights, str(ckpt))
    model.controller.step = state["step"]
    if attention_mode is not None and attention_mode != "dense" and not model.controller.sparse_layers():
        stage = model.controller.current_stage
        if stage == 1 and trained_mode in FIXED_MODES:
            why = (f"was trained with attention.mode={trained_mode}, which has no stage switch: its blocks stay in "
                   "stage 1, dense under a selecting mode")
            fix = "sample it with --attention-mode window or dense"
        elif stage == 1:
            why = (f"is still in stage 1 (step {state['step']}, trained with attention.mode={trained_mode}; "
                   "stage 1 runs every block dense)")
            fix = ("train it on past the stage switch (--resume with a larger train.steps), or sample it with "
                   "--attention-mode window or dense")
        else:
            why = (f"is in stage 2 (step {state['step']}) but dispatched every block dense (mean sparsity below "
                   f"attention.sparse_threshold={cfg.attention.sparse_threshold}, or slower sparse kernels)")
            fix = "sample it with --attention-mode window or dense"
        raise ValueError(f"--attention-mode {attention_mode}: checkpoint {ckpt} {why}, so no block would run sparse "
                         f"and the samples would be dense; {fix}")
    return model.eval(), cfg, state["step"]


def run_precision(cfg: Config, device: torch.device) -> torch.autocast:
    """The autocast the run trained under (`train.bf16` on a GPU), so that sampling and analysis take the same
    attention paths as training: the fast kernels take bf16, and float32 attention would fall back to the
    PyTorch reference and measure a slightly different attention."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and cfg.train.bf16)
