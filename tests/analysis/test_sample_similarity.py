"""PSNR/SSIM of DSV samples against dense ones: identical frames (infinite PSNR) stay out of the mean."""

import json

import pytest
import torch

from dsv.analysis.sample import similarity

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
