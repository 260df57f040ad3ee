"""DSV: learned dynamic sparse attention for training video diffusion transformers."""

from dsv.modules.attention import (
    DSVAttention,
    DSVAttentionCore,
    ddp_ignore_predictors,
    model_parameters,
    predictor_parameters,
)
from dsv.modules.config import AttentionConfig
from dsv.modules.controller import DSVController
from dsv.modules.dit import ModelConfig, VideoDiT

__all__ = [
    "AttentionConfig",
    "DSVAttention",
    "DSVAttentionCore",
    "DSVController",
    "ModelConfig",
    "VideoDiT",
    "ddp_ignore_predictors",
    "model_parameters",
    "predictor_parameters",
]
