"""Video files <-> uint8 frame tensors.

Decoding goes through PyAV (FFmpeg). Frames are converted and resized by FFmpeg's swscale while decoding,
so a 1280x720 clip never exists in memory at full size as RGB. Where PyAV is not installed, OpenCV's FFmpeg
build decodes instead (e.g. a GPU image that has OpenCV, when PyAV's 36 MB wheel would not fit the files
that can be brought along): the same frames, pixel values within ~1 level of PyAV's (another YUV→RGB
conversion and area resize). Writing gives ``.mp4`` (H.264 through PyAV, MPEG-4 part 2 where the FFmpeg
build lacks libx264; PyAV only) or ``.gif`` (Pillow).
"""

from __future__ import annotations

import os
import uuid
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dsv.train.durable import check_folder_possible, fsync_path

try:
    import av
except ModuleNotFoundError:  # decoding falls back to OpenCV; writing .mp4 needs PyAV
    av = None

WRITE_SUFFIXES = (".mp4", ".gif")

# libx264 is missing from some FFmpeg builds (licensing); MPEG-4 part 2 is in all of them.
_MP4_CODECS = ("libx264", "mpeg4")


class VideoDecodeError(ValueError):
    """A file exists but PyAV cannot decode video frames from it."""


def read_video(path: str | os.PathLike, short_side: int | None = None) -> torch.Tensor:
    """Decode every frame of the first video stream of ``path``.

    Args:
        path: any container/codec FFmpeg reads (.mp4, .avi, .mov, .mkv, .webm, .gif, ...).
        short_side: resize each frame so its shorter side is this many pixels (aspect kept, the long side
            rounded); area-averaging, so downscaling is antialiased. None keeps the stored size.

    Returns:
        uint8 tensor [T, H, W, 3], RGB. Every frame has the size of the first one (a stream whose
        resolution changes midway is rescaled to it).

    Raises:
        FileNotFoundError: ``path`` is not an existing file.
        VideoDecodeError: PyAV cannot open or decode it, it has no video stream, or no frame decodes.
    """
    if short_side is not None and (type(short_side) is not int or short_side < 1):
        raise ValueError(f"read_video: short_side must be None or an int >= 1, got {short_side!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_video: no such video file: {path}")
    if av is None:
        return _read_video_opencv(path, short_side)
    frames: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoDecodeError(f"read_video: {path} has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # frame + slice threads: decoding the 720p clip dominates load time
            out_w = out_h = turns = 0
            last_time = None
            for frame in container.decode(stream):
                if not frames:
                    # Quarter turns counterclockwise of the display matrix: a phone stores portrait video as
                    # landscape frames with a 90-degree rotation, which players (and FFmpeg's CLI) apply.
                    turns = round(getattr(frame, "rotation", 0) / 90) % 4
                    # Non-square pixels (DV, DVD, HDV: 1440x1080 at 4:3), which players widen: loaded as
                    # stored, such video trained squashed.
                    width = _displayed_width(frame.width, stream.sample_aspect_ratio)
                    shown_w, shown_h = (frame.height, width) if turns % 2 else (width, frame.height)
                    _warn_if_enlarged(path, min(shown_w, shown_h), short_side)
                    out_w, out_h = _scaled_size(shown_w, shown_h, short_side)
                    if turns % 2:
                        out_w, out_h = out_h, out_w  # decoded in the stored orientation, turned after
                pixels = frame.to_ndarray(width=out_w, height=out_h, format="rgb24", interpolation="AREA")
                frames.append(np.ascontiguousarray(np.rot90(pixels, turns)) if turns else pixels)
                last_time = frame.time if frame.time is not None else last_time
            _warn_if_cut_short(path, stream, container, last_time)
    except av.FFmpegError as err:
        if isinstance(err, (OSError, MemoryError)):
            raise  # the machine's (a read error, no memory, no permission), not the file's: no source to skip
        raise VideoDecodeError(f"read_video: PyAV cannot decode {path}: {err}") from err
    if not frames:
        raise VideoDecodeError(f"read_video: {path} has a video stream but no frame decodes")
    return torch.from_numpy(np.stack(frames))


def _displayed_width(width: int, sample_aspect_ratio) -> int:
    """The width a player shows a frame `width` pixels wide at (pixel) `sample_aspect_ratio` (None or 0: square)."""
    if not sample_aspect_ratio or sample_aspect_ratio == 1:
        return width
    return max(1, round(width * float(sample_aspect_ratio)))


def _warn_if_enlarged(path: Path, stored_short_side: int, short_side: int | None) -> None:
    if short_side is not None and stored_short_side < short_side:
        warnings.warn(f"read_video: {path} is {stored_short_side} px on its short side, enlarged to {short_side}: "
                      "its frames are upsampled", stacklevel=3)


def _warn_if_cut_short(path: Path, stream, container, last_time: float | None) -> None:
    """Warn where the decoded frames end well before the duration the container states: a file cut off by
    an interrupted copy or download decodes without an error up to where its bytes end."""
    if last_time is None:
        return
    if stream.duration is not None and stream.time_base is not None:
        stated = float(stream.duration * stream.time_base)
    elif (tagged := _duration_tag(stream.metadata.get("DURATION"))) is not None:
        stated = tagged  # Matroska and WebM state a stream's duration as a tag only
    elif container.duration is not None and len(container.streams) == 1:
        # The longest stream's: with a longer audio track, a whole file would read as cut off.
        stated = container.duration / av.time_base
    else:
        return
    period = 1.0 / float(stream.average_rate) if stream.average_rate else 0.0
    _warn_if_short_of(path, last_time + period, stated)


def _duration_tag(text: str | None) -> float | None:
    """Seconds of a Matroska ``DURATION`` tag (``HH:MM:SS.fraction``), or None where it is absent or malformed."""
    try:
        hours, minutes, seconds = (text or "").split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None


def _warn_if_short_of(path: Path, decoded: float, stated: float) -> None:
    # Slack for containers whose stated duration rounds or counts a trailing frame differently.
    if stated - decoded > max(0.5, 0.1 * stated):
        warnings.warn(f"read_video: {path} decodes {decoded:.2f} s of the {stated:.2f} s its container states: "
                      "the file may be cut off (an interrupted copy or download)", stacklevel=4)


def _read_video_opencv(path: Path, short_side: int | None) -> torch.Tensor:
    """``read_video`` through OpenCV, for machines without PyAV."""
    try:
        import cv2
    except ModuleNotFoundError:
        raise ModuleNotFoundError("read_video needs PyAV (pip install av) or OpenCV (pip install "
                                  "opencv-python-headless); neither is installed") from None
    capture = cv2.VideoCapture(str(path))
    frames: list[np.ndarray] = []
    try:
        while True:
            ok, frame = capture.read()  # uint8 [H, W, 3], BGR
            if not ok:
                break
            if not frames:
                numerator, denominator = capture.get(cv2.CAP_PROP_SAR_NUM), capture.get(cv2.CAP_PROP_SAR_DEN)
                width = _displayed_width(frame.shape[1], numerator / denominator if denominator > 0 else None)
                _warn_if_enlarged(path, min(width, frame.shape[0]), short_side)
                out_w, out_h = _scaled_size(width, frame.shape[0], short_side)
            if frame.shape[:2] != (out_h, out_w):
                frame = cv2.resize(frame, (out_w, out_h), interpolation=cv2.INTER_AREA)
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        # The frame count the container states (0 or less where it states none), as PyAV's duration check.
        stated_frames, fps = capture.get(cv2.CAP_PROP_FRAME_COUNT), capture.get(cv2.CAP_PROP_FPS)
        if frames and stated_frames > 0 and fps > 0:
            _warn_if_short_of(path, len(frames) / fps, stated_frames / fps)
    finally:
        capture.release()
    if not frames:
        raise VideoDecodeError(f"read_video: OpenCV cannot decode video frames from {path}")
    return torch.from_numpy(np.stack(frames))


def check_fps(fps) -> None:
    """Raise ValueError unless `fps` is a number > 0 (as `write_video` takes it): callers check before the work
    whose frames they write."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise ValueError(f"fps must be a number > 0 (frames per second), got {fps!r}")


def write_video(frames: torch.Tensor, path: str | os.PathLike, fps: float = 8) -> None:
    """Write frames to ``path`` (.mp4 or .gif, chosen by suffix), atomically.

    The file is written under a temporary name in the same folder and then renamed over ``path``, so a
    reader never sees a half-written file. Missing parent folders are created.

    Args:
        frames: uint8 tensor [T, H, W, 3], RGB, T >= 1. For .mp4, H and W must be even (the encoders
            store 4:2:0 chroma, which halves both).
        path: destination; its suffix picks the format.
        fps: frames per second, > 0. A GIF stores frame times in 1/100 s, so its rate is rounded to that.

    Note: Pillow stores runs of identical consecutive frames in a GIF as one longer frame; playback is
    unchanged, but reading such a GIF back gives fewer frames.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    check_writable(path)
    is_tensor = isinstance(frames, torch.Tensor)
    if not is_tensor or frames.dtype != torch.uint8 or frames.dim() != 4 or frames.shape[-1] != 3:
        desc = f"{frames.dtype} {tuple(frames.shape)}" if is_tensor else type(frames).__name__
        raise ValueError(f"write_video: frames must be a uint8 tensor [T, H, W, 3], got {desc}")
    if frames.shape[0] < 1 or frames.shape[1] < 1 or frames.shape[2] < 1:
        raise ValueError(f"write_video: frames [T, H, W, 3] must be non-empty, got {tuple(frames.shape)}")
    check_fps(fps)
    height, width = frames.shape[1], frames.shape[2]
    if suffix == ".mp4" and (height % 2 or width % 2):
        raise ValueError(
            f"write_video: .mp4 needs even height and width (4:2:0 chroma), got {height}x{width} for {path}; "
            "crop or pad the frames, or write a .gif"
        )

    array = frames.detach().cpu().contiguous().numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    # A hidden, unique name in the same folder: os.replace is atomic only within one file system, and the
    # suffix ".part" keeps it out of folder scans for video files.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
    try:
        if suffix == ".mp4":
            _write_mp4(array, tmp, fps)
        else:
            _write_gif(array, tmp, fps)
        # On disk before the rename, and the rename too: after a power loss the file under its final name is
        # whole, never empty.
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike) -> None:
    """ValueError unless ``write_video`` can write ``path``'s format here: a suffix it does not take, .mp4
    without an encoder (no PyAV, or an FFmpeg build with none of ``_MP4_CODECS``), a path that is a folder or lies
    under a file. Callers that compute for minutes before writing check first, so nothing computed is lost."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in WRITE_SUFFIXES:
        raise ValueError(
            f"write_video: unsupported suffix {path.suffix!r} in {path}; supported: {', '.join(WRITE_SUFFIXES)}"
        )
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a folder")
    check_folder_possible(path.parent, f"cannot write {path} into")
    if suffix == ".mp4":
        try:
            _pick_mp4_codec()
        except (ModuleNotFoundError, RuntimeError) as err:
            raise ValueError(f"cannot write {path} here: {err}") from err


def _scaled_size(width: int, height: int, short_side: int | None) -> tuple[int, int]:
    """(width, height) with the shorter side scaled to ``short_side`` (unchanged if None)."""
    if short_side is None:
        return width, height
    scale = short_side / min(width, height)
    if width <= height:
        return short_side, max(1, round(height * scale))
    return max(1, round(width * scale)), short_side


def _pick_mp4_codec() -> str:
    """The first encoder of ``_MP4_CODECS`` this FFmpeg build has."""
    if av is None:
        raise ModuleNotFoundError("write_video: .mp4 needs PyAV (pip install av); .gif works without it")
    for name in _MP4_CODECS:
        try:
            av.Codec(name, "w")
        except av.codec.codec.UnknownCodecError:
            continue
        return name
    raise RuntimeError(f"write_video: this FFmpeg build has none of the encoders {_MP4_CODECS} needed for .mp4")


def _write_mp4(array: np.ndarray, path: Path, fps: float) -> None:
    """Encode uint8 [T, H, W, 3] (H, W even) to an MP4 file at ``path``."""
    codec = _pick_mp4_codec()
    _, height, width, _ = array.shape
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "17"}  # visually lossless: files are small at our sizes anyway
        else:
            # mpeg4 is rate-controlled; ~4 bits per pixel per frame keeps it near lossless too.
            stream.bit_rate = max(200_000, int(4 * width * height * fps))
        for image in array:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames


def _write_gif(array: np.ndarray, path: Path, fps: float) -> None:
    """Write uint8 [T, H, W, 3] to an endlessly looping GIF at ``path`` (adaptive palette per frame)."""
    images = [Image.fromarray(image) for image in array]
    images[0].save(
        path,
        format="GIF",  # the temporary name's suffix is ".part", so the format cannot come from it
        save_all=True,
        append_images=images[1:],
        duration=max(10, round(1000 / fps)),  # ms per frame; GIF resolution is 10 ms
        loop=0,
    )
