"""Making writes durable: a file's data, or a folder's entries (a rename into it), on disk."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file (its data) or a folder (its entries: a file renamed into it stays renamed after a power
    loss)."""
    handle = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def check_folder_possible(path: str | os.PathLike, name: str) -> None:
    """ValueError naming `name` unless `path` is a folder or can be made one: neither it nor the nearest of its
    ancestors that exists is a file. For checking an output path before minutes of work, not after."""
    path = Path(path).absolute()
    existing = next(folder for folder in (path, *path.parents) if folder.exists())
    if not existing.is_dir():
        raise ValueError(f"{name} {path}: {existing} is a file, not a folder")
