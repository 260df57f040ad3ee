"""Token reordering that makes every 3-D query cube contiguous.

A video latent of grid ``(T, H, W)`` is flattened in raster order, t-major: token ``(t, h, w)`` sits at
``(t * H + h) * W + w``. Sparse attention shares one key selection per query cube, so the cube's tokens
must be neighbours in the sequence. The *grouped order* lists the cubes in raster order of their cube
coordinates and, inside a cube, its tokens in raster order.

A grid the cube does not tile (e.g. Wan's 21 x 30 x 52 latent with 2 x 4 x 4 cubes) keeps that order for
the whole cubes, which come first, and puts the tokens of the partial cubes at its edges after them, partial
cube after partial cube in a serpentine walk of the cube lattice: a group of ``cube volume`` consecutive
tokens there spans a few neighbouring partial cubes, and the last group may be shorter (a ragged tail,
which the kernels take). No padding token is made.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator

import torch

_DIM_NAMES = ("T", "H", "W")


def outside_inference_mode():
    """Context for filling a cache of tensors that outlives the call: tensors made under
    ``torch.inference_mode`` can never be saved for a backward pass, so a cache filled while sampling or
    evaluating would break the training that follows."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def _as_shape(value, name: str) -> tuple[int, int, int]:
    """Return ``value`` as a tuple of three positive ints, or raise ValueError naming ``name``. Sizes must be
    integers (Python, NumPy or 0-d integer tensors): a float or a string is refused, not truncated."""
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of three ints (T, H, W), got {value!r}")
    try:
        if any(isinstance(size, bool) for size in value):
            raise TypeError
        shape = tuple(operator.index(size) for size in value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of three ints (T, H, W), got {value!r}") from None
    if len(shape) != 3:
        raise ValueError(f"{name} must have three sizes (T, H, W), got {len(shape)}: {value!r}")
    for dim_name, size in zip(_DIM_NAMES, shape):
        if size <= 0:
            raise ValueError(f"{name} {dim_name}={size} must be positive")
    return shape


def check_cube_tiles(grid: tuple[int, int, int], cube: tuple[int, int, int], needed_by: str) -> None:
    """Raise ValueError unless every grid size is a multiple of the cube extent: for what needs every group
    to be a whole cube (``needed_by`` names it), e.g. 3-D windows or per-cube statistics."""
    grid, cube = _as_shape(grid, "grid"), _as_shape(cube, "cube")
    for dim_name, size, extent in zip(_DIM_NAMES, grid, cube):
        if size % extent:
            padded = math.ceil(size / extent) * extent
            raise ValueError(
                f"{needed_by} needs whole cubes: grid {dim_name}={size} is not divisible by cube "
                f"{dim_name.lower()}={extent}; pad {dim_name} to {padded} or choose a cube extent dividing {size}"
            )


def _build_permutation(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    (t, h, w), (ct, ch, cw) = grid, cube
    if t % ct == 0 and h % ch == 0 and w % cw == 0:
        raster_ids = torch.arange(t * h * w, device=device).view(t // ct, ct, h // ch, ch, w // cw, cw)
        # Cube coordinates (axes 0, 2, 4) outermost, in-cube offsets (axes 1, 3, 5) innermost.
        perm = raster_ids.permute(0, 2, 4, 1, 3, 5).reshape(-1)
    else:
        # Sort key: whole cubes first, in the raster order of their cube coordinates (the order above), then
        # partial cubes in serpentine order (each row of cubes, and each layer of rows, walked back and forth),
        # so that consecutive partial cubes are neighbours even across the end of a row; then the token's
        # offset inside its cube. Unique per token.
        tt, hh, ww = torch.meshgrid(*(torch.arange(n, device=device) for n in (t, h, w)), indexing="ij")
        cubes_h, cubes_w, volume = -(-h // ch), -(-w // cw), ct * ch * cw
        cube_t, cube_h, cube_w = tt // ct, hh // ch, ww // cw
        cube_id = (cube_t * cubes_h + cube_h) * cubes_w + cube_w
        snake_h = torch.where(cube_t % 2 == 1, cubes_h - 1 - cube_h, cube_h)
        snake_w = torch.where((cube_t * cubes_h + snake_h) % 2 == 1, cubes_w - 1 - cube_w, cube_w)
        snake_id = (cube_t * cubes_h + snake_h) * cubes_w + snake_w
        offset = ((tt % ct) * ch + hh % ch) * cw + ww % cw
        partial = (tt >= t - t % ct) | (hh >= h - h % ch) | (ww >= w - w % cw)
        total = cube_id.max() + 1
        key = torch.where(partial, total + snake_id, cube_id) * volume + offset
        perm = torch.argsort(key.reshape(-1))
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
        cube: ``(t, h, w)`` query-cube extents. Where they do not divide the grid, the whole cubes come first
            and the partial cubes at the grid's edges after them (module docstring).
        device: None for CPU tensors copied from a cached result; a device to build them there, uncached
            (what a compiled graph does: the permutation becomes a few index kernels of the graph).

    Returns:
        ``(perm, inv)``, both int64 ``[S]``: ``perm[i]`` is the raster index of the i-th token in grouped
        order. ``x_grouped = x.index_select(dim, perm)`` and ``x = x_grouped.index_select(dim, inv)``. The
        tensors are fresh (copies of the cached result for ``device=None``), so the caller may move or
        modify them.

    Raises:
        ValueError: a size is not positive. (A cube extent larger than the grid leaves no whole cube along
            that axis: e.g. single frames, T = 1, of joint image and video training; all groups are then
            runs of partial cubes.)
    """
    grid = _as_shape(grid, "grid")
    cube = _as_shape(cube, "cube")
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


def grouped_positions_on(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device
) -> torch.Tensor:
    """The ``(t, h, w)`` coordinates of the tokens in grouped order, float32 ``[S, 3]`` on ``device``: row ``i``
    is the position of ``x_grouped[:, i]``. Cached and shared like ``cube_permutation_on``; callers must not
    modify it."""
    if torch.compiler.is_compiling():
        return _grouped_positions(grid, cube, device)
    return _cached_positions_on(_as_shape(grid, "grid"), _as_shape(cube, "cube"), torch.device(device))


def _grouped_positions(grid, cube, device) -> torch.Tensor:
    perm, _ = cube_permutation_on(grid, cube, device)
    _, h, w = grid
    return torch.stack((perm // (h * w), perm // w % h, perm % w), dim=1).to(torch.float32)


@functools.lru_cache(maxsize=16)
def _cached_positions_on(
    grid: tuple[int, int, int], cube: tuple[int, int, int], device: torch.device
) -> torch.Tensor:
    with outside_inference_mode():
        return _grouped_positions(grid, cube, device)


def check_sequence_matches_grid(seq_len: int, grid: tuple[int, int, int]) -> None:
    """Raise ValueError unless ``seq_len == T * H * W`` for ``grid = (T, H, W)``."""
    grid = _as_shape(grid, "grid")
    expected = math.prod(grid)
    if seq_len != expected:
        raise ValueError(
            f"sequence length seq_len={seq_len} does not match grid (T, H, W)={grid}, "
            f"which holds T*H*W={expected} tokens"
        )
