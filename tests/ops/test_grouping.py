import itertools
import math

import pytest
import torch

from dsv.ops.grouping import check_cube_tiles, check_sequence_matches_grid, cube_permutation


def brute_force_grouped_order(grid, cube):
    """Raster ids listed cube by cube (cubes in raster order), tokens in raster order inside a cube."""
    (T, H, W), (ct, ch, cw) = grid, cube
    order = []
    for t0, h0, w0 in itertools.product(range(0, T, ct), range(0, H, ch), range(0, W, cw)):
        for t, h, w in itertools.product(range(t0, t0 + ct), range(h0, h0 + ch), range(w0, w0 + cw)):
            order.append((t * H + h) * W + w)
    return order


@pytest.mark.parametrize(
    "grid, cube",
    [((4, 6, 8), (2, 2, 4)), ((3, 4, 4), (1, 2, 2)), ((2, 2, 2), (2, 2, 2)), ((5, 3, 7), (1, 1, 1))],
)
def test_permutation_matches_brute_force(grid, cube):
    perm, inv = cube_permutation(grid, cube)
    assert perm.dtype == torch.int64 and inv.dtype == torch.int64
    assert perm.tolist() == brute_force_grouped_order(grid, cube)
    assert torch.equal(perm[inv], torch.arange(perm.numel()))


def test_round_trip_restores_tokens():
    grid, cube = (4, 4, 6), (2, 2, 2)
    x = torch.randn(2, 3, 96, 5)
    perm, inv = cube_permutation(grid, cube)
    grouped = x.index_select(2, perm)
    assert not torch.equal(grouped, x)
    assert torch.equal(grouped.index_select(2, inv), x)


def test_every_cube_is_contiguous_after_permutation():
    grid, cube = (4, 6, 8), (2, 3, 4)
    T, H, W = grid
    coords = torch.stack(torch.meshgrid(torch.arange(T), torch.arange(H), torch.arange(W), indexing="ij"), -1)
    perm, _ = cube_permutation(grid, cube)
    grouped_coords = coords.reshape(-1, 3)[perm]
    group_size = 2 * 3 * 4
    cube_extent = torch.tensor(cube)
    for g, group in enumerate(grouped_coords.split(group_size)):
        # One cube: every token of the group has the same cube coordinate ...
        cube_coord = group // cube_extent
        assert (cube_coord == cube_coord[0]).all()
        # ... and the cubes come in raster order of their coordinates.
        n_h, n_w = H // cube[1], W // cube[2]
        assert int((cube_coord[0, 0] * n_h + cube_coord[0, 1]) * n_w + cube_coord[0, 2]) == g
        # The group covers the cube's tokens exactly once.
        assert len({tuple(c) for c in group.tolist()}) == group_size


def test_cached_permutation_cannot_be_corrupted_by_caller():
    perm, _ = cube_permutation((2, 4, 4), (1, 2, 2))
    expected = perm.clone()
    perm.zero_()
    assert torch.equal(cube_permutation((2, 4, 4), (1, 2, 2))[0], expected)
    # A list spelling of the same grid gives the same result.
    assert torch.equal(cube_permutation([2, 4, 4], [1, 2, 2])[0], expected)


def test_whole_cube_checks_name_dimension_and_padding():
    message = r"windows needs whole cubes: grid T=9 is not divisible by cube t=2; pad T to 10"
    with pytest.raises(ValueError, match=message):
        check_cube_tiles((9, 4, 4), (2, 2, 2), "windows")
    with pytest.raises(ValueError, match=r"grid W=10 .* cube w=4; pad W to 12 .* dividing 10"):
        check_cube_tiles((2, 4, 10), (1, 2, 4), "windows")
    check_cube_tiles((2, 4, 8), (1, 2, 4), "windows")
    # A cube taller than the grid leaves no whole cube: every group is a run of partial cubes.
    perm, inv = cube_permutation((2, 4, 8), (1, 8, 4))
    assert torch.equal(torch.sort(perm).values, torch.arange(64)) and torch.equal(perm[inv], torch.arange(64))


@pytest.mark.parametrize("grid, cube", [((21, 30, 52), (2, 4, 4)), ((13, 30, 45), (2, 4, 4)), ((3, 5, 7), (2, 2, 2))])
def test_a_grid_the_cube_does_not_tile_keeps_whole_cubes_first_then_neighbouring_partial_ones(grid, cube):
    """Wan 2.1 at 480p (21 x 30 x 52 latent tokens), CogVideoX-5b (13 x 30 x 45): the whole cubes keep their
    grouped order and come first, each a group; the partial cubes at the edges follow, each contiguous, so a
    group of the remainder spans few, adjacent partial cubes; it is a permutation."""
    perm, inv = cube_permutation(grid, cube)
    seq_len, group = math.prod(grid), math.prod(cube)
    assert torch.equal(torch.sort(perm).values, torch.arange(seq_len)) and torch.equal(perm[inv], torch.arange(seq_len))
    whole = tuple(size - size % extent for size, extent in zip(grid, cube))
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).view(-1, 3)[perm]
    n_whole = math.prod(whole)
    assert (coords[:n_whole] < torch.tensor(whole)).all() and not (coords[n_whole:] < torch.tensor(whole)).all(-1).any()
    sub_perm, _ = cube_permutation(whole, cube)
    sub_coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in whole), indexing="ij"), -1).view(-1, 3)
    assert torch.equal(coords[:n_whole], sub_coords[sub_perm])  # the tiled part's own grouped order
    cube_of = coords // torch.tensor(cube)
    remainder = cube_of[n_whole:]
    changes = (remainder[1:] != remainder[:-1]).any(-1).sum().item()
    assert changes + 1 == len(torch.unique(remainder, dim=0))  # each partial cube is contiguous
    # Remainder groups stay local: their boxes average under 3 cube extents per axis (a raster walk of the
    # partial cubes wraps at each row end: a group spanning the whole width).
    spans = torch.stack([coords[start:start + group].max(0).values - coords[start:start + group].min(0).values
                         for start in range(n_whole, seq_len, group)])
    assert (spans.float().mean(0) < 3 * torch.tensor(cube)).all(), spans.float().mean(0)


@pytest.mark.parametrize(
    "grid, cube, match",
    [
        ((0, 4, 4), (1, 2, 2), r"grid T=0 must be positive"),
        ((2, 4, 4), (1, -2, 2), r"cube H=-2 must be positive"),
        ((2, 4), (1, 2, 2), r"grid must have three sizes"),
        (8, (1, 2, 2), r"grid must be a sequence"),
    ],
)
def test_bad_shapes_rejected(grid, cube, match):
    with pytest.raises(ValueError, match=match):
        cube_permutation(grid, cube)


def test_sequence_length_must_match_grid():
    check_sequence_matches_grid(2 * 4 * 6, (2, 4, 6))
    with pytest.raises(ValueError, match=r"seq_len=47 .* grid \(T, H, W\)=\(2, 4, 6\).* T\*H\*W=48"):
        check_sequence_matches_grid(47, (2, 4, 6))
