"""Kernel launches on the device of their inputs.

Triton launches a kernel on the *current* CUDA device and its stream, whatever device the arguments live on
(triton-lang/triton#2441): a model on ``cuda:1`` in a process whose current device is still ``cuda:0`` would
hand GPU 1's pointers to a kernel on GPU 0 (an invalid-pointer error or an illegal memory access). PyTorch's own
ops follow their tensors, so a user who moves a model to ``cuda:1`` expects ours to as well.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

Launcher = TypeVar("Launcher", bound=Callable)


def launches_on_input_device(launcher: Launcher) -> Launcher:
    """Run ``launcher`` with its first argument's CUDA device current (the other tensors are on the same
    device: the launchers check that, or take them from the same computation)."""

    @functools.wraps(launcher)
    def on_input_device(first: torch.Tensor, *args, **kwargs):
        if not (isinstance(first, torch.Tensor) and first.is_cuda):  # the launcher's own checks name bad input
            return launcher(first, *args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(first, *args, **kwargs)

    return on_input_device  # type: ignore[return-value]
