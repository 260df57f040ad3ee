"""Fréchet Video Distance: the Fréchet distance between Gaussians fitted to I3D features of two video sets.

FVD(a, b) = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^(1/2)), with the features being the 400-d
Kinetics-400 logits of ``dsv.eval.i3d`` on 16-frame clips (Unterthiner et al., 2018). The value depends on the
number of clips (the estimate is biased for small sets): compare FVDs computed on equally many clips.
"""

from __future__ import annotations

import numpy as np
import torch

from dsv.eval.i3d import I3D

__all__ = ["extract_features", "frechet_distance", "fvd"]


def _as_float64_matrix(feats: torch.Tensor | np.ndarray, name: str) -> np.ndarray:
    if isinstance(feats, torch.Tensor):
        feats = feats.detach().cpu().double().numpy()
    feats = np.asarray(feats, dtype=np.float64)
    if feats.ndim != 2 or feats.shape[0] < 2:
        raise ValueError(f"frechet_distance: {name} must be [N, d] with N >= 2 (for a covariance), got {feats.shape}")
    if not np.isfinite(feats).all():
        raise ValueError(f"frechet_distance: {name} has non-finite values")
    return feats


def _psd_sqrt(sym: np.ndarray) -> np.ndarray:
    """Square root of a symmetric PSD matrix [d, d]; rounding-level negative eigenvalues are treated as 0."""
    eigvals, eigvecs = np.linalg.eigh(sym)
    return (eigvecs * np.sqrt(np.clip(eigvals, 0.0, None))) @ eigvecs.T


def frechet_distance(feats_a: torch.Tensor | np.ndarray, feats_b: torch.Tensor | np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to feats_a [N, d] and feats_b [M, d] (N, M >= 2), in float64.

    Means and unbiased covariances (ddof=1) as in the reference FID/FVD code. tr((S_a S_b)^(1/2)) is computed
    as tr((A S_b A)^(1/2)) with A = S_a^(1/2): the two are equal (similar matrices have the same eigenvalues),
    and the second is a symmetric PSD matrix, so symmetric eigendecompositions give it without the complex
    round-off that a general matrix square root of S_a S_b (scipy.linalg.sqrtm) produces and then has to discard.
    That also holds when N or M < d, where the covariances are singular, the usual case for few clips.
    """
    a = _as_float64_matrix(feats_a, "feats_a")
    b = _as_float64_matrix(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"frechet_distance: feature sizes differ: {a.shape[1]} vs {b.shape[1]}")
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a = np.atleast_2d(np.cov(a, rowvar=False))
    cov_b = np.atleast_2d(np.cov(b, rowvar=False))
    root_a = _psd_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    middle = (middle + middle.T) / 2  # exactly symmetric for eigvalsh; the asymmetry is rounding only
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh(middle), 0.0, None)).sum()
    dist = float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2.0 * trace_sqrt)
    # A squared distance: a negative value can only be rounding (identical sets), so it is reported as 0.
    return max(dist, 0.0)


def extract_features(videos: torch.Tensor, i3d: I3D, batch_size: int = 8, layer: str = "logits") -> np.ndarray:
    """I3D features of videos [N, 3, T, H, W] in [-1, 1] (T >= 9, 16 standard), run batch_size clips at a time.

    Returns float64 [N, 400] (layer="logits", the FVD standard) or [N, 1024] (layer="pool").
    """
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise ValueError(f"extract_features: videos must be a tensor [N, 3, T, H, W], got {shape}")
    if videos.shape[0] < 1:
        raise ValueError("extract_features: videos holds no video (N = 0)")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"extract_features: batch_size must be an int >= 1, got {batch_size!r}")
    chunks = [i3d.features(videos[i : i + batch_size], layer=layer) for i in range(0, videos.shape[0], batch_size)]
    return torch.cat(chunks).cpu().double().numpy()


def fvd(videos_a: torch.Tensor, videos_b: torch.Tensor, i3d: I3D, batch_size: int = 8) -> float:
    """FVD between videos_a [N, 3, T, H, W] and videos_b [M, 3, T, H, W], both in [-1, 1] (N, M >= 2), on the
    I3D logits. Frames of any size are resized to 224x224 inside the network; lower is more similar."""
    return frechet_distance(extract_features(videos_a, i3d, batch_size), extract_features(videos_b, i3d, batch_size))
