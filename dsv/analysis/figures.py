"""Writing matplotlib figures: whole or not at all, as the reports' text files are."""

from __future__ import annotations

import os
from pathlib import Path

from dsv.train.durable import fsync_path


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out `fig`, write it to `path` atomically (a hidden file in the same folder, synced, then renamed over
    `path`: a crash leaves the earlier figure or none, never half of one, beside the report it belongs to), and
    close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")  # the suffix names the format
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=dpi)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
