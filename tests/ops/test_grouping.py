import itertools

import pytest
import torch

from dsv.ops.grouping import check_sequence_matches_grid, cube_permutation


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


def test_indivisible_grid_names_dimension_and_padding():
    with pytest.raises(ValueError, match=r"grid T=9 is not divisible by cube t=2; pad T to 10"):
        cube_permutation((9, 4, 4), (2, 2, 2))
    with pytest.raises(ValueError, match=r"grid W=10 .* cube w=4; pad W to 12 .* dividing 10"):
        cube_permutation((2, 4, 10), (1, 2, 4))


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
