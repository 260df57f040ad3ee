"""Token reordering that makes every 3-D query cube contiguous.

A video latent of grid ``(T, H, W)`` is flattened in raster order, t-major: token ``(t, h, w)`` sits at
``(t * H + h) * W + w``. Sparse attention shares one key selection per query cube, so the cube's tokens
must be neighbours in the sequence. The *grouped order* lists the cubes in raster order of their cube
coordinates and, inside a cube, its tokens in raster order.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

_DIM_NAMES = ("T", "H", "W")


def outside_inference_mode():
    """Context for filling a cache of tensors that outlives the call: tensors made under
    ``torch.inference_mode`` can never be saved for a backward pass, so a cache filled while sampling or
    evaluating would break the training that follows."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def _as_shape(value, name: str) -> tuple[int, int, int]:
    """Return ``value`` as a tuple of three positive ints, or raise ValueError naming ``name``."""
    try:
        shape = tuple(int(size) for size in value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of three ints (T, H, W), got {value!r}") from None
    if len(shape) != 3:
        raise ValueError(f"{name} must have three sizes (T, H, W), got {len(shape)}: {value!r}")
    for dim_name, size in zip(_DIM_NAMES, shape):
        if size <= 0:
            raise ValueError(f"{name} {dim_name}={size} must be positive")
    return shape


def _check_divisible(grid: tuple[int, int, int], cube: tuple[int, int, int]) -> None:
    for dim_name, size, extent in zip(_DIM_NAMES, grid, cube):
        if size % extent:
            padded = math.ceil(size / extent) * extent
            raise ValueError(
                f"grid {dim_name}={size} is not divisible by cube {dim_name.lower()}={extent}; "
                f"pad {dim_name} to {padded} or choose a cube extent dividing {size}"
            )


def _build_permutation(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    (t, h, w), (ct, ch, cw) = grid, cube
    raster_ids = torch.arange(t * h * w, device=device).view(t // ct, ct, h // ch, ch, w // cw, cw)
    # Cube coordinates (axes 0, 2, 4) outermost, in-cube offsets (axes 1, 3, 5) innermost.
    perm = raster_ids.permute(0, 2, 4, 1, 3, 5).reshape(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=device)
    return perm, inv


@functools.lru_cache(maxsize=64)
def _cached_permutation(
    grid: tuple[int, int, int], cube: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    with outside_inference_mode():
        return _build_permutation(grid, cube, "cpu")


def cube_permutation(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation from raster order to grouped (cube-contiguous) order.

    Args:
        grid: ``(T, H, W)`` latent grid; ``S = T * H * W``.
        cube: ``(t, h, w)`` query-cube extents; each must divide the matching grid size.
        device: None for CPU tensors copied from a cached result; a device to build them there, uncached
            (what a compiled graph does: the permutation becomes a few index kernels of the graph).

    Returns:
        ``(perm, inv)``, both int64 ``[S]``: ``perm[i]`` is the raster index of the i-th token in grouped
        order. ``x_grouped = x.index_select(dim, perm)`` and ``x = x_grouped.index_select(dim, inv)``. The
        tensors are fresh (copies of the cached result for ``device=None``), so the caller may move or
        modify them.

    Raises:
        ValueError: a size is not positive, or a grid size is not divisible by the cube extent (the
            message names the dimension and the padded size that would divide).
    """
    grid = _as_shape(grid, "grid")
    cube = _as_shape(cube, "cube")
    _check_divisible(grid, cube)
    if device is not None:
        return _build_permutation(grid, cube, device)
    perm, inv = _cached_permutation(grid, cube)
    return perm.clone(), inv.clone()


def cube_permutation_on(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cube_permutation(grid, cube)`` as tensors on ``device``, shared by every caller: cached, so a layer
    or model forward costs no host-to-device copy (which would stall the GPU stream); callers must not
    modify them. Inside a ``torch.compile`` trace they are built in the graph instead: a cache filled by the
    first compiled call would change what the graph guards on, and recompile it."""
    if torch.compiler.is_compiling():
        return cube_permutation(grid, cube, device)
    return _cached_permutation_on(_as_shape(grid, "grid"), _as_shape(cube, "cube"), torch.device(device))


@functools.lru_cache(maxsize=16)
def _cached_permutation_on(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    with outside_inference_mode():
        perm, inv = cube_permutation(grid, cube)
        return perm.to(device), inv.to(device)


def check_sequence_matches_grid(seq_len: int, grid: tuple[int, int, int]) -> None:
    """Raise ValueError unless ``seq_len == T * H * W`` for ``grid = (T, H, W)``."""
    grid = _as_shape(grid, "grid")
    expected = math.prod(grid)
    if seq_len != expected:
        raise ValueError(
            f"sequence length seq_len={seq_len} does not match grid (T, H, W)={grid}, "
            f"which holds T*H*W={expected} tokens"
        )
