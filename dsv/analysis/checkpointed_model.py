"""Load a trained model (and its config) from a checkpoint for sampling and analysis."""

from __future__ import annotations

import dataclasses

import torch

from dsv.modules.dit import VideoDiT
from dsv.train.checkpoint import load_checkpoint, load_weights_into, resolve_checkpoint
from dsv.train.config import Config, config_from_dict
from dsv.train.trainer import build_model, resolve_device


def load_model(path: str, device: str = "auto", attention_mode: str | None = None) -> tuple[VideoDiT, Config, int]:
    """Return `(model in eval mode, config, step)`. `attention_mode` swaps the attention mode (e.g. run a
    DSV-trained model densely); the predictors' weights are then left out when the new mode has none."""
    ckpt = resolve_checkpoint(path)
    weights, state, manifest = load_checkpoint(ckpt)
    cfg = config_from_dict(manifest["config"])
    if attention_mode is not None and attention_mode != cfg.attention.mode:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, mode=attention_mode))
        reference = build_model(cfg, torch.device("cpu")).state_dict()
        weights = {k: v for k, v in weights.items() if k in reference}
    model = build_model(cfg, resolve_device(device))
    load_weights_into(model, weights, str(ckpt))
    model.controller.step = state["step"]
    return model.eval(), cfg, state["step"]
