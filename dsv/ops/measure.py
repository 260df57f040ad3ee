"""Exact attention statistics for profiling and for judging an index.

Critical-KV counts, per-head sparsity and index recall use dense softmax rows, but only for sampled query
rows (``R x S``, chunked over rows); the oracle index is chunked over query groups. Nothing here builds
the ``S x S`` matrix of the whole sequence. Also holds the 3-D window baseline index and the rule that
turns measured sparsity into per-head keep counts.
"""

from __future__ import annotations

import math
import numbers

import torch

from dsv.ops.grouping import check_cube_tiles, cube_permutation
from dsv.ops.index import (
    SparseIndex,
    check_bhsd,
    check_keep_blocks,
    check_positive_int,
    compute_dtype,
    resolve_chunk_size,
    resolve_scale,
    select_top_blocks,
    values_readable,
)

WHOLE_BLOCK_TOLERANCE = 1e-4
"""A keep count within this many blocks (plus one float32 eps per key block) above an integer is not rounded
up: float32 sparsity such as 0.9 (stored as 0.8999999762) would otherwise keep one block more than ``ceil``
of the exact value. The eps term grows with the blocks, as that rounding error does (it reached a whole
block at ~16k key blocks)."""


def _check_rows(rows: torch.Tensor, seq_len: int, device: torch.device) -> torch.Tensor:
    """Return ``rows`` as int64 ``[R]`` on ``device``, or raise ValueError naming ``rows``."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.numel() == 0:
        raise ValueError("rows must be a non-empty 1-D integer tensor [R] of query row ids")
    if rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ValueError(f"rows must be an integer tensor, got dtype {rows.dtype}")
    if bool(((rows < 0) | (rows >= seq_len)).any()):
        raise ValueError(f"rows must lie in [0, S={seq_len})")
    return rows.to(device=device, dtype=torch.int64)


def check_theta(theta) -> None:
    """Raise ValueError unless `theta` is a critical mass in (0, 1). At 1 (all the mass) the count would be that of
    the keys of non-zero weight, decided by where a rounded running sum reaches 1 (float32 and float64 inputs
    disagreed thirtyfold on peaked rows), not by the attention."""
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not 0.0 < theta < 1.0:
        raise ValueError(f"theta must lie in (0, 1), got {theta!r}")


def check_unit_fraction(value, name: str) -> None:
    """Raise ValueError naming `name` unless `value` is a real number in (0, 1] (not a bool, a string or a
    tensor, which would fail the comparison with a TypeError or an ambiguous truth value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")


def _softmax_rows(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense softmax ``[B, H, R, S]`` of query ``rows`` over all keys, in the compute dtype.

    Autocast off: under it the matmul would run in bf16 whatever the compute dtype (and on the CPU the softmax
    and the statistics after it too), biasing the measured sparsity and recall."""
    dtype = compute_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        scores = (q[:, :, rows].to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
        return torch.softmax(scores, dim=-1)


def _row_chunk(q: torch.Tensor, num_rows: int) -> int:
    """Sampled rows per chunk of a dense-softmax loop."""
    batch, heads, seq_len, _ = q.shape
    # Per sampled row: scores, probabilities, sorted values and a cumulative sum (float64 bound), plus
    # the sort's int64 ids.
    return resolve_chunk_size(None, num_rows, batch * heads * seq_len * (4 * 8 + 8), "rows")


def sample_query_rows(seq_len: int, stride: int, offset: int = 0,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Every ``stride``-th query row starting at ``offset % stride``: int64 ``[R]``, R >= 1, on ``device``.

    Made on the device directly: a copy from host memory would wait for the device's whole stream, once
    per layer and step in training."""
    check_positive_int(seq_len, "seq_len")
    check_positive_int(stride, "stride")
    first = offset % stride
    if first >= seq_len:
        raise ValueError(
            f"offset={offset} (first row {first}) leaves no row of seq_len={seq_len} at stride={stride}"
        )
    return torch.arange(first, seq_len, stride, device=device)


def jittered_query_rows(seq_len: int, stride: int, generator: torch.Generator,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """One query row drawn uniformly from each window ``[j * stride, (j + 1) * stride)`` (the last one clipped
    to ``seq_len``): int64 ``[ceil(S / stride)]``, ascending, on ``device``.

    As many rows as ``sample_query_rows`` at that stride, but every position inside a query cube is equally
    likely: rows come in grouped (cube) order, so a fixed stride sees only some in-cube offsets (only w offset 0
    of a 2x4x4 cube at stride 4) and never the cube's edge rows, which its shared selection serves worst.
    Drawn on the CPU from ``generator`` (reproducible whatever the device)."""
    check_positive_int(seq_len, "seq_len")
    check_positive_int(stride, "stride")
    starts = torch.arange(0, seq_len, stride)
    widths = (seq_len - starts).clamp(max=stride)
    jitter = (torch.rand(starts.numel(), generator=generator, dtype=torch.float64) * widths).long()
    return (starts + jitter.minimum(widths - 1)).to(device)


def sample_key_positions(seq_len: int, count: int, seed: int,
                         device: torch.device | str | None = None) -> torch.Tensor | None:
    """``count`` distinct key positions out of ``seq_len``, uniformly at random, int64 ``[count]`` on
    ``device``; None (every key) when ``count`` is 0 or at least ``seq_len``.

    The draw depends on ``seed`` alone (its own generator, made on the device: no host copy), so every rank
    and a resumed run draw the same keys. Uniform, not strided: a stride aliases with the token grid."""
    check_positive_int(seq_len, "seq_len")
    if count < 0:
        raise ValueError(f"count must be >= 0 (0 = every key), got {count}")
    if count == 0 or count >= seq_len:
        return None
    device = torch.empty(0, device=device).device  # None: the default device, for generator and output alike
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.randperm(seq_len, generator=generator, device=device)[:count]


def critical_counts(
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    theta: float = 0.9,
    scale: float | None = None,
) -> torch.Tensor:
    """Fewest keys whose softmax weights sum to at least ``theta``, per sampled query row.

    Args:
        q, k: ``[B, H, S, D]`` floating, same shape, dtype and device.
        rows: integer ``[R]`` query row ids in ``[0, S)``.
        theta: attention mass to cover, in ``(0, 1)``.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        int64 ``[B, H, R]`` counts in ``[1, S]``.
    """
    _, _, seq_len, _ = check_bhsd({"q": q, "k": k})
    return _critical_counts(q, k, _check_rows(rows, seq_len, q.device), theta, scale)


def _critical_counts(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, theta: float,
                     scale: float | None) -> torch.Tensor:
    """`critical_counts` on q, k and int64 rows already checked (each row check reads the device)."""
    check_theta(theta)
    seq_len, dim = q.shape[2], q.shape[3]
    scale = resolve_scale(scale, dim)
    chunk = _row_chunk(q, rows.numel())
    k = k.to(compute_dtype(k.dtype))  # once, not per chunk (a full copy of the keys at bf16 input)
    counts = []
    for start in range(0, rows.numel(), chunk):
        probs = _softmax_rows(q, k, rows[start : start + chunk], scale)
        covered = torch.sort(probs, dim=-1, descending=True).values.cumsum(-1)
        # Weights are non-negative, so the cumulative sum is monotone: the count is one more than the
        # number of prefixes still short of theta. Rounding can leave a theta near 1 unreached: cap at S.
        counts.append(((covered < theta).sum(-1) + 1).clamp(max=seq_len))
    return torch.cat(counts, dim=-1)


def head_sparsity(
    q: torch.Tensor,
    k: torch.Tensor,
    rows: torch.Tensor,
    theta: float = 0.9,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-head sparsity: mean over batch and sampled rows of ``1 - critical_count / S``.

    Args: as ``critical_counts``. Returns float32 ``[H]``; NaN for a head whose sampled query rows or keys
    hold a NaN or Inf (a count over non-finite weights would read as the sparsest head there is).
    """
    _, _, seq_len, _ = check_bhsd({"q": q, "k": k})
    rows = _check_rows(rows, seq_len, q.device)
    counts = _critical_counts(q, k, rows, theta, scale)
    sparsity = (1.0 - counts.double() / seq_len).mean(dim=(0, 2)).float()
    finite = torch.isfinite(q[:, :, rows]).all(dim=(0, 2, 3)) & torch.isfinite(k).all(dim=(0, 2, 3))
    return torch.where(finite, sparsity, float("nan"))


def index_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    index: SparseIndex,
    rows: torch.Tensor,
    scale: float | None = None,
    check_index: bool = True,
) -> torch.Tensor:
    """Dense attention mass that an index keeps, averaged over sampled query rows.

    For row ``i`` of group ``g = i // G`` the mass is the sum of its full softmax over the tokens of the
    key blocks in ``index.indices[b, h, g, :counts]``.

    Args:
        q, k: ``[B, H, S, D]`` floating, same shape, dtype and device.
        index: ``SparseIndex`` for these inputs.
        rows: integer ``[R]`` query row ids in ``[0, S)``.
        scale: softmax scale, default ``D ** -0.5``.
        check_index: validate the index once (`SparseIndex.validate_once`, host reads), as `sparse_attention`
            does: a duplicate id would count once here but twice in `kept_fraction`, an id of NKB not at all.
            DSV's own layers pass False for the indices they make (their profiling steps).

    Returns:
        float32 ``[B, H]`` in ``[0, 1]``.
    """
    batch, heads, seq_len, dim = check_bhsd({"q": q, "k": k})
    if not isinstance(index, SparseIndex):
        raise ValueError(f"index must be a SparseIndex, got {type(index).__name__}")
    index.check_matches(batch, heads, seq_len, q.device, "index")
    if check_index and values_readable(q):
        index.validate_once()
    rows = _check_rows(rows, seq_len, q.device)
    scale = resolve_scale(scale, dim)
    num_kv_blocks = index.num_kv_blocks
    token_block = torch.arange(seq_len, device=q.device) // index.kv_block
    # PAD entries map to an extra column that is dropped, so only real ids mark blocks as selected.
    block_columns = torch.where(index.valid_mask(), index.indices.long(), num_kv_blocks)
    chunk = _row_chunk(q, rows.numel())
    k = k.to(compute_dtype(k.dtype))  # once, not per chunk
    captured = torch.zeros(batch, heads, dtype=compute_dtype(q.dtype), device=q.device)
    for start in range(0, rows.numel(), chunk):
        chunk_rows = rows[start : start + chunk]
        probs = _softmax_rows(q, k, chunk_rows, scale)
        selected = torch.zeros(
            batch, heads, chunk_rows.numel(), num_kv_blocks + 1, dtype=torch.bool, device=q.device
        )
        selected.scatter_(-1, block_columns[:, :, chunk_rows // index.group_size], True)
        captured += torch.where(selected[..., token_block], probs, 0.0).sum(dim=(-1, -2))
    return (captured / rows.numel()).float()


def oracle_index(
    q: torch.Tensor,
    k: torch.Tensor,
    keep_blocks: torch.Tensor,
    group_size: int,
    kv_block: int,
    scale: float | None = None,
    chunk_groups: int | None = None,
) -> SparseIndex:
    """The exact per-group index: blocks holding the most softmax mass of the group's queries.

    Block score = sum over the group's (valid) queries of their softmax probability on the block's
    tokens; each head keeps its ``keep_blocks[h]`` best blocks, ties to the lower block id.

    Args:
        q, k: ``[B, H, S, D]`` floating, same shape, dtype and device.
        keep_blocks: integer ``[H]`` blocks kept per head, >= 1 (clipped to ``NKB``).
        group_size, kv_block: index geometry.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_groups: query groups per chunk (memory ``O(chunk * G * S)``); ``None`` sizes chunks to
            ``DEFAULT_CHUNK_BYTES``.

    Returns:
        ``SparseIndex`` with ``indices [B, H, NG, max(keep)]``.
    """
    batch, heads, seq_len, dim = check_bhsd({"q": q, "k": k})
    check_positive_int(group_size, "group_size")
    check_positive_int(kv_block, "kv_block")
    num_groups = math.ceil(seq_len / group_size)
    num_kv_blocks = math.ceil(seq_len / kv_block)
    keep = check_keep_blocks(keep_blocks, heads, num_kv_blocks, q.device)
    scale = resolve_scale(scale, dim)
    # Per group: G rows of scores and probabilities (float64 bound) plus the per-block sort temporaries.
    bytes_per_group = batch * heads * (2 * group_size * seq_len * 8 + num_kv_blocks * 24)
    chunk = resolve_chunk_size(chunk_groups, num_groups, bytes_per_group, "chunk_groups")
    padded_keys = num_kv_blocks * kv_block
    k = k.to(compute_dtype(k.dtype))  # once, not per chunk
    indices = []
    for start in range(0, num_groups, chunk):
        stop = min(start + chunk, num_groups)
        rows = torch.arange(start * group_size, min(stop * group_size, seq_len), device=q.device)
        probs = _softmax_rows(q, k, rows, scale)
        # Zero rows and zero key columns pad the ragged tails, so they add no mass to any block.
        probs = torch.nn.functional.pad(
            probs, (0, padded_keys - seq_len, 0, (stop - start) * group_size - rows.numel())
        )
        group_mass = probs.view(batch, heads, stop - start, group_size, num_kv_blocks, kv_block)
        block_scores = group_mass.sum(dim=(3, 5))
        indices.append(select_top_blocks(block_scores, keep)[0])
    counts = keep.to(torch.int32).view(1, heads, 1).expand(batch, heads, num_groups).contiguous()
    return SparseIndex(torch.cat(indices, dim=2), counts, group_size, kv_block, seq_len)


def recall_at_equal_keep(q: torch.Tensor, k: torch.Tensor, kept_fraction: float, group_size: int,
                         kv_blocks: tuple[int, ...], rows: torch.Tensor, scale: float | None = None) -> dict:
    """Attention mass that the oracle index keeps at one kept fraction, for several key granularities.

    For each ``kv_block`` in ``kv_blocks`` every head keeps ``max(1, round(kept_fraction * NKB))`` blocks
    chosen by ``oracle_index`` (exact per-group mass top-k), so token-level selection (``kv_block=1``) and
    block-level selection keep about the same number of keys; ``index_recall`` then measures the exact softmax
    mass captured on the query ``rows``.

    Args:
        q, k: ``[B, H, S, D]`` in grouped token order (e.g. a trained model's attention inputs).
        kept_fraction: kept fraction of the keys, in (0, 1].
        group_size: query tokens per group.
        kv_blocks: the key granularities to compare.
        rows: integer ``[R]`` query rows to measure on (``jittered_query_rows``: every in-cube position).

    Returns:
        ``{kv_block: float32 [B, H] recall}``.
    """
    check_unit_fraction(kept_fraction, "kept_fraction")
    result = {}
    for kv_block in kv_blocks:
        keep = torch.full((q.shape[1],), max(1, round(kept_fraction * math.ceil(q.shape[2] / kv_block))),
                          dtype=torch.int64)
        index = oracle_index(q, k, keep, group_size, kv_block, scale=scale)
        result[kv_block] = index_recall(q, k, index, rows, scale=scale)
    return result


def window_extents(
    grid: tuple[int, int, int], cube: tuple[int, int, int], kv_block: int, window_frac: float
) -> tuple[int, int, int]:
    """Window extent per dimension: ``max(cube_d, round_half_up(window_frac * grid_d))``, at most
    ``grid_d``; for ``kv_block == prod(cube)`` rounded up to a multiple of ``cube_d``."""
    whole_cubes = kv_block == math.prod(cube)
    extents = []
    for size, extent in zip(grid, cube):
        window = max(extent, math.floor(window_frac * size + 0.5))
        if whole_cubes:
            window = math.ceil(window / extent) * extent
        extents.append(min(window, size))
    return tuple(extents)


def window_index(
    grid: tuple[int, int, int],
    cube: tuple[int, int, int],
    kv_block: int,
    batch: int,
    heads: int,
    window_frac: float = 2 / 3,
) -> SparseIndex:
    """The 3-D window attention baseline (WA-L of the DSV paper) as a ``SparseIndex``.

    Each query cube attends to the keys of a 3-D box of ``window_extents`` tokens, centred on the cube
    (when the surplus over the cube is odd, the extra position goes after it) and shifted to stay inside
    the grid, so every group keeps the same number of keys. With ``kv_block == prod(cube)`` the box is
    whole cubes (aligned to the cube lattice); with ``kv_block == 1`` it is token-exact. Key ids are in
    grouped order (``cube_permutation``).

    Args:
        grid: ``(T, H, W)`` latent grid, divisible by ``cube``.
        cube: ``(t, h, w)`` query cube; ``group_size = t * h * w``.
        kv_block: 1 or ``prod(cube)``.
        batch, heads: leading sizes of the index (every batch entry and head gets the same rows).
        window_frac: window extent as a fraction of each grid size, in ``(0, 1]``.

    Returns:
        ``SparseIndex`` with ``indices [batch, heads, NG, K]`` on the CPU, ``K`` the window's blocks.
    """
    check_cube_tiles(grid, cube, "window attention (attention.mode=window)")
    _, inv = cube_permutation(grid, cube)
    grid, cube = tuple(int(size) for size in grid), tuple(int(size) for size in cube)
    group_size, seq_len = math.prod(cube), math.prod(grid)
    check_positive_int(batch, "batch")
    check_positive_int(heads, "heads")
    check_positive_int(kv_block, "kv_block")  # a NumPy int passed the test below, then failed validation
    if kv_block not in (1, group_size):
        raise ValueError(
            f"kv_block must be 1 or the cube volume {group_size} for a window index, got {kv_block}"
        )
    check_unit_fraction(window_frac, "window_frac")
    extents = window_extents(grid, cube, kv_block, window_frac)
    # Window positions are counted in units of `step`: whole cubes, or tokens.
    steps = cube if kv_block == group_size else (1, 1, 1)
    window_coords = []
    for size, extent, window, step in zip(grid, cube, extents, steps):
        cube_origins = torch.arange(0, size, extent)
        positions_before_cube = step * ((window - extent) // step // 2)
        starts = (cube_origins - positions_before_cube).clamp(0, size - window) // step
        window_coords.append(starts[:, None] + torch.arange(window // step))
    lattice = [size // step for size, step in zip(grid, steps)]
    coords_t, coords_h, coords_w = window_coords
    # [nT, nH, nW, wT, wH, wW]: raster id (in `step` units) of every window position of every cube.
    raster = (
        coords_t[:, None, None, :, None, None] * lattice[1] + coords_h[None, :, None, None, :, None]
    ) * lattice[2] + coords_w[None, None, :, None, None, :]
    num_groups = seq_len // group_size
    raster = raster.reshape(num_groups, -1)
    # Key cube j is grouped block j; single tokens map through the inverse permutation.
    block_ids = raster if kv_block == group_size else inv[raster]
    rows = torch.sort(block_ids, dim=-1).values.to(torch.int32)
    indices = rows.expand(batch, heads, *rows.shape).contiguous()
    counts = torch.full((batch, heads, num_groups), rows.shape[-1], dtype=torch.int32)
    return SparseIndex(indices, counts, group_size, kv_block, seq_len)


def keep_blocks_from_sparsity(
    sparsity: torch.Tensor, num_kv_blocks: int, floor_blocks: int, margin: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Key blocks to keep per head: ``clamp(ceil((1 - sparsity + margin) * NKB), floor_blocks, NKB)``.

    Args:
        sparsity: float ``[H]`` measured head sparsity; a head not measured (NaN) keeps every block.
        num_kv_blocks: ``NKB``.
        floor_blocks: least blocks any head keeps, >= 1 (capped at ``NKB``).
        margin: extra kept fraction on top of ``1 - sparsity``: one for all heads, or float ``[H]``.

    Returns:
        int32 ``[H]`` on ``sparsity``'s device.
    """
    if not (isinstance(sparsity, torch.Tensor) and sparsity.dim() == 1 and sparsity.dtype.is_floating_point):
        raise ValueError("sparsity must be a 1-D floating tensor [H]")
    check_positive_int(num_kv_blocks, "num_kv_blocks")
    check_positive_int(floor_blocks, "floor_blocks")
    if isinstance(margin, torch.Tensor):
        if margin.shape != sparsity.shape:
            raise ValueError(f"margin must be a float or a tensor of sparsity's shape {tuple(sparsity.shape)}, "
                             f"got {tuple(margin.shape)}")
        margin = margin.to(device=sparsity.device, dtype=torch.float64)
    wanted = (1.0 - sparsity.double() + margin) * num_kv_blocks
    keep = torch.ceil(wanted - (WHOLE_BLOCK_TOLERANCE + torch.finfo(torch.float32).eps * num_kv_blocks))
    # A head not measured (NaN, as the layers' sparsity buffers start) keeps every block: dense is exact.
    keep = torch.where(torch.isnan(keep), float(num_kv_blocks), keep)
    return keep.clamp(min=floor_blocks).clamp(max=num_kv_blocks).to(torch.int32)
