"""PSNR/SSIM of DSV samples against dense ones (identical frames, with infinite PSNR, stay out of the mean), and
the grid `dsv sample` writes."""

import json

import pytest
import torch

from dsv.analysis.sample import similarity, to_uint8_grid
from dsv.train.video_io import read_video, write_video

pytest.importorskip("skimage")


def _videos(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(2, 3, 3, 16, 16, generator=g) * 2 - 1  # [N, 3, T, H, W] in [-1, 1]


def test_identical_samples_give_no_finite_psnr_and_valid_json():
    videos = _videos(0)
    result = similarity(videos, videos.clone())
    assert result["psnr_db"] is None and result["identical_frames"] == result["frames"] == 6
    assert result["ssim"] == pytest.approx(1.0)
    json.dumps(result, allow_nan=False)  # the CLI prints it this way: an inf would raise here


def test_psnr_averages_only_the_differing_frames():
    reference = _videos(1)
    videos = reference.clone()
    videos[1, :, 2] += 0.01  # one frame of six differs, by 0.01 everywhere: MSE 1e-4, PSNR 10*log10(4/1e-4)
    result = similarity(videos, reference)
    assert result["identical_frames"] == 5 and result["frames"] == 6
    assert result["psnr_db"] == pytest.approx(10 * torch.log10(torch.tensor(4 / 1e-4)).item(), abs=0.05)


def test_ssim_is_taken_on_non_negative_pixels():
    """SSIM's luminance term assumes non-negative intensities: on [-1, 1] pixels a mid-grey frame 1% brighter
    than its reference scored 0.5. Mapped to [0, 1] as the written frames are, the pair is near-identical, and a
    frame of fresh noise against another is not."""
    grey = torch.zeros(1, 3, 2, 32, 32)  # 0 in [-1, 1]: mid-grey
    result = similarity(grey + 0.02, grey)  # +1% of the [0, 1] range
    assert result["ssim"] > 0.99 and result["ssim_window"] == 11
    assert similarity(_videos(2), _videos(3))["ssim"] < 0.2  # independent uniform noise: near 0


@pytest.mark.parametrize(("side", "window"), [(8, 7), (5, 5), (2, None)])
def test_ssim_of_small_frames_uses_the_largest_window_that_fits(side, window):
    videos = torch.rand(1, 3, 2, side, side, generator=torch.Generator().manual_seed(side)) * 2 - 1
    result = similarity(videos, videos.flip(-1))  # crashed in skimage after both sampling passes
    if window is None:
        assert result["ssim"] is None and result["ssim_window"] < 3
    else:
        assert result["ssim_window"] == window and -1 <= result["ssim"] <= 1


def test_an_odd_sized_grid_is_padded_black_to_even_for_mp4(tmp_path):
    """An .mp4's 4:2:0 chroma needs even sizes: 15-pixel samples used to fail in the writer after all the
    sampling. The padded grid keeps every sample pixel and adds a black last row and column."""
    pytest.importorskip("av")
    videos = torch.rand(3, 3, 2, 15, 15, generator=torch.Generator().manual_seed(4)) * 2 - 1
    grid = to_uint8_grid(videos, columns=3, even=True)
    assert grid.shape == (2, 16, 46, 3)
    assert torch.equal(grid[:, :15, :45], to_uint8_grid(videos, columns=3))
    assert grid[:, 15].eq(0).all() and grid[:, :, 45].eq(0).all()
    write_video(grid, tmp_path / "samples.mp4")
    assert read_video(tmp_path / "samples.mp4").shape == (2, 16, 46, 3)
