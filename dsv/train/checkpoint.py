"""Atomic checkpoints: safetensors weights + the full training state, verified on load.

Layout: `<run>/checkpoints/step_00000100/{model.safetensors, state.pt, manifest.json}` and
`<run>/checkpoints/latest` (the name of the newest complete checkpoint, for people and scripts; readers take the
newest complete checkpoint folder, as resuming does). A checkpoint is written into a
temporary folder and renamed into place only when complete, so a crash while saving never damages an
existing checkpoint. The manifest holds SHA-256 digests, so a truncated or altered file is detected.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import IO, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsv.modules.config import AttentionConfig
from dsv.modules.controller import CONTROLLER_NAME, LAYOUT_BUFFER, layout_record
from dsv.train.config import config_from_dict
from dsv.train.durable import fsync_path

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
STATE = "state.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not match the model/config."""


def checkpoint_config(manifest: dict, ckpt: str | Path):
    """The training config stored in a checkpoint's manifest (`dsv.train.config.Config`); a CheckpointError
    naming the checkpoint where this version cannot read it, so that it does not read as a bad `--set`."""
    try:
        return config_from_dict(manifest["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {ckpt}: its stored configuration cannot be read by this version of DSV "
                              f"({type(err).__name__}: {err}); it was saved by another version or edited") from err


def lock_run_dir(run_dir: str | Path) -> IO | None:
    """Hold an exclusive lock on the run folder for this process (on ``<run_dir>/.lock``; released when the
    returned file is closed, or the process ends). Two processes training into one folder (two launches at once
    that both found it empty, a duplicate ``--resume``, a requeued job while the old one still runs) would
    interleave their checkpoints and logs without an error; the second now stops before writing anything.
    Raises CheckpointError when another process holds the lock; where the file system cannot lock, warns and
    returns None."""
    import fcntl

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / ".lock", "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise CheckpointError(f"another process is training into {run_dir} (it holds {run_dir / '.lock'}): wait "
                              "for it to end, or set train.out_dir to another folder (nothing was written)") from None
    except OSError as err:
        handle.close()
        warnings.warn(f"could not lock {run_dir} ({err}): make sure no other process trains into it",
                      stacklevel=2)
        return None
    return handle


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a crash leaves the earlier file (or none), never half of one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)  # the rename itself, so that a power loss cannot bring the earlier file back


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, weights: dict[str, torch.Tensor], train_state: dict,
                    config: dict, keep: int, scheduled: Callable[[int], bool] | None = None) -> Path:
    """Write checkpoint `step` (full, unsharded `weights` and the training state) atomically, point
    `latest` at it, and prune all but the newest `keep`. With `scheduled` (whether a step is on the run's
    checkpoint schedule) only scheduled checkpoints count towards `keep`; another (a time-limit stop's) stays
    only while it is the newest, so that a run in legs keeps the checkpoints of the uninterrupted run."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = root / name
    tmp = root / f".tmp_{name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    save_file(weights, tmp / WEIGHTS, metadata={"format": "dsv", "step": str(step)})
    torch.save(train_state, tmp / STATE)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "config": config,
        "sha256": {WEIGHTS: _sha256(tmp / WEIGHTS), STATE: _sha256(tmp / STATE)},
    }
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    for f in (WEIGHTS, STATE):
        fsync_path(tmp / f)
    fsync_path(tmp)  # the folder's entries too, before the rename makes it a checkpoint
    if final.exists():  # re-saving a step: move the old copy aside first, drop it only after the swap
        stale = root / f".stale_{name}_{os.getpid()}"
        os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale)
    else:
        os.replace(tmp, final)
    fsync_path(root)
    write_text_atomic(root / "latest", name + "\n")
    checkpoints = list_checkpoints(run_dir)
    if scheduled is None:
        doomed = checkpoints[:-keep]
    else:
        on_schedule = [c for c in checkpoints if scheduled(int(_step_name(c)[len("step_"):]))][-keep:]
        kept = {_step_name(c) for c in on_schedule} | {name, _step_name(checkpoints[-1])}
        doomed = [c for c in checkpoints if _step_name(c) not in kept]
    for old in doomed:
        _prune(old)
    return final


def _prune(checkpoint: Path) -> None:
    """Delete an old checkpoint: renamed first (a deletion cut short would otherwise leave a folder whose
    manifest still makes it look complete), then removed; best effort, as the new checkpoint is complete."""
    doomed = checkpoint.with_name(f".tmp_{checkpoint.name}_prune{os.getpid()}")
    try:
        os.replace(checkpoint, doomed)
        shutil.rmtree(doomed)
    except OSError as err:
        warnings.warn(f"could not delete the old checkpoint {checkpoint} ({err}); the new one is complete",
                      stacklevel=3)


_CHECKPOINT_NAME = re.compile(r"step_\d{8,}")  # f"step_{step:08d}", as save_checkpoint names them


def _step_name(folder: Path) -> str:
    """``step_XXXXXXXX`` for a checkpoint folder and for the old copy a re-save moved aside."""
    return folder.name[len(".stale_"):].rsplit("_", 1)[0] if folder.name.startswith(".stale_") else folder.name


def list_checkpoints(run_dir: str | Path, repair: bool = False) -> list[Path]:
    """Complete checkpoints, oldest first. A step whose re-save was interrupted between moving the old copy
    aside and moving the new one in is listed as that old copy; with ``repair`` (only while holding the run
    folder's lock: a live trainer may be between those two renames) it is moved back into place first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    # Only the names a save writes: a user's copy (`step_00000004_keep`) is neither resumed from nor pruned.
    found = {p.name: p for p in root.iterdir() if p.is_dir() and _CHECKPOINT_NAME.fullmatch(p.name)}
    for stale in root.glob(".stale_step_*"):
        name = _step_name(stale)
        if _CHECKPOINT_NAME.fullmatch(name) and name not in found and (stale / MANIFEST).is_file():
            if repair:
                os.replace(stale, root / name)
                stale = root / name
            found[name] = stale
    # By step, not by name: past step 99,999,999 the name has more digits and would sort first.
    ordered = sorted(found, key=lambda name: int(name[len("step_"):]))
    return [found[name] for name in ordered if (found[name] / MANIFEST).is_file()]


def remove_unfinished_saves(run_dir: str | Path) -> list[str]:
    """Delete what crashed saves left in a run's checkpoint folder: unfinished ``.tmp_step_*`` folders (never
    renamed into a checkpoint), temporary files of the ``latest`` file and ``.stale_step_*`` copies of re-saved
    steps whose new copy is complete. A stale copy whose step is missing is the only copy of it:
    ``list_checkpoints`` moves it back first.

    Call it only while holding the run folder's lock (``lock_run_dir``): a ``.tmp_`` folder of a save in
    progress elsewhere would be deleted under its writer. Best effort: a folder that cannot be deleted warns
    and stays. Returns the names deleted."""
    root = checkpoint_root(run_dir)
    list_checkpoints(run_dir, repair=True)  # restores a re-save interrupted between its two renames
    if not root.is_dir():
        return []
    removed = []
    for leftover in sorted(root.glob(".latest.tmp*")):  # the `latest` file of a save cut short
        try:
            leftover.unlink()
            removed.append(leftover.name)
        except OSError as err:
            warnings.warn(f"could not delete {leftover}, left by a crashed save ({err})", stacklevel=2)
    for leftover in sorted(root.glob(".tmp_step_*")) + sorted(root.glob(".stale_step_*")):
        if not leftover.is_dir():
            continue
        if leftover.name.startswith(".stale_") and not (root / _step_name(leftover) / MANIFEST).is_file():
            continue  # the step's other copy is not complete: this old copy may be the only good one
        try:
            shutil.rmtree(leftover)
            removed.append(leftover.name)
        except OSError as err:
            warnings.warn(f"could not delete {leftover}, left by a crashed save ({err}); it is not a checkpoint "
                          "and may be deleted by hand", stacklevel=2)
    return removed


def latest_manifest(run_dir: str | Path) -> tuple[Path, dict] | None:
    """The last complete checkpoint of `run_dir` and its manifest (not the weights), or None when there is none
    or its manifest is unreadable (loading it then says why)."""
    existing = list_checkpoints(run_dir)
    if not existing:
        return None
    try:
        manifest = json.loads((existing[-1] / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return (existing[-1], manifest) if isinstance(manifest, dict) else None


def checkpoint_step(run_dir: str | Path) -> int | None:
    """The step of the checkpoint that `--resume` would continue `run_dir` from, or None when there is none or
    it is unreadable."""
    found = latest_manifest(run_dir)
    step = found[1].get("step") if found else None
    return step if isinstance(step, int) else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder: its newest complete checkpoint, the one `--resume` continues from.
    Not the `latest` file's: a save writes that after renaming the checkpoint into place, so a crash between the
    two leaves it naming the step before (or missing after a run's first save), and readers that followed it
    loaded an older step than the trainer continues from, without a word."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    # Listed, not repaired: a trainer may hold the folder (an interrupted re-save reads from its old copy).
    existing = list_checkpoints(path)
    if existing:
        return existing[-1]
    raise CheckpointError(f"no checkpoint at {path}: expected a checkpoint folder with {MANIFEST} "
                          f"or a run folder with complete checkpoints under checkpoints/")


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """Return `(weights, train_state, manifest)` after checking the files against the manifest."""
    ckpt = resolve_checkpoint(path)
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{ckpt / MANIFEST} is unreadable: {err}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
        raise CheckpointError(f"{ckpt / MANIFEST} is not a checkpoint manifest: it lacks the run's config")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION}")
    digests = manifest.get("sha256", {})
    if not isinstance(digests, dict) or not {WEIGHTS, STATE} <= digests.keys():
        raise CheckpointError(f"{ckpt / MANIFEST} lacks the SHA-256 of {WEIGHTS} and {STATE}: cannot check them")
    for fname, expected in digests.items():
        file = ckpt / fname
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if _sha256(file) != expected:
            raise CheckpointError(f"{file} is corrupt or truncated (SHA-256 differs from {MANIFEST})")
    weights = with_added_buffers(load_file(ckpt / WEIGHTS), checkpoint_config(manifest, ckpt).attention)
    state = torch.load(ckpt / STATE, map_location="cpu", weights_only=False)
    return weights, state, manifest


def with_added_buffers(weights: dict[str, torch.Tensor], attention: AttentionConfig) -> dict[str, torch.Tensor]:
    """Checkpoints saved before DSV gained a buffer, completed with the value that reproduces them:
    `keep_boost` (the recall floor's widening, added later) is zero beside each `keep_fraction`; a diffusers
    model's controller `layout` (added later) is that of `attention`, the config the run was trained with."""
    for name in [k for k in weights if k.endswith(".keep_fraction")]:
        boost = name[: -len("keep_fraction")] + "keep_boost"
        if boost not in weights:
            weights[boost] = torch.zeros_like(weights[name])
    for name in [k for k in weights if k == f"{CONTROLLER_NAME}.stage" or k.endswith(f".{CONTROLLER_NAME}.stage")]:
        layout = name[: -len("stage")] + LAYOUT_BUFFER
        if layout not in weights:
            weights[layout] = layout_record(attention)
    return weights


def check_weights_match(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise a `CheckpointError` listing missing, unexpected and mis-shaped tensors (shapes are global
    shapes, also for a model sharded with FSDP)."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shape_diff = [f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(v.shape)}"
                  for k, v in expected.items() if k in weights and weights[k].shape != v.shape]
    if missing or unexpected or shape_diff:
        lines = [f"checkpoint {source} does not match the model:"]
        if missing:
            lines.append(f"  missing {len(missing)} tensors, e.g. {missing[:3]}")
        if unexpected:
            lines.append(f"  unexpected {len(unexpected)} tensors, e.g. {unexpected[:3]}")
        if shape_diff:
            lines.append(f"  {len(shape_diff)} shape mismatches, e.g. {shape_diff[:3]}")
        raise CheckpointError("\n".join(lines))


def load_weights_into(model: nn.Module, weights: dict[str, torch.Tensor], source: str) -> None:
    """Strict load with an error that lists the mismatches instead of a wall of text."""
    check_weights_match(model, weights, source)
    model.load_state_dict(weights)
